"""The gate of each export kind, on its bytes or its file: an ONNX model and an ExecuTorch inference program pass
logit parity (:mod:`export.gates.logits`); an ExecuTorch training program passes logit parity, the stepwise gate
(:mod:`export.gates.stepwise`) and the drift gate (:mod:`export.gates.drift`). A file's kind is sniffed from its
extension and embedded description.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from export.gates.drift import drift_with_retries
from export.gates.inputs import DRIFT_BATCH, drift_request
from export.gates.logits import check_onnx, check_pte, logits_parity
from export.gates.reference import reference_model
from export.gates.report import ParityReport
from export.gates.stepwise import stepwise_parity
from fedge.errors import ExportError
from fedge.learning.training import TrainRequest
from fedge.programs.spec import ProgramMeta
from fedge.types import StateDict


def check_training(
    data: bytes,
    weights: Mapping[str, torch.Tensor] | None = None,
    *,
    source: str = "ExecuTorch training program",
    batch_size: int | None = None,
) -> list[ParityReport]:
    """Eval-logit parity, stepwise parity and drift parity of an ExecuTorch training program against eager PyTorch.

    Both training checks run ``DRIFT_STEPS`` steps (the program's own SGD optimizer, momentum and weight decay, in the
    batch order of :func:`fedge.learning.training.batch_order`) at ``batch_size`` (default: the smaller of the program's
    batch bound and ``DRIFT_BATCH``) on real-looking data: :func:`~export.gates.stepwise.stepwise_parity` restarts the
    program from eager float64's weights before each step, :func:`~export.gates.drift.drift_parity` lets it run free.
    Wrong gradients (the ExecuTorch 1.4.1 max-pool backward bug) fail the stepwise check by orders of magnitude, and
    error no tie explains (an op that loses precision across a tensor) fails it; the free-running one bounds error that
    only accumulates.

    Without ``weights`` the program's own parameters (and fresh BN statistics) are the starting point.
    """
    from edge_client.backends.runners import PteTrainer

    trainer = PteTrainer(data, source=source)
    spec = trainer.meta.model
    start: StateDict = dict(weights) if weights is not None else trainer.get_weights()
    trainer.set_weights(start)
    reference = reference_model(spec, start)
    reports = [logits_parity(trainer.logits, reference, spec, source=source, runtime=trainer.runtime)]

    def run_from(begin: Mapping[str, torch.Tensor], request: TrainRequest) -> StateDict:
        trainer.set_weights(begin)
        trainer.train(request)
        return trainer.get_weights()

    batch = min(batch_size or DRIFT_BATCH, trainer.meta.max_batch)
    request = drift_request(spec, trainer.loss, batch_size=batch)
    reports.append(stepwise_parity(run_from, spec, start, request, source=source, runtime=trainer.runtime))
    drift = drift_with_retries(
        lambda r: run_from(start, r),
        spec,
        start,
        trainer.loss,
        batch_size=batch,
        source=source,
        runtime=trainer.runtime,
    )
    return [*reports, *drift]


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
