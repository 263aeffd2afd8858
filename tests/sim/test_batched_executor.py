"""The batched executor (stacked local training, torch.func vmap) against the sequential executor.

Tolerance: the stacked kernels (a batched matmul or convolution over the clients' axis) may add in another order than
one small model at a time, so results are equal to the sequential ones up to float32 round-off, which momentum SGD
carries on. Measured (torch 2.13 CPU): tiny_mlp's global weights after 2 rounds were bit for bit the sequential ones
for FedAvg, FedNTD, FedProx and SCAFFOLD; fedavg_cnn's per-client weights within 2.3e-8. We allow ATOL = 1e-4 (one
SGD step moves weights by ~1e-2), and the test of masking is exact (``torch.equal``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from coordinator.engine import RoundEngine
from fedge.algorithms.dsfl import SoftTargets
from fedge.algorithms.fedavg import CrossEntropy
from fedge.algorithms.fedntd import NotTrueDistillation
from fedge.algorithms.moon import ModelContrastive
from fedge.config import RunConfig, TrainConfig
from fedge.errors import ConfigError
from fedge.learning.models import build_model, exchanged_state
from fedge.learning.terms import TermCall
from fedge.learning.training import SGDSettings, TrainRequest, train
from fedge_cli.main import main
from fedge_io.experiment import prepare
from sim.executors import BatchedExecutor, ExecutorTransport, ExperimentClients, make_executor
from sim.executors.stacked import BatchedRefusal, train_stacked

ATOL = 1e-4
FAST = TrainConfig(lr=0.05, momentum=0.9, weight_decay=1e-4, local_epochs=2, batch_size=16)


# Dirichlet(0.5): clients of unequal sizes, so their trailing batches and step counts differ (masking).
def _config(algorithm: str = "fedavg", train: TrainConfig = FAST) -> RunConfig:
    return RunConfig(
        algorithm=algorithm,
        dataset="digits",
        model="tiny_mlp",  # fast; the unit tests below run the convolutional fedavg_cnn
        num_clients=4,
        rounds=2,
        partition="dirichlet",
        dirichlet_alpha=0.5,
        train=train,
    )


def _run(config: RunConfig, name: str, device: str = "cpu") -> tuple[dict[str, torch.Tensor], list, dict[str, dict]]:
    exp = prepare(config)
    with make_executor(name, 1, ExperimentClients(exp.config, device=device)) as exe:
        assert exe.name == name
        strategy = exp.strategy("batched-test", evaluation_device=device)
        transport = ExecutorTransport(exe, sorted(exp.parts))
        engine = RoundEngine(exp.config, strategy, transport, *exp.test_tensors(), initial_bytes=exp.initial_bytes())
        history = engine.run()
    return dict(strategy.global_weights()), history.rounds, {}


@pytest.mark.parametrize("algorithm", ["fedavg", "fedntd", "fedprox", "scaffold"])
def test_two_rounds_match_the_sequential_executor(algorithm: str):
    config = _config(algorithm)
    sizes = {len(i) for i in prepare(config).parts.values()}
    assert len(sizes) > 1, "the partition must give clients of unequal sizes"
    ref_weights, ref_rounds, _ = _run(config, "sequential")
    weights, rounds, _ = _run(config, "batched")
    diff = max(float((weights[k] - ref_weights[k]).abs().max()) for k in ref_weights)
    assert diff < ATOL, diff
    for a, b in zip(rounds, ref_rounds, strict=True):
        assert (a.sampled, a.replied, a.aggregated) == (b.sampled, b.replied, b.aggregated)
        # Tensor bytes are equal; payloads may differ by a few bytes, the reported loss's decimal digits.
        assert (a.bytes.tensor, a.bytes.tensor_up, a.bytes.tensor_down) == (
            b.bytes.tensor,
            b.bytes.tensor_up,
            b.bytes.tensor_down,
        )
        assert a.metrics.keys() == b.metrics.keys()
        for key, value in b.metrics.items():
            assert a.metrics[key] == pytest.approx(value, abs=ATOL), key
        assert a.accuracy == pytest.approx(b.accuracy, abs=2e-3)  # at most one test image changes its argmax


def _requests(objective=None, inputs=None) -> tuple[torch.nn.Module, list[TrainRequest]]:
    model = build_model("fedavg_cnn", input_shape=(1, 8, 8), num_classes=10, seed=0)
    gen = torch.Generator().manual_seed(1)
    sizes = [37, 32, 18]  # unequal: trailing batches of 5, 0 and 2 samples at batch size 16
    sgd = SGDSettings(lr=0.05, momentum=0.9, weight_decay=1e-4)
    out = []
    for i, n in enumerate(sizes):
        x, y = torch.randn(n, 1, 8, 8, generator=gen), torch.randint(0, 10, (n,), generator=gen)
        obj = objective or CrossEntropy()
        ins = inputs(n) if inputs else {}
        out.append(TrainRequest(x, y, obj, sgd, epochs=2 if i == 1 else 1, batch_size=16, seed=10 + i, inputs=ins))
    return model, out


@pytest.mark.parametrize("kind", ["ce", "ntd"])
def test_each_clients_update_matches_its_own_sequential_training(kind: str):
    teacher = lambda n: {"teacher": torch.randn(n, 10, generator=torch.Generator().manual_seed(n))}  # noqa: E731
    model, requests = _requests() if kind == "ce" else _requests(NotTrueDistillation(tau=2.0, beta=1.0), teacher)
    start = exchanged_state(model)
    stacked = train_stacked(model, [start] * len(requests), requests, torch.device("cpu"))
    for request, (weights, stats) in zip(requests, stacked, strict=True):
        alone = build_model("fedavg_cnn", input_shape=(1, 8, 8), num_classes=10, seed=0)
        ref = train(alone, request)
        assert (stats.steps, stats.samples) == (ref.steps, ref.samples)
        assert stats.mean_loss == pytest.approx(ref.mean_loss, abs=ATOL)
        expected = exchanged_state(alone)
        assert max(float((weights[k] - expected[k]).abs().max()) for k in expected) < ATOL


def test_masked_steps_leave_a_finished_client_exactly_untouched():
    """A client's result is the same bit for bit whether the stack trains another client one epoch or three more
    after it finished: masked steps touch neither its weights nor its momentum."""
    model, (a, b, _) = _requests()
    b = dataclasses.replace(b, x=b.x[: len(a.x)], y=b.y[: len(a.x)], epochs=1)  # same length as a: same groups
    start = exchanged_state(model)
    short = train_stacked(model, [start, start], [a, b], torch.device("cpu"))
    long = train_stacked(model, [start, start], [a, dataclasses.replace(b, epochs=4)], torch.device("cpu"))
    assert all(torch.equal(short[0][0][k], long[0][0][k]) for k in start)
    assert long[1][1].steps == 4 * short[1][1].steps
    assert not all(torch.equal(short[1][0][k], long[1][0][k]) for k in start)


def test_what_it_cannot_do_exactly_is_refused_with_the_executor_to_use():
    model, (a, *_) = _requests()
    start = exchanged_state(model)
    augmented = dataclasses.replace(a, augment=dataclasses.replace(a.augment, flip=0.5))
    refs = {"global": start, "previous": start}
    for request, reason in [
        (augmented, "augmentation"),
        (dataclasses.replace(a, fisher_samples=10), "Fisher"),
        (dataclasses.replace(a, terms=(TermCall(ModelContrastive(), references=refs),)), "reference models"),
        (dataclasses.replace(a, objective=SoftTargets(), inputs={"targets": torch.ones(len(a.x), 10) / 10}), "'soft'"),
    ]:
        with pytest.raises(BatchedRefusal, match=reason) as info:
            train_stacked(model, [start], [request], torch.device("cpu"))
        assert "--executor sequential" in str(info.value) and "\n" not in str(info.value)
    bn = build_model("dsfl_mnist_cnn", input_shape=(1, 28, 28), num_classes=10, seed=0)
    with pytest.raises(BatchedRefusal, match="batch norm"):
        train_stacked(bn, [exchanged_state(bn)], [a], torch.device("cpu"))


def test_fedge_sim_with_a_run_it_cannot_do_stops_with_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    flags = ["--dataset", "digits", "--model", "tiny_mlp", "--num-clients", "4", "--rounds", "1", "--augment", "paper"]
    argv = ["sim", "--out", str(tmp_path), *flags, "--executor", "batched", "--quiet", "--no-report"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1]
        == "fedge: error: the batched executor cannot train with augmentation; use --executor sequential or processes"
    )


def test_the_batched_executor_needs_clients():
    with pytest.raises(ConfigError):
        BatchedExecutor()


def test_a_stacked_backend_checks_the_weights_it_is_given():
    from fedge.learning.backend import TorchBackend
    from sim.executors.batched import StackedBackend, _Round

    base = TorchBackend("tiny_mlp", (1, 8, 8), 10)
    weights = base.get_weights()
    backend = StackedBackend(base, {k: tuple(v.shape) for k, v in weights.items()}, _Round(1))
    backend.set_weights(weights)
    assert all(torch.equal(backend.get_weights()[k], v) for k, v in weights.items())
    key = next(iter(weights))
    with pytest.raises(ConfigError, match="missing keys"):
        backend.set_weights({k: v for k, v in weights.items() if k != key})
    with pytest.raises(ConfigError):
        backend.set_weights({**weights, key: weights[key][:1]})


def test_client_data_stays_resident_while_its_tensor_lives():
    exe = BatchedExecutor(clients=[])
    x = torch.randn(5, 3)
    assert exe.resident(x, torch.device("cpu")) is x and not exe._resident  # already there: no copy, no entry
    meta = torch.device("meta")  # another device without a GPU: a copy of shapes only
    first = exe.resident(x, meta)
    assert first.device == meta and exe.resident(x, meta) is first
    del x, first
    assert exe._resident == {}  # freed with the client's tensor: the cache cannot grow without bound


# --- on a GPU (skipped without one; run on a lent GPU machine) -----------------------------------------------------

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
ATOL_CUDA = 1e-3
"""A GPU's convolutions may run in TF32 (cuDNN's default in PyTorch) and add in other orders: further from the CPU
than the CPU's stacked kernels are."""


@CUDA
@pytest.mark.parametrize("kind", ["ce", "ntd"])
def test_on_cuda_each_clients_update_matches_its_sequential_training_on_the_cpu(kind: str):
    teacher = lambda n: {"teacher": torch.randn(n, 10, generator=torch.Generator().manual_seed(n))}  # noqa: E731
    model, requests = _requests() if kind == "ce" else _requests(NotTrueDistillation(tau=2.0, beta=1.0), teacher)
    start = exchanged_state(model)
    stacked = train_stacked(model.cuda(), [start] * len(requests), requests, torch.device("cuda"))
    diffs = []
    for request, (weights, stats) in zip(requests, stacked, strict=True):
        alone = build_model("fedavg_cnn", input_shape=(1, 8, 8), num_classes=10, seed=0)
        ref = train(alone, request)
        assert (stats.steps, stats.samples) == (ref.steps, ref.samples)
        expected = exchanged_state(alone)
        diffs.append(max(float((weights[k].cpu() - expected[k]).abs().max()) for k in expected))
    print(f"{kind}: stacked on cuda vs train on the cpu, max weight difference per client {diffs}")
    assert max(diffs) < ATOL_CUDA, diffs


@CUDA
@pytest.mark.parametrize("algorithm", ["fedavg", "fedntd"])
def test_on_cuda_two_batched_rounds_match_the_sequential_executor_on_the_cpu(algorithm: str):
    config = _config(algorithm)
    ref_weights, ref_rounds, _ = _run(config, "sequential")
    weights, rounds, _ = _run(config, "batched", device="cuda")
    diff = max(float((weights[k].cpu() - ref_weights[k]).abs().max()) for k in ref_weights)
    print(f"{algorithm}: batched on cuda (evaluated there) vs sequential on the cpu, max weight difference {diff}")
    assert diff < ATOL_CUDA, diff
    for a, b in zip(rounds, ref_rounds, strict=True):
        assert (a.sampled, a.aggregated) == (b.sampled, b.aggregated)
        assert a.accuracy == pytest.approx(b.accuracy, abs=2e-3)
