"""FedDecorr: two rounds of two clients against a float64 hand computation of its local loss; the batched executor;
the ExecuTorch and ONNX Runtime training programs of its term through the parity gate."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from algorithm_support import TwoClients, config
from torch import nn

from fedge.algorithms.fedavg import CrossEntropy
from fedge.algorithms.feddecorr import Decorrelation, FedDecorrSettings
from fedge.learning.models import exchanged_state
from fedge.learning.terms import TermBatch, TermCall
from fedge.learning.training import SGDSettings, TrainRequest, train

BETA, LR, STEPS = 2.0, 0.5, 2
Weights = dict[str, torch.Tensor]
ROOT = Path(__file__).resolve().parents[3]

# Client "a" holds 5 samples, "b" 4, of 2 features; a hidden layer of 3 makes a 3 x 3 correlation matrix.
X_A = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-0.5, 0.8], [0.3, -1.2]])
Y_A = torch.tensor([0, 1, 2, 1, 0])
X_B = torch.tensor([[0.7, 0.2], [-1.0, 0.4], [0.1, 0.9], [0.6, -0.6]])
Y_B = torch.tensor([2, 0, 1, 2])


class Wide(nn.Module):
    """2 features -> tanh hidden layer of 3 (the representation) -> 3 classes, bias-free, fixed weights."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 3, bias=False)
        self.outer = nn.Linear(3, 3, bias=False)
        with torch.no_grad():
            self.inner.weight.copy_(torch.tensor([[0.5, -0.3], [0.2, 0.4], [0.6, 0.5]]))
            self.outer.weight.copy_(torch.tensor([[0.1, -0.2, 0.3], [0.0, 0.4, -0.1], [-0.3, 0.2, 0.2]]))

    def representation(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(x))

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.outer(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.representation(x))


def _penalty(z: torch.Tensor) -> torch.Tensor:
    """||K||_F^2 / d^2 written out entry by entry: K_ij = mean_n z^_ni z^_nj of the standardized representation."""
    n, d = z.shape
    mean = z.sum(dim=0) / n
    std = torch.sqrt(((z - mean) ** 2).sum(dim=0) / n + 1e-8)
    standard = (z - mean) / std
    total = torch.zeros((), dtype=z.dtype)
    for i in range(d):
        for j in range(d):
            total = total + (sum(standard[s, i] * standard[s, j] for s in range(n)) / n) ** 2
    return total / d**2


def _local(x: torch.Tensor, y: torch.Tensor, start: Weights, beta: float) -> Weights:
    """Full-batch plain gradient steps on CE + beta * penalty, in float64."""
    w = {k: v.double().clone().requires_grad_(True) for k, v in start.items()}
    for _ in range(STEPS):
        z = torch.tanh(x.double() @ w["inner.weight"].T)
        loss = F.cross_entropy(z @ w["outer.weight"].T, y) + beta * _penalty(z)
        grads = torch.autograd.grad(loss, list(w.values()))
        w = {k: (v - LR * g).detach().requires_grad_(True) for (k, v), g in zip(w.items(), grads, strict=True)}
    return {k: v.detach().float() for k, v in w.items()}


def _average(a: Weights, b: Weights) -> Weights:
    return {k: (5 * a[k] + 4 * b[k]) / 9 for k in a}  # by data size


def _close(got: Weights, want: Weights) -> bool:
    return all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)


def test_two_rounds_follow_the_decorrelation_penalty() -> None:
    data = ((X_A, Y_A), (X_B, Y_B))
    run = TwoClients(
        config("feddecorr", FedDecorrSettings(decorr_beta=BETA), local_epochs=STEPS), data=data, model=Wide
    )
    server = exchanged_state(Wide())
    for rnd in (1, 2):
        run.round(rnd)
        server = _average(_local(X_A, Y_A, server, BETA), _local(X_B, Y_B, server, BETA))
        assert _close(run.strategy.global_weights(), server), rnd
    w0 = exchanged_state(Wide())
    assert not _close(_local(X_A, Y_A, w0, BETA), _local(X_A, Y_A, w0, 0.0))  # the penalty changes the steps
    (term,) = run.backend("a").requests[-1].terms
    assert term.term == Decorrelation(beta=BETA)
    plain = TwoClients(config("feddecorr", FedDecorrSettings(decorr_beta=0.0)), data=data, model=Wide)
    plain.round(1)
    assert plain.backend("a").requests[-1].terms == ()  # beta = 0 is FedAvg's training


def test_a_single_sample_batch_has_no_penalty_and_no_nan() -> None:
    z = torch.randn(1, 4, requires_grad=True)
    value = Decorrelation(beta=1.0)(_batch(z))
    (grad,) = torch.autograd.grad(value, [z])
    assert float(value.detach()) == 0.0 and torch.equal(grad, torch.zeros_like(z))


def _batch(z: torch.Tensor) -> TermBatch:
    return TermBatch({}, {}, torch.zeros(len(z), 3), torch.zeros(len(z), dtype=torch.long), z=z)


def _requests() -> list[TrainRequest]:
    gen = torch.Generator().manual_seed(0)
    sgd = SGDSettings(lr=0.1, momentum=0.9)
    term = (TermCall(Decorrelation(beta=0.5)),)
    out = []
    for n, seed in ((20, 1), (15, 2)):
        x, y = torch.randn(n, 2, generator=gen), torch.randint(0, 3, (n,), generator=gen)
        out.append(TrainRequest(x, y, CrossEntropy(), sgd, 2, 6, seed, terms=term))
    return out


def test_the_batched_executor_trains_it_as_eager_pytorch() -> None:
    from sim.executors.stacked import train_stacked

    model, requests = Wide(), _requests()
    start = exchanged_state(model)
    stacked = train_stacked(model, [start, start], requests, torch.device("cpu"))
    for request, (weights, stats) in zip(requests, stacked, strict=True):
        eager = Wide()
        reference = train(eager, request)
        assert stats.steps == reference.steps and stats.mean_loss == pytest.approx(reference.mean_loss, abs=1e-5)
        assert all(torch.allclose(weights[k], v, atol=1e-5) for k, v in exchanged_state(eager).items())
        assert not torch.allclose(weights["inner.weight"], start["inner.weight"], atol=1e-3)


@pytest.mark.isa
@pytest.mark.timeout(900)  # exports plus the gates' eager float64 runs on a loaded 2-core host
def test_the_executorch_program_passes_the_gate_and_trains_as_eager_pytorch() -> None:
    """The term traced into an ExecuTorch training program (made through the parity-gated cache: a refused program
    raises), then a client's training on it against the torch backend's."""
    from export_support import SPECS, program_cache, weights

    from edge_client.backends.executorch import ExecuTorchBackend
    from export.cache import ExportingSource
    from fedge.learning.backend import TorchBackend

    spec = SPECS["tiny_mlp"]
    et = ExecuTorchBackend(spec.name, spec.input_shape, spec.num_classes, programs=ExportingSource(program_cache()))
    pt = TorchBackend(spec.name, spec.input_shape, spec.num_classes)
    for b in (et, pt):
        b.set_weights(weights("tiny_mlp"))
    gen = torch.Generator().manual_seed(3)
    x, y = spec.example(37, seed=4), torch.randint(0, 10, (37,), generator=gen)
    sgd = SGDSettings(lr=0.05, momentum=0.9, weight_decay=1e-4)
    request = TrainRequest(x, y, CrossEntropy(), sgd, 2, 8, 11, terms=(TermCall(Decorrelation(beta=0.5)),))
    stats = [b.train(request) for b in (et, pt)]
    assert stats[0].mean_loss == pytest.approx(stats[1].mean_loss, abs=1e-5)
    w_et, w_pt = et.get_weights(), pt.get_weights()
    assert max(float((w_et[k] - w_pt[k]).abs().max()) for k in w_pt) < 1e-5


ORT_PYTHON = ROOT / ".venv-ort-training" / "bin" / "python"


@pytest.mark.isa
@pytest.mark.timeout(900)
@pytest.mark.skipif(not ORT_PYTHON.exists(), reason=f"{ORT_PYTHON} is absent: install it with `make ort-training`")
def test_the_onnxruntime_training_artifacts_pass_the_gate(tmp_path: Path) -> None:
    """Made in ``.venv-ort-training`` through its parity-gated artifact cache (logits, stepwise and drift parity
    against eager float64, :func:`export.ort_training.check.check_artifacts`)."""
    case = {"id": "feddecorr", "model": "tiny_mlp", "input_shape": [1, 8, 8], "batch": 50, "steps": 8}
    case |= {"objective": "ce", "terms": ["decorr:beta=0.5"], "gate": True}
    (tmp_path / "cases.json").write_text(json.dumps([case]))
    worker = ROOT / "tests" / "export" / "ort_training_worker.py"
    done = subprocess.run(
        [str(ORT_PYTHON), str(worker), str(tmp_path / "cases.json"), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (result,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(result["gate"]) >= 3 and all(" ok:" in line for line in result["gate"]), result["gate"]
