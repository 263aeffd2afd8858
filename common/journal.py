"""Crash safety: after every round a run directory gets a journal from which the run continues exactly.

Files, next to those of :mod:`common.rundir`:
  journal.json                  the commit point: the last completed round, the config it belongs to, how many bytes
                                of metrics.jsonl and ledger.csv belong to the completed rounds, the JSON-able state,
                                and the name of the tensor file
  journal-<round>.safetensors   every tensor of the state (safetensors: no pickle)

Each file is written to a temporary file in the run directory, flushed, fsynced and renamed over its target, then the
directory is fsynced. The tensor file is complete before journal.json names it, and the previous one is deleted only
after, so whenever the process dies, journal.json names a complete state of a completed round.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fedge.config import RunConfig
from fedge.errors import JournalError

JOURNAL = "journal.json"
FORMAT = "fedge-journal/1"
_TENSOR_FILE = re.compile(r"journal-\d{6,}\.safetensors")


@dataclass(frozen=True)
class RunState:
    """What a run continues from after round ``round``. No RNG state: sampling and seeds derive from (seed, round)."""

    round: int
    tensors: Mapping[str, torch.Tensor]
    values: Mapping[str, Any]  # JSON-able
    metrics_bytes: int  # metrics.jsonl up to this byte holds rounds 1..round
    ledger_bytes: int  # ledger.csv up to this byte holds their messages


def write_journal(run_dir: Path, config: RunConfig, state: RunState) -> None:
    """Commit ``state`` as the journal of ``run_dir`` (atomically: see the module docstring)."""
    name = f"journal-{state.round:06d}.safetensors"
    tmp = run_dir / f".{name}.tmp"
    save_file(_unshared(state.tensors), tmp, metadata={"format": FORMAT, "round": str(state.round)})
    _commit(tmp, run_dir / name)
    record = {
        "format": FORMAT,
        "round": state.round,
        "finished": False,
        "config": config.to_dict(),
        "metrics_bytes": state.metrics_bytes,
        "ledger_bytes": state.ledger_bytes,
        "tensors": name,
        "values": state.values,
    }
    atomic_write(run_dir / JOURNAL, (json.dumps(record, indent=1) + "\n").encode())
    for old in [*run_dir.glob("journal-*.safetensors"), *run_dir.glob(".journal-*.tmp")]:  # and a crash's leftovers
        if old.name != name:
            old.unlink(missing_ok=True)


def finish_journal(run_dir: Path) -> None:
    """Mark the journal of a run that wrote its summary as finished, and delete its tensors (they can be large)."""
    path = run_dir / JOURNAL
    if not path.is_file():
        return
    record = json.loads(path.read_text())
    record.update(finished=True, tensors=None)
    atomic_write(path, (json.dumps(record, indent=1) + "\n").encode())
    for old in run_dir.glob("journal-*.safetensors"):
        old.unlink(missing_ok=True)


def read_journal(run_dir: Path, config: RunConfig) -> RunState:
    """The state ``run_dir`` continues from; JournalError when there is none, it is finished, or belongs to another
    config than ``config``."""
    path = run_dir / JOURNAL
    if not path.is_file():
        if (run_dir / "summary.json").is_file():
            raise JournalError(f"{run_dir} is a finished run (it has summary.json): nothing to resume")
        raise JournalError(
            f"{run_dir} has no {JOURNAL}: it is not a run directory, or the run stopped before its first round "
            "completed; start it again"
        )
    try:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"format {raw.get('format') if isinstance(raw, dict) else None!r}, expected {FORMAT!r}")
        rnd, metrics_bytes, ledger_bytes = int(raw["round"]), int(raw["metrics_bytes"]), int(raw["ledger_bytes"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise JournalError(f"{path} is not a fedge journal: {exc}") from None
    if raw.get("finished"):
        raise JournalError(f"{run_dir} is finished: all {rnd} rounds ran and its summary is written; nothing to resume")
    differences = config_differences(raw.get("config"), config)
    if differences:
        raise JournalError(
            f"the journal in {run_dir} was written by another config ({'; '.join(differences[:6])}): resume with the "
            f"run's own config (its config.json, without flags that change it)"
        )
    name = raw.get("tensors")
    if not isinstance(name, str) or not _TENSOR_FILE.fullmatch(name) or not (run_dir / name).is_file():
        raise JournalError(f"{path} names the tensor file {name!r}, which is not in {run_dir}")
    try:
        tensors = load_file(run_dir / name)
    except (SafetensorError, OSError) as exc:
        raise JournalError(f"{run_dir / name} cannot be read: {exc}") from None
    values = raw.get("values")
    return RunState(rnd, tensors, values if isinstance(values, dict) else {}, metrics_bytes, ledger_bytes)


def config_differences(saved: Any, config: RunConfig) -> list[str]:
    """``"train.lr: 0.1 in the journal, 0.05 now"`` for every setting where ``saved`` (a config dict) differs."""
    if not isinstance(saved, dict):
        return ["the journal holds no config"]
    ours, theirs = _flat(json.loads(config.to_json())), _flat(saved)
    return [
        f"{key}: {theirs.get(key, '(unset)')!r} in the journal, {ours.get(key, '(unset)')!r} now"
        for key in sorted(set(ours) | set(theirs))
        if ours.get(key) != theirs.get(key)
    ]


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` so that a crash leaves either the old or the new file, never a torn one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
    _commit(tmp, path)


def _commit(tmp: Path, path: Path) -> None:
    """fsync ``tmp``, rename it to ``path``, fsync the directory (so the rename itself survives a power cut)."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _unshared(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, each with its own storage (safetensors refuses tensors that share memory)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        if t.numel() and t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        if t.numel():
            seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _flat(raw: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out
