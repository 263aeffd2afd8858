import dataclasses
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from fedge.algorithms.fd import FDDistillation
from fedge.algorithms.fedavg import CrossEntropy
from fedge.algorithms.fedcurv import FisherProximal
from fedge.algorithms.fedprox import Proximal, proximal
from fedge.algorithms.scaffold import Correction
from fedge.errors import ConfigError
from fedge.learning.models import build_model, exchanged_state
from fedge.learning.terms import LocalTerm, TermBatch, TermCall
from fedge.learning.training import (
    MomentumSGD,
    SGDSettings,
    TrainRequest,
    batch_order,
    check_hooks,
    predict_logits,
    required_hooks,
    train,
)


def test_batch_order_is_deterministic_and_covers_every_sample_each_epoch():
    a = batch_order(10, 2, 4, seed=5)
    assert [len(b) for b in a] == [4, 4, 2, 4, 4, 2]
    assert all(torch.equal(x, y) for x, y in zip(a, batch_order(10, 2, 4, seed=5), strict=True))
    assert sorted(torch.cat(a[:3]).tolist()) == list(range(10))
    assert not all(torch.equal(x, y) for x, y in zip(a, batch_order(10, 2, 4, seed=6), strict=True))


def test_batch_order_drops_a_trailing_single_sample():
    assert [len(b) for b in batch_order(9, 1, 4, seed=0)] == [4, 4]


def test_training_lowers_the_loss_and_is_reproducible():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1, 8, 8, generator=g)
    y = (x.mean(dim=(1, 2, 3)) > 0).long()
    results = []
    for _ in range(2):
        model = build_model("fedavg_cnn", input_shape=(1, 8, 8), num_classes=2, seed=1)
        before = F.cross_entropy(predict_logits(model, x), y)
        train(model, TrainRequest(x, y, CrossEntropy(), SGDSettings(lr=0.05, momentum=0.9), 5, 16, seed=3))
        after = F.cross_entropy(predict_logits(model, x), y)
        assert after < before
        results.append(predict_logits(model, x))
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.0, 0.0), (0.9, 0.0), (0.9, 1e-3), (0.0, 1e-3)])
def test_momentum_sgd_gives_torch_optim_sgd_weights_bit_for_bit(foreach, momentum, weight_decay):
    """Both of torch's paths: per-tensor (its CPU default) and foreach (its CUDA default, run here on the CPU)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 1, 8, 8, generator=g), torch.randint(0, 3, (40,), generator=g)
    models = [build_model("fedavg_cnn", input_shape=(1, 8, 8), num_classes=3, seed=2) for _ in range(2)]
    params = [list(m.parameters()) for m in models]
    params[0][-1].requires_grad_(False)  # a parameter without a gradient is left alone by both
    ours = MomentumSGD(params[0], SGDSettings(lr=0.05, momentum=momentum, weight_decay=weight_decay))
    ours.foreach = foreach
    params[1][-1].requires_grad_(False)
    theirs = torch.optim.SGD(params[1], lr=0.05, momentum=momentum, weight_decay=weight_decay, foreach=foreach)
    for step in range(4):
        for model, opt in ((models[0], ours), (models[1], theirs)):
            opt.zero_grad()
            F.cross_entropy(model(x[step * 10 : step * 10 + 10]), y[step * 10 : step * 10 + 10]).backward()
            opt.step()
        for a, b in zip(params[0], params[1], strict=True):
            assert torch.equal(a, b)
    fresh = build_model("fedavg_cnn", input_shape=(1, 8, 8), num_classes=3, seed=2)
    assert torch.equal(params[0][-1], list(fresh.parameters())[-1])


def test_training_does_not_import_torch_dynamo():
    """The reason :class:`MomentumSGD` exists: torch.optim's first optimizer imports torch._dynamo and sympy."""
    code = (
        "import sys, torch\n"
        "from fedge.algorithms.fedavg import CrossEntropy\n"
        "from fedge.learning.models import build_model\n"
        "from fedge.learning.training import SGDSettings, TrainRequest, train\n"
        "m = build_model('fedavg_cnn', input_shape=(1, 8, 8), num_classes=2, seed=0)\n"
        "x, y = torch.randn(8, 1, 8, 8), torch.tensor([0, 1] * 4)\n"
        "train(m, TrainRequest(x, y, CrossEntropy(), SGDSettings(lr=0.1, momentum=0.9, weight_decay=1e-4), 1, 4, 0))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", ["fedavg_cnn", "dsfl_mnist_cnn"])
def test_predict_logits_runs_channels_last_on_a_copy_and_matches_the_default_layout(name):
    x = torch.randn(300, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    model = build_model(name, input_shape=(1, 28, 28), num_classes=10, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        reference = model.eval()(x)  # the default layout, one batch
    model.train()
    got = predict_logits(model, x)
    assert got.shape == (300, 10)
    assert torch.allclose(got, reference, atol=1e-5, rtol=0)
    assert torch.equal(got.argmax(1), reference.argmax(1))
    assert not model.training  # left in eval mode, as before
    conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d) and m.in_channels > 1)
    assert not conv.weight.is_contiguous(memory_format=torch.channels_last)  # the caller's layout is untouched
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # batch size changes nothing beyond round-off; a model already channels-last gives the same logits
    assert torch.allclose(predict_logits(model, x, batch_size=7), got, atol=1e-5, rtol=0)
    nhwc = model.to(memory_format=torch.channels_last)
    assert torch.allclose(predict_logits(nhwc, x), got, atol=1e-6, rtol=0)


def test_predict_logits_takes_inputs_that_are_not_images():
    model = build_model("tiny_mlp", input_shape=(64,), num_classes=10, seed=0)
    x = torch.randn(5, 64)
    with torch.no_grad():
        assert torch.equal(predict_logits(model, x), model.eval()(x))


def test_fd_objective_ignores_masked_rows():
    logits = torch.randn(4, 3)
    y = torch.tensor([0, 1, 2, 0])
    aux = torch.softmax(torch.randn(4, 3), dim=1)
    none = torch.zeros(4, dtype=torch.bool)
    loss = FDDistillation(gamma=2.0).loss(logits, y, {"targets": aux, "mask": none})
    assert torch.allclose(loss, F.cross_entropy(logits, y))


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def test_proximal_term_adds_mu_times_the_distance_to_the_anchor_to_the_gradient():
    # One plain SGD step on CE + mu/2 ||w - a||^2 equals a CE step plus lr * mu * (w - a), by hand.
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    plain, prox = _linear(), _linear()
    anchor = {k: torch.zeros_like(v) for k, v in prox.named_parameters()}
    w0 = {k: v.detach().clone() for k, v in prox.named_parameters()}
    sgd = SGDSettings(lr=0.1)
    train(plain, TrainRequest(x, y, CrossEntropy(), sgd, 1, 4, 0))
    train(prox, TrainRequest(x, y, CrossEntropy(), sgd, 1, 4, 0, terms=proximal(0.5, anchor)))
    for k, p in prox.named_parameters():
        expected = dict(plain.named_parameters())[k] - 0.1 * 0.5 * (w0[k] - anchor[k])
        assert torch.allclose(p, expected, atol=1e-7)
    at_anchor = dict(prox.named_parameters())
    here = {k: v.detach() for k, v in at_anchor.items()}
    assert Proximal(mu=0.5)(TermBatch(at_anchor, {"anchor": here}, torch.zeros(1, 2), torch.zeros(1))) == 0
    assert proximal(0.0, anchor) == ()  # mu = 0 adds no term: FedAvg's training


def test_correction_is_added_to_every_gradient():
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    plain, corrected = _linear(), _linear()
    correction = {k: torch.full_like(v, 0.25) for k, v in corrected.named_parameters()}
    train(plain, TrainRequest(x, y, CrossEntropy(), SGDSettings(lr=0.1), 1, 4, 0))
    terms = (TermCall(Correction(), {"c": correction}),)
    train(corrected, TrainRequest(x, y, CrossEntropy(), SGDSettings(lr=0.1), 1, 4, 0, terms=terms))
    for k, p in corrected.named_parameters():
        assert torch.allclose(p, dict(plain.named_parameters())[k] - 0.1 * 0.25, atol=1e-7)


def test_a_request_checks_its_inputs():
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    with pytest.raises(ConfigError, match="takes inputs"):
        TrainRequest(x, y, CrossEntropy(), SGDSettings(lr=0.1), 1, 4, 0, inputs={"teacher": torch.zeros(4, 2)})
    with pytest.raises(ConfigError, match="takes the round tensors"):
        TrainRequest(x, y, CrossEntropy(), SGDSettings(lr=0.1), 1, 4, 0, terms=(TermCall(Proximal(mu=0.1)),))
    twice = proximal(0.1, {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}) * 2
    with pytest.raises(ConfigError, match="each local term once"):
        TrainRequest(x, y, CrossEntropy(), SGDSettings(lr=0.1), 1, 4, 0, terms=twice)
    with pytest.raises(ConfigError, match="rows"):
        TrainRequest(x, y, FDDistillation(), SGDSettings(lr=0.1), 1, 4, 0,
                     inputs={"targets": torch.zeros(3, 2), "mask": torch.ones(4, dtype=torch.bool)})  # fmt: skip


def test_on_epoch_reports_each_epochs_mean_loss_and_can_stop_the_training_without_changing_results():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 1, 8, 8, generator=g), torch.randint(0, 2, (20,), generator=g)
    sgd = SGDSettings(lr=0.05, momentum=0.9)
    plain_model = build_model("tiny_mlp", input_shape=(1, 8, 8), num_classes=2, seed=1)
    plain = train(plain_model, TrainRequest(x, y, CrossEntropy(), sgd, 3, 8, seed=3))
    seen = []
    watched_model = build_model("tiny_mlp", input_shape=(1, 8, 8), num_classes=2, seed=1)
    watched = train(watched_model, TrainRequest(x, y, CrossEntropy(), sgd, 3, 8, seed=3, on_epoch=seen.append))
    assert watched == plain and torch.equal(predict_logits(watched_model, x), predict_logits(plain_model, x))
    # 20 samples in batches of 8: three steps per epoch (8, 8, 4); the mean of the epochs' means is the call's mean.
    assert [(p.epoch, p.epochs, p.steps) for p in seen] == [(1, 3, 3), (2, 3, 3), (3, 3, 3)]
    assert sum(p.mean_loss for p in seen) / 3 == pytest.approx(plain.mean_loss)

    class Stop(Exception):
        pass

    def stop_after_two(progress):
        if progress.epoch == 2:
            raise Stop

    with pytest.raises(Stop):
        train(
            build_model("tiny_mlp", input_shape=(1, 8, 8), num_classes=2, seed=1),
            TrainRequest(x, y, CrossEntropy(), sgd, 3, 8, seed=3, on_epoch=stop_after_two),
        )


def test_proximal_weights_of_one_are_the_plain_term_and_weight_each_element():
    """The Fisher-weighted pull mu/2 * sum F (w - a)^2: F = 1 is FedProx's term bit for bit; otherwise one SGD step
    adds lr * mu * F * (w - a) per element, by hand."""
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    sgd = SGDSettings(lr=0.1)
    plain, prox, ones, weighted = _linear(), _linear(), _linear(), _linear()
    anchor = {k: torch.full_like(v, 0.3) for k, v in prox.named_parameters()}
    w0 = {k: v.detach().clone() for k, v in prox.named_parameters()}
    fisher = {k: torch.rand(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in prox.named_parameters()}
    unit = {k: torch.ones_like(v) for k, v in w0.items()}
    train(plain, TrainRequest(x, y, CrossEntropy(), sgd, 1, 4, 0))

    def pull(weights):
        return (TermCall(FisherProximal(mu=0.5), {"anchor": anchor, "weights": weights}),)

    train(prox, TrainRequest(x, y, CrossEntropy(), sgd, 1, 4, 0, terms=proximal(0.5, anchor)))
    train(ones, TrainRequest(x, y, CrossEntropy(), sgd, 1, 4, 0, terms=pull(unit)))
    train(weighted, TrainRequest(x, y, CrossEntropy(), sgd, 1, 4, 0, terms=pull(fisher)))
    for k, p in weighted.named_parameters():
        assert torch.equal(dict(ones.named_parameters())[k], dict(prox.named_parameters())[k])
        expected = dict(plain.named_parameters())[k] - 0.1 * 0.5 * fisher[k] * (w0[k] - anchor[k])
        assert torch.allclose(p, expected, atol=1e-7)
    with pytest.raises(ConfigError, match="takes the round tensors"):
        TermCall(FisherProximal(mu=0.5), {"weights": unit})


@dataclass(frozen=True)
class _PullToReference(LocalTerm):
    """The squared distance of the representation to a frozen reference model's (not registered)."""

    kind = "test-pull"
    references = ("ref",)
    representation = True

    def __call__(self, b):
        return (b.z - b.reference_z["ref"]).pow(2).sum(dim=1).mean()


def test_a_loss_sees_the_representation_of_the_trained_and_of_the_frozen_reference_model():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
    model = build_model("tiny_mlp", input_shape=(1, 8, 8), num_classes=3, seed=1)
    reference = build_model("tiny_mlp", input_shape=(1, 8, 8), num_classes=3, seed=2)
    by_hand = build_model("tiny_mlp", input_shape=(1, 8, 8), num_classes=3, seed=1)
    pull = TermCall(_PullToReference(), references={"ref": exchanged_state(reference)})
    request = TrainRequest(x, y, CrossEntropy(), SGDSettings(lr=0.1), 1, 6, 0, terms=(pull,))
    train(model, request)
    z = by_hand.representation(x)
    loss = F.cross_entropy(by_hand.head(z), y) + (z - reference.representation(x).detach()).pow(2).sum(1).mean()
    loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), by_hand.named_parameters(), strict=True):
        assert torch.allclose(p, q - 0.1 * q.grad, atol=1e-6), name
    with pytest.raises(ConfigError, match="compares with the reference models"):
        TermCall(_PullToReference())
    linear = torch.nn.Linear(64, 3)  # no representation/head split
    flat = TrainRequest(x.flatten(1), y, CrossEntropy(), SGDSettings(lr=0.1), 1, 6, 0,
                        terms=(TermCall(_PullToReference(), references={"ref": exchanged_state(linear)}),))  # fmt: skip
    with pytest.raises(ConfigError, match="no representation"):
        train(linear, flat)


def test_the_fisher_diagonal_is_the_squared_gradient_of_the_trained_weights_and_keeps_bn_statistics():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, generator=g), torch.randint(0, 2, (8,), generator=g)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    stats = train(model, TrainRequest(x, y, CrossEntropy(), SGDSettings(lr=0.1), 1, 4, 0))
    assert stats.fisher is None  # not asked for
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # One batch of all 8 samples: the Fisher is the squared gradient of the mean CE, in training mode.
    stats = train(model, TrainRequest(x, y, CrossEntropy(), SGDSettings(lr=0.1), 0, 8, 0, fisher_samples=500))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # weights and BN statistics
    grads = torch.autograd.grad(F.cross_entropy(model.train()(x), y), list(model.parameters()))
    assert stats.fisher is not None and list(stats.fisher) == [k for k, _ in model.named_parameters()]
    for (k, _), gr in zip(model.named_parameters(), grads, strict=True):
        assert torch.allclose(stats.fisher[k], gr.pow(2), atol=1e-9), k
    # Batches of 2 until more than 3 samples are seen: two batches, so a different mean than the full batch.
    model.load_state_dict(before)
    capped = train(model, TrainRequest(x, y, CrossEntropy(), SGDSettings(lr=0.1), 0, 2, 0, fisher_samples=3))
    assert capped.fisher is not None and not torch.allclose(capped.fisher["0.weight"], stats.fisher["0.weight"])


def test_every_training_runtime_runs_the_representation_hook_and_a_runtime_without_it_refuses():
    from edge_client.backends import RUNTIME_HOOKS

    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    anchor = {k: v.detach() for k, v in _linear().named_parameters()}
    plain = TrainRequest(x, y, CrossEntropy(), SGDSettings(lr=0.1), 1, 4, 0, terms=proximal(0.1, anchor))
    reading = dataclasses.replace(plain, terms=(TermCall(_PullToReference(), references={"ref": anchor}),))
    assert required_hooks(plain) == frozenset() and required_hooks(reading) == {"representation"}
    for runtime in ("torch", "executorch", "onnxruntime-training"):
        check_hooks(reading, RUNTIME_HOOKS[runtime], runtime)
    with pytest.raises(ConfigError, match=r"onnxruntime runtime cannot run the training hook\(s\) representation"):
        check_hooks(reading, RUNTIME_HOOKS["onnxruntime"], "onnxruntime")
