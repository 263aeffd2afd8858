"""ExecuTorch: inference parity for every model, training programs against eager PyTorch, the backend."""

from __future__ import annotations

import pytest
import torch
from export_support import SPECS, model_with, program_cache, pte_export, training_program, weights

from edge_client.backends.executorch import ExecuTorchBackend
from export.parity import WEIGHT_TOLERANCE, check_pte, check_training, require
from export.program import TrainingObjective
from export.runners import PteTrainer
from fedge.backend import TorchBackend
from fedge.errors import ConfigError, ExportError
from fedge.training import Objective, SGDSettings


@pytest.mark.parametrize("name", sorted(SPECS))
def test_executorch_logits_match_eager_for_every_model(name: str) -> None:
    (report,) = require(check_pte(pte_export(name), weights(name), source=name))  # XNNPACK-delegated
    assert report.runtime == "executorch"


def test_a_training_program_follows_eager_through_bn_and_max_pooling_with_momentum_and_weight_decay() -> None:
    """dsfl_mnist_cnn: conv-BN-ReLU-maxpool twice, fc-BN; FedNTD loss with tau and beta baked in."""
    data = training_program("dsfl_mnist_cnn", "ntd")
    _, training = require(check_training(data, weights("dsfl_mnist_cnn"), source="ntd program"))
    assert training.max_abs_diff < WEIGHT_TOLERANCE and "after step" in training.worst
    # Parameter names map one to one to the state dict; BN running statistics are part of the weights and move
    # in training as in eager PyTorch (the check above compares them too).
    trainer = PteTrainer(data)
    start = weights("dsfl_mnist_cnn")
    trainer.set_weights(start)
    assert list(trainer.get_weights()) == list(start)
    spec = SPECS["dsfl_mnist_cnn"]
    x, y, teacher = spec.example(12, seed=5), torch.arange(12) % 10, torch.randn(12, 10)
    trainer.train(x, y, SGDSettings(0.01), epochs=1, batch_size=6, seed=0, aux=teacher)
    after = trainer.get_weights()
    for k in ("features.1.running_mean", "features.1.running_var", "classifier.1.running_var"):
        assert not torch.allclose(after[k], start[k]), k


def test_without_the_max_pool_workaround_the_parity_check_refuses_the_program() -> None:
    """ExecuTorch 1.4.1's max_pool2d_with_indices_backward accumulates into an un-zeroed buffer (upstream #21686)."""
    data = training_program("fedavg_cnn", "ce", max_pool_workaround=False)
    logits, training = check_training(data, source="no-workaround.pte")
    assert logits.passed  # inference is fine: only gradients are wrong
    assert not training.passed and training.max_abs_diff > 1e-3
    with pytest.raises(ExportError, match=r"no-workaround\.pte: training parity on executorch FAILED: max abs diff"):
        require([logits, training])
    # With the decomposition, max pooling trains as in eager: see the dsfl_mnist_cnn test above.


@pytest.mark.parametrize("kind", ["ce", "ntd", "kd", "cad", "soft", "fd"])
def test_every_loss_runs_on_device_as_in_eager(kind: str) -> None:
    """The backend's path: export into the cache, parity-gate, load (programs reused by the fleet tests)."""
    spec = SPECS["tiny_mlp"]
    backend = ExecuTorchBackend(spec.name, spec.input_shape, spec.num_classes, cache_dir=program_cache())
    objective = TrainingObjective(kind)
    data = backend._program(objective, 64)  # raises ExportError if the parity check fails
    _, training = require(check_training(data, source=kind))
    assert training.max_abs_diff < WEIGHT_TOLERANCE
    assert backend.program_path(objective, 64).is_file()


@pytest.mark.parametrize("kind", ["ntd", "lsd", "fd"])
def test_the_executorch_backend_trains_like_the_torch_backend(kind: str) -> None:
    """Same task, same weights out: the batch order, objective inputs and optimizer semantics all line up."""
    spec = SPECS["tiny_mlp"]
    et = ExecuTorchBackend(spec.name, spec.input_shape, spec.num_classes, cache_dir=program_cache())
    pt = TorchBackend(spec.name, spec.input_shape, spec.num_classes)
    start = weights("tiny_mlp")
    for b in (et, pt):
        b.set_weights(start)
    gen = torch.Generator().manual_seed(3)
    x, y = spec.example(37, seed=4), torch.randint(0, 10, (37,), generator=gen)
    aux = pt.logits(x)
    mask = None
    if kind == "fd":
        aux, mask = torch.softmax(torch.randn(37, 10, generator=gen), dim=1), torch.arange(37) % 4 != 0
    objective = Objective(kind, class_weights=torch.full((10,), 0.3) if kind == "lsd" else None)
    sgd = SGDSettings(lr=0.05, momentum=0.9, weight_decay=1e-4)
    stats = [b.train(x, y, objective, sgd, epochs=2, batch_size=8, seed=11, aux=aux, aux_mask=mask) for b in (et, pt)]
    assert stats[0].steps == stats[1].steps == 10  # 37 = 8+8+8+8+5 per epoch
    assert stats[0].mean_loss == pytest.approx(stats[1].mean_loss, abs=1e-5)
    w_et, w_pt = et.get_weights(), pt.get_weights()
    assert max(float((w_et[k] - w_pt[k]).abs().max()) for k in w_pt) < 1e-5
    assert torch.allclose(et.logits(x), pt.logits(x), atol=1e-5, rtol=0)


def test_batches_beyond_a_programs_bound_are_refused() -> None:
    spec = SPECS["tiny_mlp"]
    backend = ExecuTorchBackend(spec.name, spec.input_shape, spec.num_classes, cache_dir=program_cache())
    trainer = PteTrainer(backend._program(TrainingObjective("ce"), 64))
    x = spec.example(150)
    with pytest.raises(ConfigError, match="exceeds the batch bound 64"):
        trainer.train(x, torch.zeros(150, dtype=torch.long), SGDSettings(0.1), epochs=1, batch_size=100, seed=0)
    model = model_with("tiny_mlp")
    from fedge.models import load_exchanged_state

    load_exchanged_state(model, trainer.get_weights())
    with torch.no_grad():
        expected = model.eval()(x)
    assert torch.allclose(trainer.logits(x), expected, atol=1e-5, rtol=0)  # inference splits into batches of 64
