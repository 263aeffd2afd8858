"""What a parity check measures and reports, and the rule that refuses an export on any failed check.

"Difference" is ``|a - b| / max(1, |b|)`` elementwise (see :class:`ParityReport`): absolute up to 1, relative above.
A failing check raises :class:`fedge.errors.ExportError` (:func:`require`) that names the export, the check, the
measured difference, where it was largest and the tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from fedge.errors import ExportError


@dataclass(frozen=True)
class ParityReport:
    """One measured comparison of an export against eager PyTorch.

    ``max_scaled_diff`` is the largest ``|a - b| / max(1, |b|)``: the absolute difference for values up to 1 (nearly
    all weights and most logits), the relative difference above, where float32 round-off grows with the value
    (BN running variances of wide layers reach 5-10; a kernel summing 10,000 products in float32 is off by ~1e-5
    there). The check passes when it is below the tolerance.
    """

    source: str
    check: str  # "logits", "step" or "drift"
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


def compare(
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
