"""Markdown tables and PNG plots for one or more run directories, with the runs overlaid.

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

import dataclasses
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.axis import Axis
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import Formatter, FuncFormatter, MaxNLocator, NullLocator, PercentFormatter

from fedge.accounting.cost import format_bytes
from fedge.accounting.ledger import ACCOUNTING_MODELS, LedgerEntry, read_ledger_csv
from fedge.accounting.records import RoundRecord
from fedge.config import RunConfig
from fedge.errors import ConfigError, FedgeError
from fedge.registry import get_algorithm
from fedge_io.rundir import COMU_THRESHOLDS, read_run

_DPI = 120
_FIGSIZE = (8.0, 5.0)  # inches: 960 x 600 px at 120 dpi
# Runs that overlap exactly (same bytes per round) stay visible: hollow markers of different shapes, dashed lines.
_MARKERS = "osD^vP*Xph<>"
_LINESTYLES = ("-", "--", "-.", ":")
_NONE = "—"
_NUMBER = re.compile(rf"^(?:{_NONE}|[-+]?[\d.,/]+ ?(?:[kMGT]?B|%)?)$")


@dataclass(frozen=True)
class Run:
    """One run directory, loaded."""

    path: Path
    label: str
    config: RunConfig
    rounds: list[RoundRecord]
    summary: dict[str, Any]
    ledger: list[LedgerEntry] | None  # None when the run has no ledger.csv
    finished: bool = True  # False: no summary.json (the run was stopped, or is still running)

    def series(self, key: str, x_key: str = "round") -> tuple[list[float], list[float]]:
        """(x, y) over the rounds that recorded the metric ``key`` (a metrics.jsonl name)."""
        points = [(r.value(x_key), r.value(key)) for r in self.rounds]
        kept = [(x, y) for x, y in points if x is not None and y is not None]
        return [x for x, _ in kept], [y for _, y in kept]

    def has(self, key: str) -> bool:
        return any(r.value(key) is not None for r in self.rounds)


def algorithm_name(config: RunConfig) -> str:
    """``"FedNTD"``, ``"DS-FL ERA"``, ... (DS-FL names its aggregation: ERA, eq. 13, or SA, eq. 16)."""
    name = get_algorithm(config.algorithm).label
    aggregation = getattr(config.algo, "aggregation", None)  # DS-FL's ERA or SA
    return f"{name} {aggregation.upper()}" if aggregation else name


def partition_name(config: RunConfig) -> str:
    """``"IID"``, ``"shards s=2"`` or ``"Dir(α=0.1)"``."""
    if config.partition == "shards":
        return f"shards s={config.shards_per_client}"
    if config.partition == "dirichlet":
        return f"Dir(α={config.dirichlet_alpha:g})"
    return config.partition.upper() if config.partition == "iid" else config.partition


def run_label(config: RunConfig, *, partition: bool = True, dataset: bool = False) -> str:
    """A run's display name: ``"FedNTD (shards s=2)"``, ``"DS-FL ERA"`` (with ``partition=False``), ..."""
    details = ([config.dataset] if dataset else []) + ([partition_name(config)] if partition else [])
    name = algorithm_name(config)
    return f"{name} ({', '.join(details)})" if details else name


def not_a_run(path: str | Path) -> str | None:
    """Why ``path`` is not a run directory with a round to report ("is not ...", "has no ..."), or None."""
    p = Path(path)
    if not p.is_dir():
        return "is not a run directory: it does not exist" if not p.exists() else "is not a run directory"
    missing = [name for name in ("config.json", "metrics.jsonl") if not (p / name).is_file()]
    if missing:
        return f"is not a run directory: it has no {' or '.join(missing)}"
    if (p / "metrics.jsonl").stat().st_size == 0:
        return "has no completed round yet"
    return None


def load_run(path: str | Path) -> Run:
    """Read a run directory; :class:`FedgeError` naming the path if it is not one."""
    p = Path(path)
    reason = not_a_run(p)
    if reason is not None:
        raise FedgeError(f"{p} {reason} (pass directories written by `fedge sim` or `fedge coordinator`)")
    try:
        config, rounds, summary = read_run(p)
    except json.JSONDecodeError as exc:
        raise FedgeError(
            f"{p}: metrics.jsonl or summary.json is not valid JSON ({exc}); is the run corrupted?"
        ) from exc
    ledger = read_ledger_csv(p / "ledger.csv") if (p / "ledger.csv").is_file() else None
    return Run(p, run_label(config), config, rounds, summary, ledger, finished=(p / "summary.json").is_file())


def load_runs(run_dirs: Sequence[Path]) -> list[Run]:
    """Load ``run_dirs`` with the labels a report gives them side by side: only what differs between the runs, made
    unique with the directory name (two ERA runs on different machines, say)."""
    loaded = [load_run(p) for p in run_dirs]
    labels = _labels([r.config for r in loaded], [r.path for r in loaded])
    return [dataclasses.replace(r, label=lab) for r, lab in zip(loaded, labels, strict=True)]


def write_report(run_dirs: Sequence[Path], out_dir: Path, *, accounting: str = "multicast") -> Path:
    """Write ``report.md`` and its PNG plots for ``run_dirs`` into ``out_dir``; returns the path of ``report.md``."""
    if accounting not in ACCOUNTING_MODELS:
        raise ConfigError(f"accounting must be one of {ACCOUNTING_MODELS}, not {accounting!r}")
    if not run_dirs:
        raise ConfigError("write_report needs at least one run directory")
    runs = load_runs(run_dirs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = _write_plots(runs, out, accounting)
    path = out / "report.md"
    path.write_text(_markdown(runs, out, plots, accounting))
    return path


def _labels(configs: Sequence[RunConfig], paths: Sequence[Path]) -> list[str]:
    """Labels that name only what differs between runs, made unique with the directory name."""
    partition = len({partition_name(c) for c in configs}) > 1
    dataset = len({c.dataset for c in configs}) > 1
    labels = [run_label(c, partition=partition, dataset=dataset) for c in configs]
    if len({(c.train.augment, c.train_size) for c in configs}) > 1:  # augmented runs beside unaugmented ones
        labels = [f"{lab}, {_pipeline(c)}" for lab, c in zip(labels, configs, strict=True)]
    labels = [f"{lab} [{p.name}]" if labels.count(lab) > 1 else lab for lab, p in zip(labels, paths, strict=True)]
    return [f"{lab} #{i + 1}" if labels.count(lab) > 1 else lab for i, lab in enumerate(labels)]


def _context(runs: Sequence[Run]) -> str:
    """What all runs share and their labels leave out, for plot titles: ``"digits, shards s=2"``."""
    shared = [
        values.pop()
        for values in ({r.config.dataset for r in runs}, {partition_name(r.config) for r in runs})
        if len(values) == 1
    ]
    return ", ".join(shared)


# ---------------------------------------------------------------------------------------------------------- Markdown


def _provenance(run: Run) -> str:
    """How the run ran, or how far it got when it has no summary.json (which records the transport)."""
    if not run.finished:
        last = run.rounds[-1].round if run.rounds else 0
        return f"unfinished ({last} of {run.config.rounds} rounds recorded, no summary.json: stopped or still running)"
    how = f"{run.summary.get('transport', 'unknown')} transport"
    if "executor" in run.summary:  # fedge sim in one process: who ran the clients, and on what
        how += f", {run.summary['executor']} executor ({run.summary.get('workers', '?')} worker(s))"
    if "device" in run.summary:  # recorded since 2026-11-26; GPU and CPU arithmetic differ at float-noise level
        how += f" on {run.summary['device']}"
    return how


def training_data(config: RunConfig) -> str:
    """The clients' training data as the run's config says: the training-set size and the augmentation (FedNTD B.2)."""
    size = f"a seeded subset of {config.train_size:,} training images" if config.train_size else "all training images"
    if config.train.augment == "none":
        return f"{size}, no augmentation"
    return (
        f"{size}, augmentation {config.train.augment!r} (random crop, horizontal flip and Cutout; fedge.data.augment)"
    )


def _pipeline(config: RunConfig) -> str:
    """A short label for the training data: ``"augment paper, 50000 images"``, ``"no augmentation"``."""
    augment = "no augmentation" if config.train.augment == "none" else f"augment {config.train.augment}"
    return f"{augment}, {config.train_size} images" if config.train_size else augment


def _markdown(runs: Sequence[Run], out: Path, plots: dict[str, str], accounting: str) -> str:
    parts = [f"# fedge report: {', '.join(r.label for r in runs)}\n"]
    parts.append(
        "\n".join(
            f"- **{r.label}**: [`{_rel(r.path, out)}`]({_rel(r.path, out)}), {_provenance(r)}, seed {r.config.seed}, "
            f"{training_data(r.config)}"
            for r in runs
        )
    )
    parts.append(
        f"\nByte figures are tensor-level (what the papers count) under **{accounting}** accounting unless a table says"
        " otherwise: multicast counts a broadcast once (DS-FL Tables I-II), unicast once per recipient (what an MQTT"
        " broker sends on per-client topics). Cumulative figures include the one-time open-set cost ComU@I of DS-FL."
    )
    parts.append("\n## Summary\n")
    parts.append(_summary_table(runs, accounting))
    if plots:
        parts.append("\n## Plots\n")
        parts.extend(f"![{title}]({name})\n" for name, title in plots.items())
    if not any(r.has("accuracy") for r in runs):
        parts.append("\nNo run recorded a test accuracy, so there are no accuracy plots.")
    parts.append("\n## Bytes\n")
    for r in runs:
        parts.append(f"### {r.label}\n")
        parts.append(_bytes_table(r))
    events = _events_table(runs)
    if events:
        parts.append("\n## Dropped, rejected and skipped\n")
        parts.append(events)
    parts.append("\n## Per round\n")
    for r in runs:
        parts.append(f"### {r.label}\n")
        parts.append(_round_table(r, accounting) if r.rounds else "No rounds recorded.\n")
    return "\n".join(parts)


def _summary_table(runs: Sequence[Run], accounting: str) -> str:
    comu = {r.label: r.summary.get("comu_at", {}).get(accounting, {}) for r in runs}
    reached = [f"{t:g}" for t in COMU_THRESHOLDS if any(c.get(f"{t:g}") is not None for c in comu.values())]
    initial = {r.label: int(r.summary.get("initial_tensor_bytes", {}).get(accounting, 0)) for r in runs}
    header = ["Run", "Algorithm", "Dataset", "Partition", "Model", "Clients/round", "Rounds", "Final acc.",
              "Best acc.", "Forgetting F", "Bytes/round (mean)", "Cumulative bytes"]  # fmt: skip
    header += [f"ComU@{100 * float(t):g}%" for t in reached]
    show_initial = any(initial.values())
    if show_initial:
        header.append("ComU@I")
    rows = []
    for r in runs:
        per_round = [x.bytes.tensor[accounting] for x in r.rounds]
        cum = r.rounds[-1].bytes.cum_tensor[accounting] if r.rounds else initial[r.label]
        done = f"{len(r.rounds)}" if len(r.rounds) == r.config.rounds else f"{len(r.rounds)}/{r.config.rounds}"
        row = [
            r.label,
            _algorithm_details(r.config),
            r.config.dataset,
            partition_name(r.config),
            r.summary.get("model") or r.config.model or _NONE,
            f"{r.config.clients_per_round}/{r.config.num_clients}",
            done,
            _pct(r.summary.get("final_accuracy")),
            _pct(r.summary.get("best_accuracy")),
            _num(r.summary.get("final_forgetting")),
            format_bytes(round(sum(per_round) / len(per_round))) if per_round else _NONE,
            format_bytes(int(cum)),
        ]
        row += [_bytes_or_none(comu[r.label].get(t)) for t in reached]
        if show_initial:
            row.append(format_bytes(initial[r.label]) if initial[r.label] else _NONE)
        rows.append(row)
    return _table(header, rows)


def _algorithm_details(config: RunConfig) -> str:
    """The algorithm with the hyperparameters that set it apart (papers' symbols)."""
    details = get_algorithm(config.algorithm).describe(config.algo)
    return f"{algorithm_name(config)} ({details})" if details else algorithm_name(config)


def _round_table(run: Run, accounting: str) -> str:
    optional = [
        ("forgetting", "F", _num),
        ("global_logit_entropy", "Entropy H", _num),
        ("mean_local_loss", "Local loss", _num),
        ("wall_s", "Time (s)", lambda v: f"{v:.2f}"),
    ]
    shown = [(key, title, fmt) for key, title, fmt in optional if run.has(key)]
    notes = {r.round: _round_notes(r) for r in run.rounds}
    header = ["Round", "Accuracy", *(title for _, title, _ in shown), "Up", f"Down ({accounting})", "Round total",
              "Cumulative"]  # fmt: skip
    if any(notes.values()):
        header.append("Notes")
    rows = []
    for r in run.rounds:
        row = [str(r.round), _pct(r.accuracy)]
        row += [fmt(value) if (value := r.value(key)) is not None else _NONE for key, _, fmt in shown]
        b = r.bytes
        byte_values = (b.tensor_up, b.tensor_down[accounting], b.tensor[accounting], b.cum_tensor[accounting])
        row += [format_bytes(v) for v in byte_values]
        if len(header) > len(row):
            row.append(notes[r.round])
        rows.append(row)
    return _table(header, rows)


def _round_notes(record: RoundRecord) -> str:
    notes = []
    if not record.aggregated:
        notes.append(f"skipped: {len(record.replied)} of {len(record.sampled)} replied, quorum {record.quorum}")
    if record.drops:
        notes.append("dropped " + ", ".join(record.dropped))
    if record.rejections:
        notes.append("rejected " + ", ".join(x.client for x in record.rejections))
    return "; ".join(notes)


@dataclass(frozen=True)
class _LevelBytes:
    """A run's bytes at one level; None where the source does not tell (no ledger, or no multicast on a wire)."""

    up: int | None
    down_multicast: int | None
    down_unicast: int | None
    total_multicast: int | None
    total_unicast: int


def _level_bytes(run: Run) -> dict[str, _LevelBytes]:
    """Tensor, payload and wire bytes of a run, split by direction from the ledger (else totals from the metrics)."""
    out = {}
    if run.ledger is not None:
        ups, downs = [e for e in run.ledger if e.direction == "up"], [e for e in run.ledger if e.direction == "down"]
        for level in ("tensor", "payload"):
            up = sum(e.counted(level, "multicast") for e in ups)  # uploads count the same under both models
            down_m, down_u = (sum(e.counted(level, acc) for e in downs) for acc in ACCOUNTING_MODELS)
            out[level] = _LevelBytes(up, down_m, down_u, up + down_m, up + down_u)
        wire_up, wire_down = sum(e.wire_bytes for e in ups), sum(e.wire_bytes for e in downs)
        out["wire"] = _LevelBytes(wire_up, None, wire_down, None, wire_up + wire_down)
        return out

    rb = [r.bytes for r in run.rounds]
    up = sum(b.tensor_up for b in rb)
    down_m, down_u = (sum(b.tensor_down[acc] for b in rb) for acc in ACCOUNTING_MODELS)
    out["tensor"] = _LevelBytes(up, down_m, down_u, up + down_m, up + down_u)
    payload_m, payload_u = (sum(b.payload[acc] for b in rb) for acc in ACCOUNTING_MODELS)
    out["payload"] = _LevelBytes(None, None, None, payload_m, payload_u)
    out["wire"] = _LevelBytes(None, None, None, None, sum(b.wire for b in rb))
    return out


def _bytes_table(run: Run) -> str:
    """Upload and download at every level under both accounting models."""
    levels = _level_bytes(run)
    tensor = levels["tensor"].total_unicast
    header = ["Level", "Upload", "Download (multicast)", "Download (unicast)", "Total (multicast)",
              "Total (unicast)", "vs. tensor (unicast)"]  # fmt: skip
    rows = []
    for level, title in (("tensor", "tensor"), ("payload", "payload"), ("wire", "wire (MQTT)")):
        b = levels[level]
        if level == "wire" and not b.total_unicast:
            continue
        ratio = f"{100 * (b.total_unicast / tensor - 1):+.2f}%" if tensor and level != "tensor" else _NONE
        values = (b.up, b.down_multicast, b.down_unicast, b.total_multicast, b.total_unicast)
        rows.append([title, *(_bytes_or_none(v) for v in values), ratio])
    initial = run.summary.get("initial_tensor_bytes", {})
    if any(initial.values()):
        once = (_bytes_or_none(initial.get(acc)) for acc in ACCOUNTING_MODELS)
        rows.append(["open set once (ComU@I)", _NONE, _NONE, _NONE, *once, _NONE])
    notes = ["Wire bytes are measured MQTT packets, including the broker's fan-out copies, so they have no multicast"]
    notes[0] += " variant." if levels["wire"].total_unicast else " variant; this run has none (no MQTT transport)."
    if run.ledger is None:
        notes.append("This run has no ledger.csv, so payload and wire bytes are shown as totals only.")
    return _table(header, rows) + "\n" + " ".join(notes) + "\n"


def _events_table(runs: Sequence[Run]) -> str:
    rows = []
    for run in runs:
        for r in run.rounds:
            if not r.aggregated:
                why = f"round skipped: {len(r.replied)} of {len(r.sampled)} replied, below the quorum of {r.quorum}"
                rows.append([run.label, str(r.round), _NONE, why])
            rows += [[run.label, str(r.round), d.client, f"dropped: {d.reason or 'no reply in time'}"] for d in r.drops]
            rows += [[run.label, str(r.round), x.client, f"rejected: {x.reason}"] for x in r.rejections]
    return _table(["Run", "Round", "Client", "Event"], rows) if rows else ""


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table; columns of numbers, byte counts and percentages are right-aligned, text left-aligned."""
    align = [
        "--:" if any(row[i] != _NONE for row in rows) and all(_NUMBER.match(row[i]) for row in rows) else ":--"
        for i in range(len(header))
    ]
    lines = [header, align, *rows]
    return "\n".join("| " + " | ".join(_cell(c) for c in line) + " |" for line in lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _pct(value: float | None) -> str:
    return _NONE if value is None else f"{100 * value:.2f}%"


def _num(value: float | None) -> str:
    return _NONE if value is None else f"{value:.3f}"


def _bytes_or_none(value: int | None) -> str:
    return _NONE if value is None else format_bytes(int(value))


def _rel(path: Path, start: Path) -> str:
    return Path(os.path.relpath(path.resolve(), start.resolve())).as_posix()


# ---------------------------------------------------------------------------------------------------------- plots


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
        _PlotSpec("bytes_per_round.png", "Communication per round", "Round",
                  f"Bytes per round (tensor, {accounting}, log scale)", f"tensor_bytes_{accounting}",
                  log_bytes_y=True),
        _PlotSpec("entropy_vs_round.png", "Entropy of the global soft labels (DS-FL eq. 12) vs. round", "Round",
                  "Mean entropy (nats)", "global_logit_entropy"),
        _PlotSpec("forgetting_vs_round.png", "Forgetting F vs. round", "Round",
                  "Forgetting F (mean per-class accuracy drop)", "forgetting"),
    ]  # fmt: skip


def _write_plots(runs: Sequence[Run], out: Path, accounting: str) -> dict[str, str]:
    """Write every plot some run has data for; returns {file name: title} in display order."""
    ctx = _context(runs)
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
    else:
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
