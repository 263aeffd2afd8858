"""Parity checks: an export is used or distributed only if it computes what eager PyTorch computes.

- Logits: the runtime's logits against the eager model's on the same inputs, at two batch sizes (1 and 5, neither
  the export's example batch, so the dynamic batch dimension is exercised), difference below 1e-5.
- Training programs: the weights (parameters and BN running statistics) after each of a few SGD steps with momentum
  and weight decay, through a batch order that ends with a smaller batch, against the same steps in eager PyTorch
  from the same weights (see :func:`check_training`); difference below 1e-5. This is what catches wrong gradients
  such as the ExecuTorch 1.4.1 max-pool backward bug.

"Difference" is ``|a - b| / max(1, |b|)`` elementwise (see :class:`ParityReport`): absolute up to 1, relative above.

A failing check raises :class:`fedge.errors.ExportError` that names the export, the check, the measured difference,
where it was largest and the tolerance.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fedge.errors import ExportError
from fedge.models import exchanged_state, load_exchanged_state
from fedge.programs import ModelSpec, ProgramMeta, TrainingLoss
from fedge.training import SGDSettings, TrainRequest, batch_order, proximal_term
from fedge.types import StateDict

log = logging.getLogger(__name__)

LOGIT_TOLERANCE = 1e-5
WEIGHT_TOLERANCE = 1e-5
LOGIT_BATCHES = (1, 5)

# Training check: 30 samples in batches of 8 -> steps of 8, 8, 8 and 6 samples. The steps are few and the learning
# rate moderate so that float32 round-off (~1e-6 on BN statistics after 4 steps) stays well below the tolerance,
# while a wrong gradient shows at once. Batches of 6+ keep batch norm well-conditioned: with 2-4 samples per batch,
# 1/sqrt(var) amplifies round-off of the batch variance far beyond 1e-5 in any two correct implementations.
TRAIN_SAMPLES = 30
TRAIN_BATCH = 8
TRAIN_SGD = SGDSettings(lr=0.02, momentum=0.9, weight_decay=5e-4)


@dataclass(frozen=True)
class ParityReport:
    """One measured comparison of an export against eager PyTorch.

    ``max_scaled_diff`` is the largest ``|a - b| / max(1, |b|)``: the absolute difference for values up to 1 (nearly
    all weights and most logits), the relative difference above, where float32 round-off grows with the value
    (BN running variances of wide layers reach 5-10; a kernel summing 10,000 products in float32 is off by ~1e-5
    there). The check passes when it is below the tolerance.
    """

    source: str
    check: str  # "logits" or "training"
    runtime: str  # "onnxruntime" or "executorch"
    max_abs_diff: float
    max_scaled_diff: float
    worst: str  # where the largest scaled difference was (a batch size or a weight name)
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_scaled_diff < self.tolerance  # NaN fails

    def __str__(self) -> str:
        verdict = "ok" if self.passed else "FAILED"
        return (
            f"{self.source}: {self.check} parity on {self.runtime} {verdict}: max abs diff {self.max_abs_diff:.3g}, "
            f"scaled {self.max_scaled_diff:.3g} at {self.worst} (tolerance {self.tolerance:.0e})"
        )


def require(reports: Sequence[ParityReport]) -> Sequence[ParityReport]:
    """Return ``reports`` if all passed; else raise ExportError naming each failure and its measured difference."""
    failed = [r for r in reports if not r.passed]
    if failed:
        raise ExportError(
            "export refused, parity check failed: " + "; ".join(str(r) for r in failed) + ". "
            "The runtime does not compute what eager PyTorch computes; do not use or distribute this file."
        )
    return reports


def _compare(
    source: str, check: str, runtime: str, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]], tolerance: float
) -> ParityReport:
    """The report for (got, expected) pairs by name."""
    max_abs, max_scaled, where = 0.0, 0.0, ""
    for name, (got, expected) in pairs.items():
        if got.shape != expected.shape:
            return ParityReport(
                source,
                check,
                runtime,
                math.inf,
                math.inf,
                f"{name} (shape {tuple(got.shape)} vs {tuple(expected.shape)})",
                tolerance,
            )
        if not got.numel():
            continue
        a, b = got.double(), expected.double()
        diff = (a - b).abs()
        scaled = diff / b.abs().clamp(min=1.0)
        if not bool(torch.isfinite(scaled).all()):
            return ParityReport(source, check, runtime, math.nan, math.nan, f"{name} (non-finite)", tolerance)
        max_abs = max(max_abs, float(diff.max()))
        if float(scaled.max()) >= max_scaled:
            max_scaled, where = float(scaled.max()), name
    return ParityReport(source, check, runtime, max_abs, max_scaled, where, tolerance)


def logits_parity(
    run: Callable[[torch.Tensor], torch.Tensor],
    model: nn.Module,
    spec: ModelSpec,
    *,
    source: str,
    runtime: str,
    batches: Sequence[int] = LOGIT_BATCHES,
) -> ParityReport:
    """Compare ``run(x)`` with the eval-mode ``model(x)`` on deterministic inputs of each batch size."""
    model.eval()
    pairs = {}
    for i, b in enumerate(batches):
        x = spec.example(b, seed=100 + i)
        with torch.no_grad():
            expected = model(x)
        pairs[f"batch {b}"] = (run(x), expected)
    return _compare(source, "logits", runtime, pairs, LOGIT_TOLERANCE)


def reference_model(spec: ModelSpec, weights: Mapping[str, torch.Tensor] | None) -> nn.Module:
    """The eager model of ``spec`` holding ``weights`` (or the seed-0 initialization)."""
    model = spec.build(seed=0)
    if weights is not None:
        load_exchanged_state(model, weights)
    return model


def check_onnx(
    data: bytes, weights: Mapping[str, torch.Tensor] | None = None, *, source: str = "ONNX model"
) -> list[ParityReport]:
    """Logit parity of an ONNX model on ONNX Runtime against eager PyTorch with the same weights.

    Without ``weights`` the model's own initializers are the reference weights (they carry state-dict names).
    """
    from edge_client.backends.runners import OnnxRunner

    runner = OnnxRunner(data, source=source)
    reference = reference_model(runner.meta.model, weights if weights is not None else runner.get_weights())
    return [logits_parity(runner.logits, reference, runner.meta.model, source=source, runtime=runner.runtime)]


def check_pte(
    data: bytes, weights: Mapping[str, torch.Tensor], *, source: str = "ExecuTorch program"
) -> list[ParityReport]:
    """Logit parity of an ExecuTorch inference program against eager PyTorch with the weights it was exported from.

    The weights baked into a ``.pte`` cannot be read back by name, so they must be given.
    """
    from edge_client.backends.runners import PteRunner

    runner = PteRunner(data, source=source)
    reference = reference_model(runner.meta.model, weights)
    # Also one batch beyond the program's bound: the runner must split it (the bound must be the real one).
    batches = (*LOGIT_BATCHES, runner.meta.max_batch + 1)
    return [
        logits_parity(
            runner.logits, reference, runner.meta.model, source=source, runtime=runner.runtime, batches=batches
        )
    ]


def training_request(
    spec: ModelSpec, loss: TrainingLoss, *, samples: int = TRAIN_SAMPLES, seed: int = 0
) -> TrainRequest:
    """A deterministic request for a training check: inputs, labels, the objective's inputs and FedProx anchors."""
    gen = torch.Generator().manual_seed(seed)
    c = spec.num_classes
    inputs: dict[str, torch.Tensor] = {}
    for i in loss.objective.inputs:
        shape = i.concrete_shape(c, samples)
        if i.dtype == torch.bool:
            inputs[i.name] = torch.arange(samples) % 3 != 0  # some rows without a target
        elif not i.per_sample:
            inputs[i.name] = torch.rand(shape, generator=gen)
        elif i.name == "teacher":
            inputs[i.name] = 2.0 * torch.randn(shape, generator=gen)  # logits of a confident teacher
        else:
            inputs[i.name] = torch.softmax(2.0 * torch.randn(shape, generator=gen), dim=-1)  # soft targets
    anchor = None
    if loss.prox_mu:
        model = spec.build(seed=seed + 2)
        anchor = {k: v.detach().clone() for k, v in model.named_parameters()}
    return TrainRequest(
        spec.example(samples, seed=seed + 1),
        torch.randint(0, c, (samples,), generator=gen),
        loss.objective,
        TRAIN_SGD,
        epochs=1,
        batch_size=TRAIN_BATCH,
        seed=0,
        inputs=inputs,
        prox_mu=loss.prox_mu,
        anchor=anchor,
    )


def check_training(
    data: bytes, weights: Mapping[str, torch.Tensor] | None = None, *, source: str = "ExecuTorch training program"
) -> list[ParityReport]:
    """Eval-logit parity and training parity of an ExecuTorch training program against eager PyTorch.

    The training check runs the program's steps (its own SGD optimizer, with momentum and weight decay, in the batch
    order of :func:`fedge.training.batch_order`) and, before each step, loads the program's current weights into the
    eager model, which then takes the same step with ``torch.optim.SGD`` (its momentum buffers carried across steps
    like the program's). The difference is measured after every step. Comparing step by step rather than two free
    runs matters: for a CNN with max-pooling the eager gradient itself jumps when the weights move by round-off
    (on dsfl_fmnist_cnn 28x28, perturbing the weights by 2e-7 changes the next gradient by 0.04 in eager PyTorch, as
    near-tied max-pool windows flip), so two correct runtimes drift apart after a few free-running steps. Wrong
    gradients still show at once: the max-pool backward bug gives per-step differences of ~1e-3.

    Without ``weights`` the program's own parameters (and fresh BN statistics) are the starting point.
    """
    from edge_client.backends.runners import PteTrainer

    trainer = PteTrainer(data, source=source)
    spec = trainer.meta.model
    start: StateDict = dict(weights) if weights is not None else trainer.get_weights()
    trainer.set_weights(start)
    reference = reference_model(spec, start)
    reports = [logits_parity(trainer.logits, reference, spec, source=source, runtime=trainer.runtime)]

    r = training_request(spec, trainer.loss)
    sgd = r.sgd
    eager_opt = torch.optim.SGD(reference.parameters(), lr=sgd.lr, momentum=sgd.momentum, weight_decay=sgd.weight_decay)
    program_opt = trainer.optimizer(sgd)
    steps: list[ParityReport] = []
    reference.train()
    for i, idx in enumerate(batch_order(len(r.x), r.epochs, r.batch_size, r.seed)):
        load_exchanged_state(reference, trainer.get_weights())  # in place: the optimizer keeps its momentum
        loss = r.objective.loss(reference(r.x[idx]), r.y[idx], r.batch_inputs(idx))
        if r.prox_mu:
            assert r.anchor is not None
            loss = loss + proximal_term(reference, r.anchor, r.prox_mu)
        eager_opt.zero_grad(set_to_none=True)
        loss.backward()
        eager_opt.step()
        trainer.step(program_opt, trainer.step_inputs(r, idx))
        got, expected = trainer.get_weights(), exchanged_state(reference)
        pairs = {f"{k} after step {i + 1}": (got[k], expected[k]) for k in expected}
        steps.append(_compare(source, "training", trainer.runtime, pairs, WEIGHT_TOLERANCE))
    reports.append(max(steps, key=lambda r: (math.isnan(r.max_scaled_diff), r.max_scaled_diff)))  # NaN is worst
    return reports


def check_bytes(
    data: bytes, kind: str, weights: Mapping[str, torch.Tensor] | None = None, *, source: str = "export"
) -> list[ParityReport]:
    """Run the checks an export of ``kind`` ('onnx', 'pte' or 'pte-train') must pass; does not raise."""
    if kind == "onnx":
        return check_onnx(data, weights, source=source)
    if kind == "pte":
        if weights is None:
            raise ExportError(
                f"{source}: the weights baked into an inference .pte cannot be read back; pass the weights it was "
                "exported from (--weights, or weights.safetensors next to it)"
            )
        return check_pte(data, weights, source=source)
    if kind == "pte-train":
        return check_training(data, weights, source=source)
    raise ExportError(f"{source}: unknown export kind {kind!r}; expected onnx, pte or pte-train")


def sniff(path: Path) -> ProgramMeta:
    """The description embedded in an export file, by its extension (``.onnx`` or ``.pte``)."""
    data = path.read_bytes()
    if path.suffix == ".onnx":
        from edge_client.backends.onnx_file import read_meta

        return read_meta(data, source=str(path))
    if path.suffix == ".pte":
        from edge_client.backends.runners import read_pte_meta

        return read_pte_meta(data, source=str(path))
    raise ExportError(f"{path}: not an export (expected a .onnx or .pte file)")


def check_file(path: Path, weights: Mapping[str, torch.Tensor] | None = None) -> list[ParityReport]:
    """Run the parity checks of the export at ``path`` (see :func:`check_bytes`); does not raise on failure."""
    meta = sniff(path)
    return check_bytes(path.read_bytes(), meta.format, weights, source=str(path))
