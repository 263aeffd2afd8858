"""Markdown tables and PNG plots for one or more run directories, with the runs overlaid (``write_report``; the
runs as read in :mod:`sim.report.runs`, the tables in :mod:`sim.report.markdown`, the plots in :mod:`sim.report.plots`).

The central plot is DS-FL Fig. 5: test accuracy against cumulative communication (tensor bytes, log scale), which puts
FL (model weights every round) and DS-FL (open-set outputs every round, plus the one-time open-set cost ComU@I) on one
axis. DS-FL Fig. 3/6 (entropy of the global logits, eq. 12) and FedNTD's forgetting F (eq. 4) get plots when a run
recorded them.

Byte figures are tensor-level unless a table says otherwise, in decimal units (``fedge.accounting.cost.format_bytes``),
under one accounting model: ``"multicast"`` counts a broadcast once (DS-FL Tables I-II), ``"unicast"`` once per
recipient
(what an MQTT broker sends on per-client topics). The bytes section shows every level and both models.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fedge.accounting.ledger import ACCOUNTING_MODELS
from fedge.errors import ConfigError
from sim.report.markdown import markdown
from sim.report.plots import write_plots
from sim.report.runs import load_runs

__all__ = ["write_report"]


def write_report(run_dirs: Sequence[Path], out_dir: Path, *, accounting: str = "multicast") -> Path:
    """Write ``report.md`` and its PNG plots for ``run_dirs`` into ``out_dir``; returns the path of ``report.md``."""
    if accounting not in ACCOUNTING_MODELS:
        raise ConfigError(f"accounting must be one of {ACCOUNTING_MODELS}, not {accounting!r}")
    if not run_dirs:
        raise ConfigError("write_report needs at least one run directory")
    runs = load_runs(run_dirs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(runs, out, accounting)
    path = out / "report.md"
    path.write_text(markdown(runs, out, plots, accounting))
    return path
