"""What a DP run's summary and console say about the privacy it spent: the same for ``fedge sim`` and ``fedge
coordinator``, from the rounds' metrics (epsilon at the run's delta after each round,
:mod:`fedge.algorithms.differential_privacy`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fedge.accounting.records import RoundRecord
from fedge.config import RunConfig


def privacy_summary(config: RunConfig, rounds: Sequence[RoundRecord], stopped: str = "") -> dict[str, Any]:
    """A DP run's summary fields: epsilon at delta after its last round, and why it stopped early if it did ({} for a
    run without DP)."""
    if not config.differential_privacy:
        return {}
    last = next((r.metrics for r in reversed(rounds) if "dp_epsilon" in r.metrics), {})
    out: dict[str, Any] = {
        "dp_epsilon": last.get("dp_epsilon", 0.0),
        "dp_delta": config.dp_delta_used,
        "dp_noise_multiplier": config.dp_noise_multiplier,
        "dp_accountant": config.dp_accountant,
        "dp_rounds": len(rounds),
    }
    if stopped:
        out["stopped"] = stopped
    return out


def privacy_line(summary: Mapping[str, Any]) -> str | None:
    """The console's closing line of a DP run: the epsilon spent (None without DP)."""
    if "dp_epsilon" not in summary:
        return None
    return (
        f"privacy: epsilon {summary['dp_epsilon']:.3f} at delta {summary['dp_delta']:.3g} after "
        f"{summary['dp_rounds']} round(s) ({summary['dp_accountant']} accountant, noise multiplier "
        f"{summary['dp_noise_multiplier']:g})"
    )
