"""The report's PNG plots (matplotlib's Agg canvas, no display needed), the runs overlaid."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.axis import Axis
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import Formatter, FuncFormatter, MaxNLocator, NullLocator, PercentFormatter

from sim.report.runs import Run, context

_DPI = 120
_FIGSIZE = (8.0, 5.0)  # inches: 960 x 600 px at 120 dpi
# Runs that overlap exactly (same bytes per round) stay visible: hollow markers of different shapes, dashed lines.
_MARKERS = "osD^vP*Xph<>"
_LINESTYLES = ("-", "--", "-.", ":")


@dataclass(frozen=True)
class _PlotSpec:
    """One plot: which per-round value against which, and how its axes read."""

    name: str
    title: str
    xlabel: str
    ylabel: str
    y_key: str
    x_key: str = "round"
    percent: bool = False  # y is a 0..1 fraction, shown in %
    log_bytes_x: bool = False
    log_bytes_y: bool = False
    integer_x: bool = True  # x counts rounds (else a quantity such as simulated seconds)


@dataclass(frozen=True)
class _Series:
    index: int  # the run's position: its colour, marker and line style
    label: str
    x: list[float]
    y: list[float]


def _plot_specs(accounting: str) -> list[_PlotSpec]:
    return [
        _PlotSpec("accuracy_vs_round.png", "Test accuracy vs. round", "Round", "Test accuracy (%)", "accuracy",
                  percent=True),
        _PlotSpec("accuracy_vs_bytes.png", "Test accuracy vs. cumulative communication",
                  f"Cumulative communication (tensor bytes, {accounting}, log scale)", "Test accuracy (%)",
                  "accuracy", x_key=f"cum_tensor_bytes_{accounting}", percent=True, log_bytes_x=True),
        _PlotSpec("accuracy_vs_sim_time.png", "Test accuracy vs. simulated time", "Simulated time (s)",
                  "Test accuracy (%)", "accuracy", x_key="sim_clock_s", percent=True, integer_x=False),
        _PlotSpec("staleness_vs_step.png", "FedBuff: staleness of the buffered updates vs. server step",
                  "Server step", "Mean staleness (server steps)", "staleness_mean"),
        _PlotSpec("bytes_per_round.png", "Communication per round", "Round",
                  f"Bytes per round (tensor, {accounting}, log scale)", f"tensor_bytes_{accounting}",
                  log_bytes_y=True),
        _PlotSpec("entropy_vs_round.png", "Entropy of the global soft labels (DS-FL eq. 12) vs. round", "Round",
                  "Mean entropy (nats)", "global_logit_entropy"),
        _PlotSpec("epsilon_vs_round.png", "Privacy spent (epsilon at the run's delta) vs. round", "Round",
                  "Epsilon", "dp_epsilon"),
        _PlotSpec("accuracy_vs_epsilon.png", "Test accuracy vs. privacy spent", "Epsilon at the run's delta",
                  "Test accuracy (%)", "accuracy", x_key="dp_epsilon", percent=True),
        _PlotSpec("forgetting_vs_round.png", "Forgetting F vs. round", "Round",
                  "Forgetting F (mean per-class accuracy drop)", "forgetting"),
    ]  # fmt: skip


def write_plots(runs: Sequence[Run], out: Path, accounting: str) -> dict[str, str]:
    """Write every plot some run has data for; returns {file name: title} in display order."""
    ctx = context(runs)
    written = {}
    for spec in _plot_specs(accounting):
        series = []
        for index, run in enumerate(runs):
            points = [
                (x, 100 * y if spec.percent else y)
                for x, y in zip(*run.series(spec.y_key, spec.x_key), strict=True)
                if (x > 0 or not spec.log_bytes_x) and (y > 0 or not spec.log_bytes_y)  # a log axis cannot show 0
            ]
            if points:
                series.append(_Series(index, run.label, [p[0] for p in points], [p[1] for p in points]))
        if series:
            _plot(out / spec.name, spec, f"{spec.title} ({ctx})" if ctx else spec.title, series)
            written[spec.name] = spec.title
    return written


def _plot(path: Path, spec: _PlotSpec, title: str, series: Sequence[_Series]) -> None:
    """One line per run; a run keeps its colour, marker and line style in every plot."""
    fig = Figure(figsize=_FIGSIZE, dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for s in series:
        ax.plot(
            s.x, s.y, label=s.label, color=f"C{s.index % 10}", linestyle=_LINESTYLES[s.index % len(_LINESTYLES)],
            linewidth=1.6, marker=_MARKERS[s.index % len(_MARKERS)], markevery=max(1, len(s.x) // 25),
            markersize=6, fillstyle="none", markeredgewidth=1.3,
        )  # fmt: skip
    if spec.log_bytes_x:
        ax.set_xscale("log")
        _byte_ticks(ax.xaxis, [v for s in series for v in s.x])
    elif spec.integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # rounds
    if spec.log_bytes_y:
        ax.set_yscale("log")
        _byte_ticks(ax.yaxis, [v for s in series for v in s.y])
    if spec.percent:
        ax.yaxis.set_major_formatter(PercentFormatter())
    ax.set_title(title)
    ax.set_xlabel(spec.xlabel)
    ax.set_ylabel(spec.ylabel)
    ax.grid(True, which="major", alpha=0.4)
    ax.grid(True, which="minor", alpha=0.15)
    ax.legend(loc="best", fontsize="small", framealpha=0.85)
    fig.savefig(path)


def _byte_ticks(axis: Axis, values: Sequence[float]) -> None:
    """Byte-unit labels on a log axis; evenly spaced ones where the data span too little for two 1/2/3/5/7 x 10^k."""
    lo, hi = min(values), max(values)
    decades = range(math.floor(math.log10(lo)), math.floor(math.log10(hi)) + 1)
    if sum(lo <= c * 10**k <= hi for k in decades for c in (1, 2, 3, 5, 7)) >= 2:
        axis.set_major_formatter(_ByteLogFormatter())
        axis.set_minor_formatter(_ByteLogFormatter())
    else:
        axis.set_major_locator(MaxNLocator(nbins=6, min_n_ticks=3))
        axis.set_minor_locator(NullLocator())
        axis.set_major_formatter(FuncFormatter(lambda v, _: _short_bytes(v) if v > 0 else ""))


class _ByteLogFormatter(Formatter):
    """Log-axis tick labels in decimal byte units (``"10 MB"``): every decade, and 2x/5x (or more) on short axes."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        if x <= 0 or self.axis is None:
            return ""
        lo, hi = sorted(self.axis.get_view_interval())
        decades = math.log10(hi / lo) if lo > 0 else math.inf
        coeff = round(x / 10 ** math.floor(math.log10(x) + 1e-9), 6)
        shown = {1.0} if decades > 2.5 else ({1.0, 2.0, 5.0} if decades > 1.2 else {1.0, 2.0, 3.0, 5.0, 7.0})
        return _short_bytes(x) if coeff in shown else ""


def _short_bytes(x: float) -> str:
    for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if x >= scale * 0.9995:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} B"
