"""Console lines every role prints for a round: the same words in ``fedge sim`` and ``fedge coordinator``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

from fedge.accounting.records import RoundRecord
from fedge.accounting.units import format_bytes
from fedge_io.rundir import skipped_text


def round_line(r: RoundRecord) -> str:
    """One round on the console: accuracy, forgetting, entropy, bytes, wall time, and what went wrong."""
    line = f"round {r.round:3d}"
    if r.accuracy is not None:
        line += f"  acc {100 * r.accuracy:6.2f}%"
        if r.forgetting is not None:
            line += f"  F {r.forgetting:.3f}"
    if "global_logit_entropy" in r.metrics:
        line += f"  H {r.metrics['global_logit_entropy']:.3f}"
    if "dp_epsilon" in r.metrics:
        line += f"  eps {r.metrics['dp_epsilon']:.3f}"
    b = r.bytes
    line += (
        f"  up {format_bytes(b.tensor_up)}  down {format_bytes(b.tensor_down['multicast'])}"
        f"  cum {format_bytes(b.cum_tensor['multicast'])}"
    )
    if b.wire:
        line += f"  wire {format_bytes(b.wire)}"
    line += f"  {r.wall_s:.1f} s"
    if not r.aggregated:
        line += f"  SKIPPED: {r.abandoned or f'{len(r.replied)} of {len(r.sampled)} replied, quorum {r.quorum}'}"
    if r.drops:
        line += "  dropped " + ", ".join(f"{d.client} ({d.reason})" for d in r.drops)
    if r.rejections:
        line += f"  rejected {len(r.rejections)}"
    return line


def add_skipped_rounds_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-skipped-rounds",
        action="store_true",
        help="exit 0 even when rounds were skipped (below the quorum); without it such a run exits with status 3",
    )


def skipped_rounds_status(summary: Mapping[str, Any], *, allowed: bool) -> int:
    """Print which rounds were skipped and why; the exit status: 3 when some were and the user did not allow it."""
    skipped = summary.get("skipped", [])
    if not skipped:
        return 0
    print(f"skipped rounds, {len(skipped)} of {summary.get('rounds')}:\n{skipped_text(summary)}")
    if allowed:
        return 0
    print(
        f"fedge: {len(skipped)} round(s) were skipped, so the model saw less training than configured; exit status 3 "
        "(--allow-skipped-rounds accepts this)",
        file=sys.stderr,
    )
    return 3
