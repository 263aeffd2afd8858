"""The run journal: atomic commits, exact tensors and values, refusals with a reason; every server half's state."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fedge_io.journal as journal_module
import fedge_io.journal_key as journal_key_module
from coordinator.engine import RoundEngine
from edge_client.client import EdgeClient
from fedge.accounting.ledger import LedgerEntry, read_ledger_csv, summarize_round
from fedge.accounting.records import ByteCounts, RoundRecord
from fedge.algorithms.dsfl import DSFLSettings
from fedge.config import RunConfig, TrainConfig
from fedge.errors import ConfigError, JournalError
from fedge.learning.backend import TorchBackend
from fedge.registry import ALGORITHMS
from fedge_io.experiment import prepare
from fedge_io.journal import (
    JOURNAL,
    PREVIOUS,
    RunState,
    finish_journal,
    read_journal,
    roll_back_journal,
    write_journal,
)
from fedge_io.rundir import RunWriter, read_records
from sim.inprocess import InProcessTransport

CONFIG = RunConfig(algorithm="fedavg", dataset="digits", model="tiny_mlp", num_clients=3, rounds=4)


def state(rnd: int, **values: object) -> RunState:
    w = torch.arange(6, dtype=torch.float32) * rnd
    tensors = {
        "strategy/w": w,
        "strategy/view": w[:3],  # shares memory with "strategy/w": saved as its own copy
        "client/c000/uploaded_round": torch.tensor(rnd),  # 0-dim int64
        "history/per_class": torch.tensor([[0.5, float("nan")]], dtype=torch.float64),
    }
    return RunState(rnd, tensors, {"strategy": {"soft_round": rnd}, **values}, 10 * rnd, 20 * rnd)


def test_a_journal_reads_back_exactly_and_keeps_the_previous_one_as_a_fallback(tmp_path: Path) -> None:
    write_journal(tmp_path, CONFIG, state(1))
    write_journal(tmp_path, CONFIG, state(2, resumed_after=[1]))
    got = read_journal(tmp_path, CONFIG)
    want = state(2, resumed_after=[1])
    assert (got.round, got.metrics_bytes, got.ledger_bytes) == (2, 20, 40)
    assert got.values == want.values
    assert got.tensors.keys() == want.tensors.keys()
    for name, t in want.tensors.items():
        assert got.tensors[name].dtype == t.dtype and torch.equal(got.tensors[name].nan_to_num(), t.nan_to_num()), name
    files = ["journal-000001.safetensors", "journal-000002.safetensors", "journal-previous.json", JOURNAL]
    assert sorted(p.name for p in tmp_path.iterdir()) == files
    raw = json.loads((tmp_path / JOURNAL).read_text())
    assert raw["config"]["algorithm"] == "fedavg" and raw["finished"] is False
    assert raw["checks"] == {"finite": True} and len(raw["tensors_sha256"]) == 64
    write_journal(tmp_path, CONFIG, state(3))  # the journal of round 1 goes
    assert not (tmp_path / "journal-000001.safetensors").exists()
    assert json.loads((tmp_path / PREVIOUS).read_text())["round"] == 2


def _alter_one_weight(path: Path, value: float) -> None:
    tensors = load_file(path)
    tensors["strategy/w"][1] = value
    save_file(tensors, path, metadata={"format": "fedge-journal/2"})


@pytest.mark.parametrize(("value", "says"), [(123.0, "SHA-256 differs"), (float("nan"), "SHA-256 differs")])
def test_an_altered_tensor_file_is_refused_naming_it_and_the_previous_journal_resumes(
    tmp_path: Path, value: float, says: str
) -> None:
    write_journal(tmp_path, CONFIG, state(1))
    write_journal(tmp_path, CONFIG, state(2))
    _alter_one_weight(tmp_path / "journal-000002.safetensors", value)
    with pytest.raises(JournalError, match=f"journal-000002.safetensors is not the file.*{says}") as info:
        read_journal(tmp_path, CONFIG)
    assert "the journal of round 1 is kept: add --previous-journal" in str(info.value)
    assert roll_back_journal(tmp_path, CONFIG) == 1
    got = read_journal(tmp_path, CONFIG)
    assert got.round == 1 and torch.equal(got.tensors["strategy/w"], state(1).tensors["strategy/w"])


def test_a_non_finite_state_is_recorded_and_never_resumed(tmp_path: Path) -> None:
    bad = state(1)
    tensors = dict(bad.tensors)
    tensors["strategy/w"] = torch.tensor([1.0, float("inf")])
    write_journal(tmp_path, CONFIG, dataclasses.replace(bad, tensors=tensors))
    assert json.loads((tmp_path / JOURNAL).read_text())["checks"] == {"finite": False}
    with pytest.raises(JournalError, match=r"holds NaN or infinite values \(tensor 'strategy/w'\)"):
        read_journal(tmp_path, CONFIG)


def _rewrite_digest(run_dir: Path, *, key: bytes | None = None) -> None:
    """What one who can write the run directory does after altering a weight: recompute the tensor file's SHA-256 in
    journal.json (and, holding the key, its HMAC)."""
    raw = json.loads((run_dir / JOURNAL).read_text())
    raw["tensors_sha256"] = hashlib.sha256((run_dir / raw["tensors"]).read_bytes()).hexdigest()
    if key is not None:
        raw["hmac"] = journal_key_module.sign(key, journal_module._signed(raw))
    (run_dir / JOURNAL).write_text(json.dumps(raw))


def test_a_weight_altered_with_its_digest_recomputed_is_refused_by_the_signature(tmp_path: Path) -> None:
    """A checksum catches damage, not someone who rewrites it too: the journal's HMAC, under a key outside the run
    directory, does (issue 52)."""
    write_journal(tmp_path, CONFIG, state(1))
    write_journal(tmp_path, CONFIG, state(2))
    _alter_one_weight(tmp_path / "journal-000002.safetensors", 123.0)
    _rewrite_digest(tmp_path)
    with pytest.raises(JournalError, match=r"journal\.json does not carry the signature of the journal key") as info:
        read_journal(tmp_path, CONFIG)
    assert str(journal_key_module.journal_key_path()) in str(info.value)
    assert "the journal of round 1 is kept: add --previous-journal" in str(info.value)


def test_a_journal_resumes_only_with_the_key_it_was_written_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    write_journal(run, CONFIG, state(1))
    assert read_journal(run, CONFIG).round == 1
    monkeypatch.setenv(journal_key_module.KEY_ENV, str(tmp_path / "other.key"))
    with pytest.raises(JournalError, match="written with another key"):
        read_journal(run, CONFIG)
    monkeypatch.setenv(journal_key_module.KEY_ENV, str(run / "journal.key"))
    with pytest.raises(JournalError, match="inside the run directory it protects"):
        write_journal(run, CONFIG, state(2))


def test_the_journal_key_is_made_once_private_and_shared_by_processes_that_start_together(tmp_path: Path) -> None:
    """Test workers or a fleet's services may all find no key at once: every one of them must end up with the same."""
    import os
    import subprocess
    import sys

    path = tmp_path / "conf" / "journal.key"
    code = (
        "from pathlib import Path; from fedge_io.journal_key import journal_key; print(journal_key(Path('/x')).hex())"
    )
    env = {**os.environ, journal_key_module.KEY_ENV: str(path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(6)
    ]
    keys = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert len(keys) == 1 and len(bytes.fromhex(keys.pop())) == journal_key_module.KEY_BYTES
    assert path.stat().st_mode & 0o777 == 0o600 and not list(path.parent.glob(".*.tmp"))


def test_a_nan_with_a_matching_digest_and_signature_is_still_refused(tmp_path: Path) -> None:
    """Even one holding the key cannot resume a NaN: the values are checked after loading."""
    write_journal(tmp_path, CONFIG, state(1))
    _alter_one_weight(tmp_path / "journal-000001.safetensors", float("nan"))
    _rewrite_digest(tmp_path, key=journal_key_module.journal_key(tmp_path))
    with pytest.raises(JournalError, match="holds NaN or infinite values"):
        read_journal(tmp_path, CONFIG)
    with pytest.raises(JournalError, match=r"has no journal-previous\.json"):
        roll_back_journal(tmp_path, CONFIG)


def test_metrics_altered_after_the_run_are_refused(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_bytes(b"x" * 10)
    (tmp_path / "ledger.csv").write_bytes(b"y" * 20)
    write_journal(tmp_path, CONFIG, state(1))
    assert read_journal(tmp_path, CONFIG).round == 1
    (tmp_path / "metrics.jsonl").write_bytes(b"x" * 9 + b"z" + b"more rounds after the commit are fine")
    with pytest.raises(JournalError, match=r"metrics\.jsonl does not hold the rounds journal\.json recorded"):
        read_journal(tmp_path, CONFIG)


def test_a_crash_before_the_commit_leaves_the_previous_round(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_journal(tmp_path, CONFIG, state(1))

    def die(path: Path, data: bytes) -> None:
        raise KeyboardInterrupt("killed between the tensor file and journal.json")

    monkeypatch.setattr(journal_module, "atomic_write", die)
    with pytest.raises(KeyboardInterrupt):
        write_journal(tmp_path, CONFIG, state(2))
    (tmp_path / ".journal-000009.safetensors.tmp").write_bytes(b"torn")  # a kill in the middle of a tensor file
    monkeypatch.undo()
    got = read_journal(tmp_path, CONFIG)  # round 2's tensor file is complete but not committed: round 1 it is
    assert got.round == 1 and torch.equal(got.tensors["strategy/w"], torch.arange(6, dtype=torch.float32))
    write_journal(tmp_path, CONFIG, state(3))  # the next commit cleans up what the crash left; round 1 is the fallback
    files = ["journal-000001.safetensors", "journal-000003.safetensors", PREVIOUS, JOURNAL]
    assert sorted(p.name for p in tmp_path.iterdir()) == files


def test_a_journal_of_another_config_is_refused_naming_the_difference(tmp_path: Path) -> None:
    write_journal(tmp_path, CONFIG, state(1))
    other = dataclasses.replace(CONFIG, rounds=9, train=TrainConfig(lr=0.5))
    with pytest.raises(JournalError, match=r"another config \(rounds: 4 in the journal, 9 now; train.lr: 0.01"):
        read_journal(tmp_path, other)


def test_what_cannot_be_resumed_says_why(tmp_path: Path) -> None:
    with pytest.raises(JournalError, match=r"no journal\.json"):
        read_journal(tmp_path, CONFIG)
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(JournalError, match="is a finished run"):
        read_journal(tmp_path, CONFIG)
    write_journal(tmp_path, CONFIG, state(4))
    finish_journal(tmp_path)
    assert not list(tmp_path.glob("journal-*"))  # the final state's tensors are not kept
    with pytest.raises(JournalError, match="is finished: all 4 rounds ran"):
        read_journal(tmp_path, CONFIG)
    (tmp_path / JOURNAL).write_text('{"format": "something else"')
    with pytest.raises(JournalError, match="is not a fedge journal"):
        read_journal(tmp_path, CONFIG)


def _record(rnd: int, entries: list[LedgerEntry]) -> RoundRecord:
    return RoundRecord(rnd, ("c000",), ("c000",), True, 1, ByteCounts.of(summarize_round(rnd, entries), None, {}))


def test_the_run_writer_continues_a_killed_run_where_its_journal_ends(tmp_path: Path) -> None:
    entries = {r: [LedgerEntry(r, "up", "c000", "update", 1, 4 * r, 9 * r)] for r in (1, 2, 3)}
    writer = RunWriter(tmp_path, CONFIG, {})
    committed = writer.round(_record(1, entries[1]), entries[1])
    writer.round(_record(2, entries[2]), entries[2])  # written, but its journal never committed
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"round": 3, "samp')  # a line torn by the kill
    assert [r.round for r in read_records(tmp_path)] == [1, 2]  # still readable
    resumed = RunWriter(tmp_path, CONFIG, {}, committed=committed)
    assert [r.round for r in read_records(tmp_path)] == [1]
    assert read_ledger_csv(tmp_path / "ledger.csv") == entries[1]
    resumed.round(_record(2, entries[2]), entries[2])
    assert [r.round for r in read_records(tmp_path)] == [1, 2]
    assert read_ledger_csv(tmp_path / "ledger.csv") == entries[1] + entries[2]
    with pytest.raises(JournalError, match="shorter than its journal says"):
        RunWriter(tmp_path, CONFIG, {}, committed=(10**6, 0))


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_every_server_half_restores_its_state_exactly(tmp_path: Path, algorithm: str) -> None:
    """Two real rounds, then the state through a journal into a fresh server half: same state, same next round."""
    extra: dict[str, object] = {}
    if algorithm == "dsfl":
        extra = {"algo": DSFLSettings(open_per_round=40, distill_epochs=1), "open_size": 120}
    cfg = RunConfig(
        algorithm=algorithm,
        dataset="digits",
        model="tiny_mlp",
        num_clients=3,
        rounds=3,
        **extra,  # type: ignore[arg-type]
    )
    exp = prepare(cfg)
    backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes)
    clients = [EdgeClient(c, exp.client_data(c, exp.open_x()), backend) for c in sorted(exp.parts)]
    strategy = exp.strategy("run")
    engine = RoundEngine(exp.config, strategy, InProcessTransport(clients), *exp.test_tensors())
    engine.run_round(1)
    engine.run_round(2)
    tensors, values = strategy.state()
    write_journal(tmp_path, exp.config, RunState(2, tensors, values, 0, 0))
    saved = read_journal(tmp_path, exp.config)
    fresh = exp.strategy("run")
    fresh.load_state(saved.tensors, saved.values)
    again, again_values = fresh.state()
    assert again_values == values and again.keys() == tensors.keys()
    assert all(torch.equal(again[k], tensors[k]) for k in tensors)
    a, b = strategy.configure(3, ["c000", "c001"]), fresh.configure(3, ["c000", "c001"])
    assert (a.broadcast is None) == (b.broadcast is None)
    if a.broadcast is not None and b.broadcast is not None:
        assert a.broadcast.params == b.broadcast.params
        assert all(torch.equal(a.broadcast.tensors[k], b.broadcast.tensors[k]) for k in a.broadcast.tensors)
    if tensors:  # a state that does not fit is refused with the tensor's name
        name = next(iter(tensors))
        with pytest.raises(ConfigError, match="saved state"):
            fresh.load_state({**tensors, name: torch.zeros(1, 2, 3)}, values)
