"""Logit parity: the runtime's logits against the eager model's on the same inputs, at two batch sizes (1 and 5,
neither the export's example batch, so the dynamic batch dimension is exercised), difference below 1e-5
(:mod:`export.gates.report`). The whole gate of an ONNX model and of an ExecuTorch inference program.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from export.gates.reference import reference_model
from export.gates.report import ParityReport, compare
from fedge.programs.spec import ModelSpec

LOGIT_TOLERANCE = 1e-5
LOGIT_BATCHES = (1, 5)


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
    return compare(source, "logits", runtime, pairs, LOGIT_TOLERANCE)


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
