"""The server's evaluation overlapped with the next round's client training (coordinator.engine.RoundPipeline): the
same run directory bit for bit as without, and a run killed during an overlapped evaluation resumes exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from coordinator.engine import RoundEngine, RoundPipeline
from coordinator.transport import Exchange, ReplyCheck
from fedge.accounting.ledger import read_ledger_csv
from fedge.accounting.records import RoundRecord
from fedge.algorithms.base import RoundPlan
from fedge_cli.main import main
from fedge_io.experiment import prepare
from fedge_io.journal import JOURNAL
from sim.executors import ExecutorTransport, ExperimentClients, SequentialExecutor
from sim.run import run_inprocess
from tests.sim.test_resume import config, lines


def _without(summary_path: Path, *keys: str) -> dict[str, object]:
    return {k: v for k, v in json.loads(summary_path.read_text()).items() if k not in keys}


@pytest.mark.parametrize("algorithm", ["fedntd", "dsfl"])  # SCAFFOLD: the killed run below
def test_the_overlapped_path_writes_the_same_run_as_the_plain_one(tmp_path: Path, algorithm: str) -> None:
    """metrics.jsonl (less timings), model and summary, with worker processes (the default executor); DS-FL: a server
    model trained in aggregation, the clients' own models journaled. The run directories have the same name (the run
    id, in every message, counts in the payload bytes)."""
    exp = prepare(config(algorithm))
    workers = {"executor": "processes", "workers": 2}
    plain = run_inprocess(exp.config, tmp_path / "plain" / "run", experiment=exp, overlap=False, **workers)
    overlapped = run_inprocess(exp.config, tmp_path / "overlapped" / "run", experiment=exp, overlap=True, **workers)
    assert (plain.summary["overlap"], overlapped.summary["overlap"]) == (False, True)
    if (plain.path / "global_model.safetensors").exists():
        assert (plain.path / "global_model.safetensors").read_bytes() == (
            overlapped.path / "global_model.safetensors"
        ).read_bytes()
    assert lines(plain.path) == lines(overlapped.path) and len(lines(plain.path)) == exp.config.rounds
    assert read_ledger_csv(plain.path / "ledger.csv") == read_ledger_csv(overlapped.path / "ledger.csv")
    assert _without(plain.path / "summary.json", "overlap", "overlap_why", "fedge") == _without(
        overlapped.path / "summary.json", "overlap", "overlap_why", "fedge"
    )


class _Watched(ExecutorTransport):
    """Says when each round's exchange starts."""

    started: dict[int, threading.Event]

    def exchange(self, plan: RoundPlan, check: ReplyCheck) -> Exchange:
        self.started[next(iter(plan.tasks.values())).round].set()
        return super().exchange(plan, check)


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_concludes_a_round_on_another_thread_while_the_next_one_trains(overlap: bool) -> None:
    """The option changes what runs when: overlapped, round 1 is concluded (evaluated, recorded) while round 2's
    exchange has started; without, in this thread before round 2 starts."""
    cfg = config("fedntd", rounds=3)
    exp = prepare(cfg)
    with SequentialExecutor(ExperimentClients(exp.config)) as exe:
        transport = _Watched(exe, sorted(exp.parts))
        transport.started = {r: threading.Event() for r in range(1, 5)}
        engine = RoundEngine(exp.config, exp.strategy("overlap"), transport, *exp.test_tensors())
        seen: list[tuple[int, str, bool]] = []

        def on_round(r: RoundRecord) -> None:
            if r.round == 1 and overlap:  # the next round's clients are training now (or this waits in vain)
                assert transport.started[2].wait(60), "round 2 did not start while round 1 was concluded"
            seen.append((r.round, threading.current_thread().name, transport.started[r.round + 1].is_set()))

        history = engine.run(on_round, overlap=overlap)
    assert [r.round for r in history.rounds] == [1, 2, 3]
    threads = {name for _, name, _ in seen}
    if overlap:
        assert all(name.startswith("fedge-conclude") for name in threads)
        assert seen[0][2]  # round 1 was concluded while round 2 had started
    else:
        assert threads == {threading.current_thread().name}
        assert [next_started for _, _, next_started in seen] == [False, False, False]


def test_a_failed_conclusion_stops_the_run_after_the_round_in_flight() -> None:
    exp = prepare(config("fedntd", rounds=4))
    with SequentialExecutor(ExperimentClients(exp.config)) as exe:
        engine = RoundEngine(
            exp.config, exp.strategy("overlap"), ExecutorTransport(exe, sorted(exp.parts)), *exp.test_tensors()
        )

        def on_round(r: RoundRecord) -> None:
            if r.round == 2:
                raise RuntimeError("the disk is full")

        with (
            pytest.raises(RuntimeError, match="the disk is full"),
            RoundPipeline(engine, overlap=True, on_round=on_round) as pipe,
        ):
            for rnd in range(1, 5):
                pipe.round(rnd)
    assert [r.round for r in engine.history.rounds] == [1, 2]  # round 3 played, never concluded


_KILLED_DURING_EVALUATION = """
import os, signal, sys, threading
from pathlib import Path
from fedge.algorithms.fedavg import FedAvg
from sim.executors import ExecutorTransport
from sim.run import run_inprocess
from tests.sim.test_resume import config

started = {r: threading.Event() for r in range(1, 10)}
exchange = ExecutorTransport.exchange
def watched(self, plan, check):
    started[next(iter(plan.tasks.values())).round].set()
    return exchange(self, plan, check)
ExecutorTransport.exchange = watched

evaluate = FedAvg.evaluate
calls = []
def killing(self, x, y):
    calls.append(threading.current_thread().name)
    if len(calls) == 3:  # round 3's evaluation: die once round 4's clients train
        assert calls[-1].startswith("fedge-conclude"), calls
        if started[4].wait(60):
            os.kill(os.getpid(), signal.SIGKILL)
    return evaluate(self, x, y)
FedAvg.evaluate = killing
run_inprocess(config("scaffold"), Path(sys.argv[1]), executor="processes", workers=2, overlap=True)
"""


def test_a_run_killed_during_an_overlapped_evaluation_resumes_exactly(tmp_path: Path) -> None:
    """SIGKILL in round 3's evaluation while round 4's clients train in the workers (SCAFFOLD: the clients' control
    variates are journaled too): the journal names round 2, and the resumed run is the uninterrupted sequential one
    without overlap, bit for bit."""
    run = tmp_path / "killed" / "run"
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}  # same float sums as this process
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILLED_DURING_EVALUATION), str(run)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert json.loads((run / JOURNAL).read_text())["round"] == 2
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2  # round 3 was never written
    exp = prepare(config("scaffold"))
    resumed = run_inprocess(exp.config, run, experiment=exp, resume=True, executor="processes", workers=2)
    assert resumed.summary["resumed_after"] == [2]
    reference = run_inprocess(
        exp.config, tmp_path / "ref" / "run", experiment=exp, overlap=False, executor="sequential"
    )
    assert lines(reference.path) == lines(resumed.path)
    model = "global_model.safetensors"
    assert (reference.path / model).read_bytes() == (resumed.path / model).read_bytes()
    assert read_ledger_csv(reference.path / "ledger.csv") == read_ledger_csv(resumed.path / "ledger.csv")
    how = ("overlap", "overlap_why", "fedge", "executor", "workers")  # how it ran, not what it computed
    assert _without(reference.path / "summary.json", *how) == _without(
        resumed.path / "summary.json", *how, "resumed_after"
    )


def test_overlap_is_an_option_of_in_process_runs_and_is_recorded(tmp_path: Path) -> None:
    flags = ["sim", "--algorithm", "fedavg", "--dataset", "digits", "--model", "tiny_mlp", "--num-clients", "3"]
    flags += ["--rounds", "2", "--local-epochs", "1", "--quiet", "--no-report", "--executor", "processes"]
    flags += ["--workers", "2"]
    assert main([*flags, "--no-overlap", "--out", str(tmp_path / "off")]) == 0
    assert main([*flags, "--overlap", "on", "--out", str(tmp_path / "on")]) == 0
    ((off,), (on,)) = ((tmp_path / "off").iterdir(), (tmp_path / "on").iterdir())
    assert json.loads((off / "summary.json").read_text())["overlap"] is False
    assert json.loads((on / "summary.json").read_text())["overlap"] is True
    assert lines(off) == lines(on)
    for refused in (["--no-overlap"], ["--overlap", "on"]):
        assert main([*flags, *refused, "--transport", "mqtt", "--out", str(tmp_path / "mqtt")]) == 2


@pytest.mark.parametrize(("cores", "expected"), [(2, False), (3, True), (8, True)])
def test_auto_overlaps_only_where_a_core_is_left_over_beside_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cores: int, expected: bool
) -> None:
    """On 2 cores two 1-thread workers leave none: the overlapped evaluation would compete with them (24% slower
    measured, benchmarks/executors.py --overlap-blocks); a third core is the evaluation's own."""
    import sim.executors

    monkeypatch.setattr(sim.executors, "usable_cores", lambda: cores)
    exp = prepare(config("fedavg", rounds=1))
    result = run_inprocess(exp.config, tmp_path / "run", experiment=exp, executor="processes", workers=2)
    assert result.summary["overlap"] is expected, result.summary["overlap_why"]
    assert result.summary["overlap_why"].startswith("no core") is not expected


def test_clients_that_train_in_this_process_are_not_overlapped(tmp_path: Path) -> None:
    """The sequential executor's clients would share MKL's process-wide thread count with the evaluation thread."""
    exp = prepare(config("fedntd", rounds=2))
    result = run_inprocess(exp.config, tmp_path / "run", experiment=exp, executor="sequential", overlap=True)
    assert result.summary["overlap"] is False
