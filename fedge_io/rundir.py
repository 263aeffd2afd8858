"""The run directory every kind of run writes: config, partition, metrics per round, byte ledger, model, summary.

Layout (the same for in-process and MQTT runs):
  config.json          the resolved RunConfig, and under "fedge" the version (and git commit) that wrote it
  partition.json       class counts per client
  metrics.jsonl        one JSON object per round, appended as rounds complete
  ledger.csv           every message, bytes at three levels (see fedge.accounting.ledger), appended as rounds complete
  global_model.safetensors   final global weights (absent for FD, which has no global model)
  summary.json         final/best accuracy, totals, ComU@x, dropped and rejected messages; "fedge": as in config.json
  journal.json, journal-<round>.safetensors   the state after the last completed round (fedge_io.journal)

A run without summary.json stopped early; ``fedge report`` reads it all the same, ``--resume`` continues it.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from math import isnan
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors.torch import save_file

from fedge.accounting.ledger import ByteLedger, LedgerEntry
from fedge.accounting.records import RoundRecord
from fedge.config import RunConfig
from fedge.errors import ConfigError, JournalError
from fedge.learning.metrics import comu_at
from fedge_io.provenance import provenance
from fedge_io.signals import Terminated  # SIGTERM's exception; its own module: the handler imports nothing

log = logging.getLogger(__name__)

COMU_THRESHOLDS = (0.5, 0.8, 0.9, 0.95, 0.97)


@dataclass
class RunResult:
    """Where a run was written and what it measured."""

    path: Path
    config: RunConfig
    rounds: list[RoundRecord]
    summary: dict[str, Any]


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a run. ``run_dir``: the directory ``--resume`` continues, or None when no round had
    completed (the directory was removed: there was nothing to continue)."""

    def __init__(self, run_dir: Path | None, *, terminated: bool) -> None:
        super().__init__(str(run_dir))
        self.run_dir = run_dir
        self.terminated = terminated


@contextlib.contextmanager
def run_directory(
    root: str | Path, config: RunConfig, label: str = "", *, resume: Path | None, fixed: Path | None = None
) -> Iterator[Path]:
    """The directory a run writes: a new one under ``root``, ``fixed`` itself (made if absent; see
    :func:`fixed_run_dir_state`), or ``resume``'s.

    A new directory that has no completed round when the run fails (a data or broker error, clients that never
    joined, Ctrl-C during the wait) is removed: a failed start leaves nothing half-written for ``fedge report`` or a
    glob to trip on. Ctrl-C and SIGTERM come out as :class:`RunInterrupted`, which says what ``--resume`` can take.
    """
    from fedge_io.journal import JOURNAL  # the commit point of a completed round

    if resume is not None:
        path = resume
    elif fixed is not None:
        path = fixed
        path.mkdir(parents=True, exist_ok=True)
    else:
        path = new_run_dir(root, config, label)
    try:
        yield path
    except BaseException as exc:
        committed = (path / JOURNAL).is_file()
        if resume is None and not committed:
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed %s: the run stopped before its first round completed", path)
        if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, RunInterrupted):
            raise RunInterrupted(path if committed else None, terminated=isinstance(exc, Terminated)) from exc
        raise


def fixed_run_dir_state(path: Path) -> str:
    """What a fixed run directory (``fedge coordinator --run-dir``, what a service restarts) holds: ``"finished"``
    (summary.json), ``"resume"`` (a journal: at least one round completed), or ``"start"`` (absent or empty).

    A directory a killed start left behind before its first round completed (no journal; only the files a run writes
    before then, its config.json a run's config) is removed and counts as ``"start"``: there is nothing in it to
    continue. Anything else (another file, a config.json that is not a run's, e.g. ``fedge provision``'s folder) is
    not fedge's to touch: refused.
    """
    from fedge_io.journal import JOURNAL

    if (path / "summary.json").is_file():
        return "finished"
    if (path / JOURNAL).is_file():
        return "resume"
    if path.is_dir() and any(path.iterdir()):
        names = {p.name for p in path.iterdir()}
        refusal = f"--run-dir {path} holds files but no run: empty it or choose another directory"
        if "config.json" not in names or not names <= EARLY_RUN_FILES:
            raise ConfigError(refusal)
        try:
            RunConfig.from_json_file(path / "config.json")
        except (ConfigError, ValueError, OSError):
            raise ConfigError(refusal) from None
        shutil.rmtree(path)
        log.info("removed %s: its run stopped before its first round completed", path)
    return "start"


# What a run directory holds before its first round completed (RunWriter, the coordinator's log, its run status).
EARLY_RUN_FILES = frozenset({"config.json", "partition.json", "coordinator.log", "metrics.jsonl", "ledger.csv"})


def new_run_dir(root: str | Path, config: RunConfig, label: str = "") -> Path:
    """A fresh directory ``root/<time>-<algorithm>-<dataset>[-label]``."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = "-".join(x for x in (stamp, config.algorithm, config.dataset, label) if x)
    path = Path(root) / name
    suffix = 1
    while path.exists():
        suffix += 1
        path = Path(root) / f"{name}-{suffix}"
    path.mkdir(parents=True)
    return path


class RunWriter:
    """Writes a run directory as the run goes: each round's metrics line and ledger rows reach the disk (fsynced)
    before the round's journal (:mod:`fedge_io.journal`) counts them, so an interrupted run still leaves its rounds on
    disk and a resumed one continues its files."""

    def __init__(
        self,
        path: Path,
        config: RunConfig,
        partition: Mapping[str, Any],
        *,
        committed: tuple[int, int] | None = None,
    ) -> None:
        """``committed``: continue a killed run's metrics.jsonl and ledger.csv, cut to these byte lengths (what its
        journal covers; anything after belongs to a round that did not complete)."""
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        if committed is None:
            written = {**config.to_dict(), "fedge": provenance()}  # RunConfig.from_dict skips "fedge"
            (path / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
            (path / "partition.json").write_text(json.dumps(partition, indent=1) + "\n")
        metrics_bytes, ledger_bytes = committed or (0, 0)
        self._metrics = _continue(path / "metrics.jsonl", metrics_bytes)
        self._ledger = _continue(path / "ledger.csv", ledger_bytes)
        if committed is None:
            _append(self._ledger, _csv_rows([[f.name for f in fields(LedgerEntry)]]))

    def written(self) -> tuple[int, int]:
        """The bytes of (metrics.jsonl, ledger.csv) written so far."""
        return self._metrics.tell(), self._ledger.tell()

    def round(self, record: RoundRecord, entries: Sequence[LedgerEntry] = ()) -> tuple[int, int]:
        """Append a round's metrics line and ledger rows durably; returns the bytes of (metrics.jsonl, ledger.csv)."""
        _append(self._metrics, (json.dumps(record.to_json()) + "\n").encode())
        if entries:
            _append(self._ledger, _csv_rows([[getattr(e, f.name) for f in fields(LedgerEntry)] for e in entries]))
        return self._metrics.tell(), self._ledger.tell()

    def finish(
        self,
        rounds: Sequence[RoundRecord],
        ledger: ByteLedger,
        global_weights: Mapping[str, torch.Tensor] | None,
        *,
        initial_bytes: Mapping[str, int],
        extra: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        self._metrics.close()
        self._ledger.close()
        ledger.write_csv(self.path / "ledger.csv")
        if global_weights is not None:
            save_file(
                {k: v.contiguous() for k, v in global_weights.items()},
                self.path / "global_model.safetensors",
                metadata={"format": "fedge-exchanged-state"},
            )
        summary = summarize(rounds, initial_bytes)
        summary.update(extra or {})
        summary["fedge"] = provenance()  # the version that finished the run (a resumed run may have changed it)
        (self.path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary


def summarize(rounds: Sequence[RoundRecord], initial_bytes: Mapping[str, int]) -> dict[str, Any]:
    """Final and best accuracy, byte totals, ComU@x, drops and rejections of a run's per-round records."""
    evaluated = [r for r in rounds if r.accuracy is not None]
    acc = [float(r.accuracy) for r in evaluated if r.accuracy is not None]
    summary: dict[str, Any] = {
        "rounds": len(rounds),
        "final_accuracy": acc[-1] if acc else None,
        "best_accuracy": max(acc) if acc else None,
        "final_forgetting": evaluated[-1].forgetting if evaluated else None,
        "initial_tensor_bytes": dict(initial_bytes),
        "dropped": [{"round": r.round, "client": d.client} for r in rounds for d in r.drops],
        "drops": [
            # after_s is NaN when the transport does not time drops; null keeps summary.json strict JSON
            {
                "round": r.round,
                "client": d.client,
                "reason": d.reason,
                "after_s": None if isnan(d.after_s) else d.after_s,
            }
            for r in rounds
            for d in r.drops
        ],
        "rejected": sum(len(r.rejections) for r in rounds),
        "rejected_by_reason": dict(Counter(x.category for r in rounds for x in r.rejections)),
        "skipped_rounds": [r.round for r in rounds if not r.aggregated],
        "skipped": [skip_reason(r) for r in rounds if not r.aggregated],
    }
    if rounds:
        last = rounds[-1]
        summary["total_bytes"] = {k[4:]: v for k, v in last.bytes.flat().items() if k.startswith("cum_")}
    comu: dict[str, dict[str, int | None]] = {}
    for acc_model in ("multicast", "unicast"):
        cum = [r.bytes.cum_tensor[acc_model] for r in evaluated]
        comu[acc_model] = {
            f"{t:g}": comu_at(acc, cum, t)
            for t in COMU_THRESHOLDS  # cum already includes ComU@I
        }
    summary["comu_at"] = comu
    return summary


def read_records(path: str | Path) -> list[RoundRecord]:
    """The per-round records of a run directory's metrics.jsonl (a last line torn by a kill is left out)."""
    with open(Path(path) / "metrics.jsonl") as fh:
        lines = [line for line in fh if line.strip()]
    if lines and not lines[-1].endswith("\n"):
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            lines.pop()
    return [RoundRecord.from_json(json.loads(line)) for line in lines]


def read_run(path: str | Path) -> tuple[RunConfig, list[RoundRecord], dict[str, Any]]:
    """Load (config, per-round records, summary) of a run directory, finished or not."""
    p = Path(path)
    config = RunConfig.from_json_file(p / "config.json")
    rounds = read_records(p)
    summary_path = p / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else summarize(rounds, {})
    return config, rounds, summary


def _continue(path: Path, size: int) -> BinaryIO:
    """``path`` open for appending after its first ``size`` bytes (the rest cut); a new, empty file for 0."""
    if size == 0:
        return open(path, "wb")
    try:
        fh = open(path, "r+b")  # noqa: SIM115 - stays open for the whole run
    except FileNotFoundError:
        raise JournalError(f"{path} is missing: the run directory no longer matches its journal") from None
    if os.fstat(fh.fileno()).st_size < size:
        fh.close()
        raise JournalError(f"{path} is shorter than its journal says ({size} bytes): it was changed after the run")
    fh.truncate(size)
    fh.seek(size)
    return fh


def _append(fh: BinaryIO, data: bytes) -> None:
    """One write, flushed and fsynced: a kill cannot tear it, a power cut loses at most this round."""
    fh.write(data)
    fh.flush()
    os.fsync(fh.fileno())


def _csv_rows(rows: Sequence[Sequence[Any]]) -> bytes:
    """Rows as :meth:`fedge.accounting.ledger.ByteLedger.write_csv` writes them."""
    buf = io.StringIO()
    csv.writer(buf).writerows(rows)
    return buf.getvalue().encode()


def skip_reason(record: RoundRecord) -> dict[str, Any]:
    """Why a round was not aggregated: how many replies against the quorum, and what became of the other clients."""
    why = {d.client: d.reason for d in record.drops}
    why.update({x.client: f"rejected: {x.category}" for x in record.rejections})
    missing = [c for c in record.sampled if c not in record.replied]
    return {
        "round": record.round,
        "sampled": len(record.sampled),
        "replied": len(record.replied),
        "quorum": record.quorum,
        **({"abandoned": record.abandoned} if record.abandoned else {}),
        "clients": {c: why.get(c, "no reply") for c in missing},
    }


def skipped_text(summary: Mapping[str, Any]) -> str:
    """One line per skipped round for the console, e.g. ``round 3: 1 of 3 replies, quorum 2 (c001 silent, ...)``."""
    lines = []
    for s in summary.get("skipped", []):
        clients = ", ".join(f"{c} {why}" for c, why in list(s["clients"].items())[:8])
        head = s.get("abandoned") or f"{s['replied']} of {s['sampled']} replies, quorum {s['quorum']}"
        lines.append(f"round {s['round']}: {head} ({clients})")
    return "\n".join(lines)
