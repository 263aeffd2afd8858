"""The report's Markdown: the summary, per-round, bytes and events tables."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fedge.accounting.ledger import ACCOUNTING_MODELS
from fedge.accounting.markdown import markdown_table
from fedge.accounting.records import RoundRecord
from fedge.accounting.units import format_bytes
from fedge.algorithms.catalog import get_algorithm
from fedge.config import RunConfig
from fedge_io.rundir import COMU_THRESHOLDS
from sim.report.runs import Run, algorithm_name, partition_name

_NONE = "—"
_NUMBER = re.compile(rf"^(?:{_NONE}|[-+]?[\d.,/]+ ?(?:[kMGT]?B|%)?)$")


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


def secure_aggregation(run: Run) -> str:
    """How the run's secure aggregation encoded and masked the updates, as its config and round metrics say; "" for
    a run without it."""
    c = run.config
    if not c.secure_aggregation:
        return ""
    first = next((r.metrics for r in run.rounds if "secagg_frac_bits" in r.metrics), {})
    ring = (
        f", {first['secagg_ring_bits']:.0f}-bit ring with {first['secagg_frac_bits']:.0f} fractional bits, degree "
        f"{first['secagg_degree']:.0f}, threshold {first['secagg_threshold']:.0f}"
        if first
        else ""
    )
    dropouts = f", {100 * c.simulate_dropouts:g}% of each cohort vanishing (simulated)" if c.simulate_dropouts else ""
    abandoned = sum(1 for r in run.rounds if r.abandoned)
    gave_up = f", {abandoned} round(s) abandoned" if abandoned else ""
    return f", secure aggregation (SecAgg+: updates clipped to L2 norm {c.secagg_clip:g}{ring}{dropouts}{gave_up})"


def differential_privacy(run: Run) -> str:
    """The run's DP-FedAvg settings and the epsilon it spent, as its config and round metrics say; "" for a run
    without it."""
    c = run.config
    if not c.differential_privacy:
        return ""
    last = next((r.metrics for r in reversed(run.rounds) if "dp_epsilon" in r.metrics), {})
    spent = f", epsilon {last['dp_epsilon']:.3f}" if last else ""
    clip = (
        f"adaptive from {c.dp_initial_clip:g} to quantile {c.dp_target_quantile:g}"
        if c.dp_fixed_clip is None
        else (f"{c.dp_fixed_clip:g}")
    )
    stopped = ", stopped at its budget" if run.summary.get("stopped") else ""
    return (
        f", DP-FedAvg (noise multiplier {c.dp_noise_multiplier:g}, clip {clip}, Poisson q = {c.client_fraction:g}"
        f"{spent} at delta {c.dp_delta_used:.3g}, {c.dp_accountant} accountant{stopped})"
    )


def markdown(runs: Sequence[Run], out: Path, plots: dict[str, str], accounting: str) -> str:
    parts = [f"# fedge report: {', '.join(r.label for r in runs)}\n"]
    parts.append(
        "\n".join(
            f"- **{r.label}**: [`{_rel(r.path, out)}`]({_rel(r.path, out)}), {_provenance(r)}, seed {r.config.seed}, "
            f"{training_data(r.config)}{secure_aggregation(r)}{differential_privacy(r)}"
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
    timed = _time_table(runs)
    if timed:
        parts.append("\n## Simulated time\n")
        parts.append(timed)
    parts.append("\n## Bytes\n")
    for r in runs:
        parts.append(f"### {r.label}\n")
        parts.append(_bytes_table(r))
        if r.ledger is not None and any(e.kind.startswith("secagg.") for e in r.ledger):
            parts.append(_kinds_table(r))
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


def _time_table(runs: Sequence[Run]) -> str:
    """The simulated clock of the runs that kept one (docs/simulated_time.md): profiles, link, time to each accuracy."""
    timed = [r for r in runs if "time_to" in r.summary]
    if not timed:
        return ""
    reached = [f"{t:g}" for t in COMU_THRESHOLDS if any(r.summary["time_to"].get(f"{t:g}") is not None for r in timed)]
    header = ["Run", "Client profiles", "Link", "Reference compute (s/sample-step)", "Deadline", "Simulated time"]
    header += [f"Time to {100 * float(t):g}%" for t in reached]
    rows = []
    for r in timed:
        clock = r.summary.get("sim_clock", {})
        ref = clock.get("reference_compute_s")
        row = [
            r.label,
            f"`{clock.get('client_profiles', _NONE)}`",
            f"`{clock.get('link', _NONE)}` ({clock.get('link_figures', '')})",
            f"{ref:.3g} ({clock.get('reference_compute', '')})" if ref is not None else _NONE,
            f"{clock['deadline_s']:g} s" if clock.get("deadline_s") else _NONE,
            _seconds(clock.get("total_s")),
        ]
        row += [_seconds(r.summary["time_to"].get(t)) for t in reached]
        rows.append(row)
    return _table(header, rows)


def _seconds(value: float | None) -> str:
    if value is None:
        return _NONE
    return f"{value:,.1f} s" if value < 3600 else f"{value / 3600:,.2f} h"


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
        ("sim_time_s", "Simulated (s)", lambda v: f"{v:,.2f}"),
        ("staleness_mean", "Staleness mean", lambda v: f"{v:.2f}"),
        ("staleness_max", "Staleness max", lambda v: f"{v:g}"),
        ("dropped_stale", "Dropped stale", lambda v: f"{v:g}"),
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
        notes.append(
            f"skipped: {record.abandoned}"
            if record.abandoned
            else f"skipped: {len(record.replied)} of {len(record.sampled)} replied, quorum {record.quorum}"
        )
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


def _kinds_table(run: Run) -> str:
    """The run's messages by kind (secure aggregation's protocol messages apart from the updates they protect)."""
    assert run.ledger is not None
    kinds: dict[tuple[str, str], list[int]] = {}
    for e in run.ledger:
        row = kinds.setdefault((e.kind, e.direction), [0, 0, 0])
        row[0] += 1 if e.direction == "up" else e.recipients
        row[1] += e.counted("tensor", "unicast")
        row[2] += e.counted("payload", "unicast")
    rows = [[kind, way, f"{n:,}", format_bytes(t), format_bytes(p)] for (kind, way), (n, t, p) in kinds.items()]
    note = (
        "A masked upload (uint32, 4 bytes a value) is counted as the client's update message of the same size; the "
        "round's protocol parameters ride in the broadcast's metadata.\n"
    )
    return _table(["Kind", "Direction", "Messages", "Tensor (unicast)", "Payload (unicast)"], rows) + "\n" + note


def _events_table(runs: Sequence[Run]) -> str:
    rows = []
    for run in runs:
        for r in run.rounds:
            if not r.aggregated:
                why = f"round skipped: {len(r.replied)} of {len(r.sampled)} replied, below the quorum of {r.quorum}"
                why = f"round skipped: {r.abandoned}" if r.abandoned else why
                rows.append([run.label, str(r.round), _NONE, why])
            rows += [[run.label, str(r.round), d.client, f"dropped: {d.reason or 'no reply in time'}"] for d in r.drops]
            rows += [[run.label, str(r.round), x.client, f"rejected: {x.reason}"] for x in r.rejections]
    return _table(["Run", "Round", "Client", "Event"], rows) if rows else ""


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table; columns of numbers, byte counts and percentages are right-aligned, text left-aligned."""
    align = "".join(
        "r" if any(row[i] != _NONE for row in rows) and all(_NUMBER.match(row[i]) for row in rows) else "l"
        for i in range(len(header))
    )
    return markdown_table(header, rows, align)


def _pct(value: float | None) -> str:
    return _NONE if value is None else f"{100 * value:.2f}%"


def _num(value: float | None) -> str:
    return _NONE if value is None else f"{value:.3f}"


def _bytes_or_none(value: int | None) -> str:
    return _NONE if value is None else format_bytes(int(value))


def _rel(path: Path, start: Path) -> str:
    return Path(os.path.relpath(path.resolve(), start.resolve())).as_posix()
