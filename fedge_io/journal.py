"""Crash safety: after every round a run directory gets a journal from which the run continues exactly.

Files, next to those of :mod:`fedge_io.rundir`:
  journal.json                  the commit point: the last completed round, the config it belongs to, how many bytes
                                of metrics.jsonl and ledger.csv belong to the completed rounds, the JSON-able state,
                                and the name of the tensor file
  journal-<round>.safetensors   every tensor of the state (safetensors: no pickle); journal-<round>.<n>.safetensors
                                when the round's journal is committed again (FedBuff's checkpoints), never the name
                                of a file journal.json or its fallback still names

  journal-previous.json         the journal of the round before, kept with its tensor file as a fallback

Each file is written to a temporary file in the run directory, flushed, fsynced and renamed over its target, then the
directory is fsynced. The tensor file is complete before journal.json names it, and older ones are deleted only
after, so whenever the process dies, journal.json names a complete state of a completed round.

Integrity: journal.json records the SHA-256 of its tensor file (and of the committed part of metrics.jsonl and
ledger.csv; :mod:`coordinator.resume` adds each client store file's) and whether every floating-point value was
finite, and carries an HMAC-SHA256 of all of it under a key kept outside the run directory
(:mod:`fedge_io.journal_key`). Resuming verifies the HMAC, then the digests, before a byte of state is used, so a
damaged or altered file (one weight changed, a NaN, a weight changed and its digest recomputed) is refused with one
line naming the file, instead of a run that silently continues from it. ``--previous-journal`` makes the round before
current again (:func:`roll_back_journal`) when the last one is damaged.
"""

from __future__ import annotations

import hashlib
import json
import logging
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
from fedge_io.journal_key import journal_key, journal_key_path, sign, verify
from fedge_io.manifest import sha256_file

log = logging.getLogger(__name__)

JOURNAL = "journal.json"
PREVIOUS = "journal-previous.json"
FORMAT = "fedge-journal/3"
_UNSIGNED_FORMAT = "fedge-journal/2"  # digests but no HMAC: read, with a warning
_OLD_FORMAT = "fedge-journal/1"  # before digests: read, with a warning
_FORMATS = (FORMAT, _UNSIGNED_FORMAT, _OLD_FORMAT)
_TENSOR_FILE = re.compile(r"journal-\d{6,}(\.\d+)?\.safetensors")  # .N: the round's journal committed again


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
    name = _free_tensor_name(run_dir, state.round)
    tmp = run_dir / f".{name}.tmp"
    tensors = _unshared(state.tensors)
    save_file(tensors, tmp, metadata={"format": FORMAT, "round": str(state.round)})
    digest = sha256_file(tmp)
    _commit(tmp, run_dir / name)
    record = {
        "format": FORMAT,
        "round": state.round,
        "finished": False,
        "config": config.to_dict(),
        "metrics_bytes": state.metrics_bytes,
        "ledger_bytes": state.ledger_bytes,
        "tensors": name,
        "tensors_sha256": digest,
        "metrics_sha256": _prefix_sha256(run_dir / "metrics.jsonl", state.metrics_bytes),
        "ledger_sha256": _prefix_sha256(run_dir / "ledger.csv", state.ledger_bytes),
        "checks": {"finite": not _non_finite(tensors)},
        "values": state.values,
    }
    record["hmac"] = sign(journal_key(run_dir), _signed(record))
    current = run_dir / JOURNAL
    keep = {name}
    if current.is_file():  # the journal of the round before becomes the fallback, with its tensor file
        before = current.read_bytes()
        atomic_write(run_dir / PREVIOUS, before)
        keep.add(str(_named_tensor_file(before)))
    atomic_write(current, (json.dumps(record, indent=1) + "\n").encode())
    for old in [*run_dir.glob("journal-*.safetensors"), *run_dir.glob(".journal-*.tmp")]:  # and a crash's leftovers
        if old.name not in keep:
            old.unlink(missing_ok=True)


def finish_journal(run_dir: Path) -> None:
    """Mark the journal of a run that wrote its summary as finished, and delete its tensors (they can be large)."""
    path = run_dir / JOURNAL
    if not path.is_file():
        return
    record = json.loads(path.read_text())
    record.update(finished=True, tensors=None, tensors_sha256=None)
    if record.get("format") == FORMAT:
        record["hmac"] = sign(journal_key(run_dir), _signed(record))
    atomic_write(path, (json.dumps(record, indent=1) + "\n").encode())
    (run_dir / PREVIOUS).unlink(missing_ok=True)
    for old in run_dir.glob("journal-*.safetensors"):
        old.unlink(missing_ok=True)


def read_journal(run_dir: Path, config: RunConfig, *, journal: str = JOURNAL) -> RunState:
    """The state ``run_dir`` continues from; JournalError when there is none, it is finished, belongs to another
    config than ``config``, or its tensors are not the ones it recorded (altered, damaged, or not finite)."""
    path = run_dir / journal
    if not path.is_file():
        if (run_dir / "summary.json").is_file():
            raise JournalError(f"{run_dir} is a finished run (it has summary.json): nothing to resume")
        raise JournalError(
            f"{run_dir} has no {journal}: it is not a run directory, or the run stopped before its first round "
            "completed; start it again"
        )
    try:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict) or raw.get("format") not in _FORMATS:
            raise ValueError(f"format {raw.get('format') if isinstance(raw, dict) else None!r}, expected {FORMAT!r}")
        rnd, metrics_bytes, ledger_bytes = int(raw["round"]), int(raw["metrics_bytes"]), int(raw["ledger_bytes"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise JournalError(f"{path} is not a fedge journal: {exc}") from None
    fallback = _fallback_hint(run_dir) if journal == JOURNAL else ""
    if raw["format"] == FORMAT and not verify(journal_key(run_dir), _signed(raw), raw.get("hmac")):
        raise JournalError(
            f"{path} does not carry the signature of the journal key {journal_key_path()} (HMAC-SHA256): it was "
            f"altered, or written with another key (FEDGE_JOURNAL_KEY_FILE names the run's){fallback}"
        )
    if raw["format"] != FORMAT:
        log.warning("%s was written before journals were signed: it cannot be verified against tampering", path)
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
    for file, size, key in (
        ("metrics.jsonl", metrics_bytes, "metrics_sha256"),
        ("ledger.csv", ledger_bytes, "ledger_sha256"),
    ):
        if key in raw and _prefix_sha256(run_dir / file, size) != raw[key]:
            raise JournalError(
                f"{run_dir / file} does not hold the rounds {path.name} recorded (SHA-256 of its first {size} bytes "
                f"differs): it was altered or damaged{fallback}"
            )
    if raw["format"] == _OLD_FORMAT:
        log.warning("%s was written before journals carried digests: its tensors cannot be verified", path)
    elif sha256_file(run_dir / name) != raw.get("tensors_sha256"):
        raise JournalError(
            f"{run_dir / name} is not the file {path.name} recorded (SHA-256 differs): it was altered or damaged"
            + fallback
        )
    try:
        tensors = load_file(run_dir / name)
    except (SafetensorError, OSError) as exc:
        raise JournalError(f"{run_dir / name} cannot be read: {exc}{fallback}") from None
    bad = _non_finite(tensors)
    if bad or raw.get("checks", {}).get("finite") is False:
        where = f"tensor {bad!r}" if bad else "its state when it was written"
        raise JournalError(f"{run_dir / name} holds NaN or infinite values ({where}): not resumable{fallback}")
    values = raw.get("values")
    return RunState(rnd, tensors, values if isinstance(values, dict) else {}, metrics_bytes, ledger_bytes)


def roll_back_journal(run_dir: Path, config: RunConfig) -> int:
    """Make the journal of the round before current again (verified first); the round it continues after."""
    state = read_journal(run_dir, config, journal=PREVIOUS)
    atomic_write(run_dir / JOURNAL, (run_dir / PREVIOUS).read_bytes())
    log.warning("%s: resuming from the previous journal, after round %d", run_dir, state.round)
    return state.round


def _signed(record: Mapping[str, Any]) -> bytes:
    """What a journal's HMAC covers: every field but the HMAC itself, in a canonical JSON form."""
    return json.dumps({k: v for k, v in record.items() if k != "hmac"}, sort_keys=True, separators=(",", ":")).encode()


def _prefix_sha256(path: Path, size: int) -> str | None:
    """SHA-256 of the first ``size`` bytes of ``path`` (None when it is missing or shorter)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(size)
    except OSError:
        return None
    return hashlib.sha256(data).hexdigest() if len(data) == size else None


def _fallback_hint(run_dir: Path) -> str:
    previous = run_dir / PREVIOUS
    if not previous.is_file():
        return ""
    try:
        rnd = int(json.loads(previous.read_text())["round"])
    except (ValueError, KeyError, TypeError, OSError):
        return ""
    return f"; the journal of round {rnd} is kept: add --previous-journal to resume from it"


def _free_tensor_name(run_dir: Path, rnd: int) -> str:
    """A name for round ``rnd``'s tensor file that neither journal.json nor its fallback names. A round's journal may be
    committed again (FedBuff's checkpoints, :meth:`coordinator.resume.RunJournal.checkpoint`): renamed over the file
    the current journal names, a crash before journal.json is replaced would leave both journals naming other bytes
    than they recorded."""
    in_use = {_named_tensor_file(p.read_bytes()) for p in (run_dir / JOURNAL, run_dir / PREVIOUS) if p.is_file()}
    n = 0
    while (name := f"journal-{rnd:06d}{f'.{n}' if n else ''}.safetensors") in in_use:
        n += 1
    return name


def _named_tensor_file(journal_bytes: bytes) -> str | None:
    try:
        name = json.loads(journal_bytes).get("tensors")
    except (ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def _non_finite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding NaN or infinity, or None. Tensors under ``history/`` are
    records, not state: per-class accuracy is NaN for a class without test samples."""
    for name, t in tensors.items():
        if name.startswith("history/"):
            continue
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


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
