"""The client executors: each gives the sequential executor's final model bit for bit, a dead worker becomes errors for
its clients (never a hang), and nothing outlives an executor."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import sim.executors as executors
from coordinator.engine import RoundEngine, RunHistory
from edge_client.client import EdgeClient
from fedge.algorithms.dsfl import DSFLSettings
from fedge.config import RunConfig, TrainConfig
from fedge.errors import ConfigError
from fedge.learning.backend import TorchBackend
from fedge.wire.message import TASK, UPDATE, Message, encode
from fedge_io.experiment import prepare
from sim.executors import (
    ClientBuilder,
    ClientJob,
    ClientResult,
    ExecutorTransport,
    ExperimentClients,
    SequentialExecutor,
    SimClient,
    gpu_sharing_advice,
    make_executor,
    processes,
)
from sim.executors.core import ExecutorBase
from sim.executors.placement import Assignment
from sim.inprocess import InProcessTransport

FAST = TrainConfig(lr=0.05, momentum=0.9, local_epochs=1, batch_size=32)

CONFIGS = {
    # weight exchange: every client every round
    "fedavg": RunConfig(algorithm="fedavg", dataset="digits", num_clients=4, rounds=2, train=FAST),
    # FD and DS-FL clients keep their own models in their workers: half the clients per round, so a client that sat
    # out rounds must find its model where it left it when it is sampled again.
    "fd": RunConfig(algorithm="fd", dataset="digits", num_clients=6, client_fraction=0.5, rounds=3, train=FAST),
    "dsfl": RunConfig(
        algorithm="dsfl",
        dataset="digits",
        num_clients=6,
        client_fraction=0.5,
        rounds=2,
        open_size=400,
        train=FAST,
        algo=DSFLSettings(open_per_round=200, distill_epochs=1),
    ),
}


@dataclass
class Outcome:
    """The final global state (the global weights, and the broadcast a next round would send), the history and the
    clients' stores (the coordinator's copy)."""

    final: dict[str, torch.Tensor]
    history: RunHistory
    stores: dict[str, dict[str, torch.Tensor]]


def _run(config: RunConfig, name: str, workers: int = 2, factory: executors.ClientFactory | None = None) -> Outcome:
    exp = prepare(config)
    with make_executor(name, workers, factory or ExperimentClients(exp.config)) as exe:
        strategy = exp.strategy("executor-test")
        transport = ExecutorTransport(exe, sorted(exp.parts))
        engine = RoundEngine(exp.config, strategy, transport, *exp.test_tensors(), initial_bytes=exp.initial_bytes())
        history = engine.run()
    assert not _live_workers(), "a worker outlived its executor"
    return Outcome(_final_state(strategy, sorted(exp.parts), config.rounds), history, transport.stores)


def _final_state(strategy: Any, clients: list[str], rounds: int) -> dict[str, torch.Tensor]:
    final = dict(strategy.global_weights() or {})
    upcoming = strategy.configure(rounds + 1, clients).broadcast  # FD's global per-class outputs, DS-FL's soft labels
    if upcoming is not None:
        final.update({f"broadcast.{k}": v for k, v in upcoming.tensors.items()})
    return final


def _live_workers() -> list[str]:
    return [p.name for p in mp.active_children() if p.name.startswith("fedge-worker")]


def _assert_same(a: Outcome, b: Outcome) -> None:
    assert a.final and a.final.keys() == b.final.keys()
    for key in a.final:
        assert torch.equal(a.final[key], b.final[key]), f"{key} differs by {(a.final[key] - b.final[key]).abs().max()}"
    _assert_same_stores(a.stores, b.stores)
    assert a.history.ledger.entries == b.history.ledger.entries
    for ra, rb in zip(a.history.rounds, b.history.rounds, strict=True):
        deterministic = ("sampled", "replied", "aggregated", "bytes", "drops", "metrics", "accuracy", "forgetting")
        assert {f: getattr(ra, f) for f in deterministic} == {f: getattr(rb, f) for f in deterministic}


def _assert_same_stores(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for client in a:
        assert a[client].keys() == b[client].keys(), client
        assert all(torch.equal(a[client][k], b[client][k]) for k in a[client]), client


_reference: dict[str, Outcome] = {}


def _sequential(algorithm: str) -> Outcome:
    """The reference run of ``algorithm``, computed once per session."""
    if algorithm not in _reference:
        _reference[algorithm] = _run(CONFIGS[algorithm], "sequential")
    return _reference[algorithm]


# --- equivalence ------------------------------------------------------------------------------------------------


def test_sequential_executor_is_the_in_process_transport():
    """With the same thread count, ExecutorTransport + sequential reproduces InProcessTransport's run exactly."""
    config = CONFIGS["fedavg"]
    exp = prepare(config)
    threads = torch.get_num_threads()

    def run(transport: Any, stores: dict[str, Any]) -> Outcome:
        strategy = exp.strategy("executor-test")
        history = RoundEngine(exp.config, strategy, transport, *exp.test_tensors()).run()
        return Outcome(_final_state(strategy, sorted(exp.parts), config.rounds), history, stores)

    torch.set_num_threads(1)  # the whole run: the server's evaluation sums floats too
    try:
        build = ExperimentClients(exp.config, experiment=exp)()
        clients = [build(c) for c in sorted(exp.parts)]
        inprocess = run(InProcessTransport(clients), {c.client_id: dict(c.store) for c in clients})
        build = ExperimentClients(exp.config, experiment=exp)()
        sequential = SequentialExecutor(clients=[build(c) for c in sorted(exp.parts)], threads_per_worker=1)
        transport = ExecutorTransport(sequential, sorted(exp.parts))
        _assert_same(inprocess, run(transport, transport.stores))
    finally:
        torch.set_num_threads(threads)


@dataclass
class _ThreadProbe:
    """A client that records torch's intra-op thread count while it handles its task."""

    client_id: str = "c000"
    store: dict[str, Any] = dataclasses.field(default_factory=dict)
    seen: list[int] = dataclasses.field(default_factory=list)

    def handle(self, task: Message, broadcast: Message | None) -> Message:
        self.seen.append(torch.get_num_threads())
        return Message(UPDATE, task.round, run=task.run, client=self.client_id, params={"num_examples": "1"})


def test_sequential_executor_sets_the_thread_count_for_clients_and_restores_it():
    threads = torch.get_num_threads()
    probe = _ThreadProbe()
    task = encode(Message(TASK, 1, run="r", client="c000"))
    with SequentialExecutor(clients=[probe], threads_per_worker=threads + 1) as exe:
        (ran,) = exe.run([ClientJob("c000", task, None)])
        (streamed,) = exe.stream([ClientJob("c000", task, None)])
        assert ran.error is None and streamed.error is None
    assert probe.seen == [threads + 1, threads + 1]  # the clients ran with the executor's threads (run and stream)
    assert torch.get_num_threads() == threads  # and the coordinator has its own back


def test_stateful_runs_bring_clients_back_after_rounds_elsewhere():
    for algorithm in ("fd", "dsfl"):  # else the equivalence tests below would not test keeping state in workers
        rounds = [set(r.sampled) for r in _sequential(algorithm).history.rounds]
        assert rounds[-1] & set().union(*rounds[:-1]) and any(r != rounds[0] for r in rounds)


@pytest.mark.parametrize("algorithm", list(CONFIGS))
def test_processes_give_the_sequential_model_bit_for_bit(algorithm: str):
    _assert_same(_sequential(algorithm), _run(CONFIGS[algorithm], "processes", workers=2))


@pytest.mark.parametrize("name", ["sequential", "processes"])
def test_a_resumed_run_gives_its_clients_their_stored_state(name: str):
    _check_resume(name)


def _check_resume(name: str) -> None:
    """Rounds 1-2 with one executor, round 3 with a fresh one given the server's state and the copy of the stores (what
    resuming from a journal does): the same model as a run never interrupted."""
    config = CONFIGS["fd"]
    exp = prepare(config)
    with make_executor(name, 2, ExperimentClients(exp.config)) as exe:
        strategy = exp.strategy("executor-test")
        transport = ExecutorTransport(exe, sorted(exp.parts))
        engine = RoundEngine(exp.config, strategy, transport, *exp.test_tensors())
        for rnd in (1, 2):
            engine.run_round(rnd)
    saved_stores = {c: dict(s) for c, s in transport.stores.items()}
    tensors, values = strategy.state()
    with make_executor(name, 2, ExperimentClients(exp.config)) as exe:
        strategy = exp.strategy("executor-test")
        strategy.load_state(tensors, values)
        transport = ExecutorTransport(exe, sorted(exp.parts))
        for client, store in saved_stores.items():
            transport.stores[client].update(store)  # as RunJournal restores them
        RoundEngine(exp.config, strategy, transport, *exp.test_tensors()).run_round(3)
    reference = _sequential("fd")
    final = _final_state(strategy, sorted(exp.parts), config.rounds)
    assert final.keys() == reference.final.keys()
    assert all(torch.equal(final[k], reference.final[k]) for k in final)
    _assert_same_stores(reference.stores, transport.stores)


def test_stateful_clients_stay_with_their_worker_and_the_others_balance():
    plan = Assignment(2)
    jobs = [ClientJob(c, b"", None) for c in ("a", "b", "c", "d")]
    assert plan.plan(jobs) == [[0, 2], [1, 3]]
    for w, client in ((0, "c"), (0, "d"), (1, "a")):
        plan.observe(w, ClientResult(client, b"", None, 1.0), stateful=True)
    plan.observe(1, ClientResult("b", b"", None, 1.0), stateful=False)
    assert plan.plan(jobs) == [[2, 3], [0, 1]]  # c, d stay on 0 and a on 1; b, stateless, fills worker 1
    assert plan.forget_worker(0) == ["c", "d"]
    assert plan.plan(jobs) == [[1, 2], [0, 3]]  # c and d lost their state: free again, balanced
    assert plan.place(["c", "d", "a"]) == {"a": 1, "c": 0, "d": 0}  # state given back: to the emptiest workers


# --- failures and shutdown --------------------------------------------------------------------------------------


class _Crasher:
    """A client whose process dies in the middle of ``round``."""

    def __init__(self, inner: SimClient, round: int) -> None:
        self.inner, self.round = inner, round
        self.client_id = inner.client_id

    @property
    def store(self) -> Any:
        return self.inner.store

    def handle(self, task: Message, broadcast: Message | None) -> Message:
        if task.round == self.round:
            os._exit(3)
        return self.inner.handle(task, broadcast)


@dataclass(frozen=True)
class CrashingClients:
    """ExperimentClients whose client ``victim`` kills its worker in round ``round``."""

    inner: ExperimentClients
    victim: str
    round: int

    def __call__(self) -> ClientBuilder:
        build = self.inner()

        def builder(client_id: str) -> SimClient:
            client = build(client_id)
            return _Crasher(client, self.round) if client_id == self.victim else client

        return builder


@pytest.fixture
def importable_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let spawned workers import this test module (pytest imports it as a package path from the repository root)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[__name__.count(".")]))


@pytest.mark.timeout(120)
def test_a_worker_that_dies_mid_round_fails_its_clients_not_the_run(
    importable_here: None, monkeypatch: pytest.MonkeyPatch
):
    # FD: every client keeps its own model, so the dead worker's clients also lose state, which comes back from the
    # coordinator's copy.
    config = dataclasses.replace(CONFIGS["fd"], num_clients=4, client_fraction=1.0, rounds=3, min_replies=0.5)
    given: list[str] = []
    load_states = executors.ProcessExecutor.load_states

    def spy(self: Any, states: dict[str, bytes]) -> None:
        given.extend(states)
        load_states(self, states)

    monkeypatch.setattr(executors.ProcessExecutor, "load_states", spy)
    factory = CrashingClients(ExperimentClients(config), victim="c001", round=2)
    first, second, third = _run(config, "processes", workers=2, factory=factory).history.rounds
    assert first.replied == ("c000", "c001", "c002", "c003")
    # Free clients are dealt in id order, then stay: worker 1 has c001 (which kills it) and c003 (never run).
    assert second.replied == ("c000", "c002") and second.aggregated
    assert {d.client for d in second.drops} == {"c001", "c003"}
    assert all("client failed: worker 1" in d.reason and "exit code 3" in d.reason for d in second.drops)
    assert given == ["c001", "c003"]  # their round-1 models, from the coordinator's copy, to the new worker
    assert third.replied == ("c000", "c001", "c002", "c003")


@pytest.mark.timeout(60)
def test_ctrl_c_during_a_round_stops_every_worker(monkeypatch: pytest.MonkeyPatch):
    config = CONFIGS["fedavg"]
    exp = prepare(config)
    exe = make_executor("processes", 2, ExperimentClients(exp.config))
    assert len(_live_workers()) == 2

    def interrupted(*args: Any, **kwargs: Any) -> list[Any]:
        raise KeyboardInterrupt

    monkeypatch.setattr(processes, "wait", interrupted)
    strategy = exp.strategy("executor-test")
    engine = RoundEngine(exp.config, strategy, ExecutorTransport(exe, sorted(exp.parts)), *exp.test_tensors())
    with pytest.raises(KeyboardInterrupt):
        engine.run_round(1)
    assert not _live_workers()
    exe.close()  # idempotent


class _Waiter:
    """A client that runs its step only once ``marker`` exists, and fails after 20 s without it."""

    def __init__(self, inner: SimClient, marker: Path) -> None:
        self.inner, self.marker = inner, marker
        self.client_id = inner.client_id

    @property
    def store(self) -> Any:
        return self.inner.store

    def handle(self, task: Message, broadcast: Message | None) -> Message:
        deadline = time.monotonic() + 20.0
        while not self.marker.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("no result was handed over while this client waited")
            time.sleep(0.02)
        return self.inner.handle(task, broadcast)


@dataclass(frozen=True)
class WaitingClients:
    """ExperimentClients whose client ``waiter`` waits for the file ``marker`` before its step."""

    inner: ExperimentClients
    waiter: str
    marker: str

    def __call__(self) -> ClientBuilder:
        build = self.inner()

        def builder(client_id: str) -> SimClient:
            client = build(client_id)
            return _Waiter(client, Path(self.marker)) if client_id == self.waiter else client

        return builder


@pytest.mark.timeout(120)
def test_processes_hand_over_each_result_while_later_clients_still_run(importable_here: None, tmp_path: Path):
    """The coordinator judges the first replies while the workers train the last clients: c003 (worker 1's second
    job) starts its step only after the stream handed over c000's result."""
    exp = prepare(CONFIGS["fedavg"])
    marker = tmp_path / "first-result-handed-over"
    plan = exp.strategy("stream-test").configure(1, sorted(exp.parts))
    assert plan.broadcast is not None
    blob = encode(plan.broadcast)
    jobs = [ClientJob(c, encode(task), blob) for c, task in sorted(plan.tasks.items())]
    assert [j.client_id for j in jobs] == ["c000", "c001", "c002", "c003"]
    factory = WaitingClients(ExperimentClients(exp.config), waiter="c003", marker=str(marker))
    with make_executor("processes", 2, factory) as exe:
        seen = []
        for result in exe.stream(jobs):
            seen.append(result)
            marker.touch()
    assert [r.client_id for r in seen] == ["c000", "c001", "c002", "c003"]
    assert [r.error for r in seen] == [None] * 4 and all(r.reply for r in seen)


@dataclass(frozen=True)
class NeedsEnvironment:
    """A factory whose workers refuse to build clients unless ``name`` is ``value`` in their environment."""

    inner: ExperimentClients
    name: str
    value: str

    def __call__(self) -> ClientBuilder:
        if os.environ.get(self.name) != self.value:
            raise RuntimeError(f"{self.name} is {os.environ.get(self.name)!r} in the worker, not {self.value!r}")
        return self.inner()


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_workers_see_the_environment_of_their_start_not_of_the_forkservers(
    method: str, importable_here: None, monkeypatch: pytest.MonkeyPatch
):
    # Plugins reach workers through FEDGE_PLUGINS, set by --plugin after this process (and maybe its forkserver)
    # started. The first executor starts the forkserver; the variable is set after it.
    config = dataclasses.replace(CONFIGS["fedavg"], rounds=1)
    with make_executor("processes", 1, ExperimentClients(config)) as first:
        assert first.start_method == processes.default_start_method() == "forkserver"  # Linux has it
    monkeypatch.setenv("FEDGE_TEST_MARK", "set after the forkserver started")
    factory = NeedsEnvironment(ExperimentClients(config), "FEDGE_TEST_MARK", "set after the forkserver started")
    exp = prepare(config)
    with processes.ProcessExecutor(factory, 2, start_method=method) as exe:
        assert exe.start_method == method
        engine = RoundEngine(
            exp.config, exp.strategy("env"), ExecutorTransport(exe, sorted(exp.parts)), *exp.test_tensors()
        )
        (only,) = engine.run().rounds
    assert only.replied == ("c000", "c001", "c002", "c003")


_KILLED_PARENT = """
import sys, time
from fedge.config import RunConfig
from sim.executors import ExperimentClients, make_executor

if __name__ == "__main__":
    config = RunConfig(algorithm="fedavg", dataset="digits", num_clients=2)
    exe = make_executor("processes", 2, ExperimentClients(config))
    print(*[slot.process.pid for slot in exe._slots], flush=True)
    time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_workers_exit_when_their_parent_is_killed(tmp_path: Path):
    import signal
    import subprocess
    import time

    script = tmp_path / "parent.py"
    script.write_text(_KILLED_PARENT)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        parent.send_signal(signal.SIGKILL)  # no clean-up code runs in the parent
        parent.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if _alive(p)], "a worker outlived its killed parent"
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(("platform", "method"), [("linux", "forkserver"), ("darwin", "spawn"), ("win32", "spawn")])
def test_workers_fork_from_a_forkserver_on_linux_only(platform: str, method: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(sys, "platform", platform)  # macOS: forking after Apple's frameworks loaded is not safe
    assert processes.default_start_method() == method


def test_an_unavailable_start_method_is_a_config_error():
    with pytest.raises(ConfigError, match="start method 'teleport' is not available here; choose one of"):
        processes.ProcessExecutor(ExperimentClients(CONFIGS["fedavg"]), 1, start_method="teleport")


def test_a_factory_that_cannot_build_clients_is_an_executor_error():
    config = dataclasses.replace(CONFIGS["fedavg"], dataset="mnist", data_dir="/nonexistent")
    jobs = [ClientJob("c000", b"", None)]
    with make_executor("processes", 1, ExperimentClients(config)) as exe, pytest.raises(executors.ExecutorError):
        exe.run(jobs)
    assert not _live_workers()


# --- choosing an executor -------------------------------------------------------------------------------------------


def test_unknown_executor_is_a_config_error():
    with pytest.raises(ConfigError, match="choose one of sequential, processes, ray, batched, auto"):
        make_executor("threads", 2, ExperimentClients(CONFIGS["fedavg"]))


@pytest.mark.parametrize(
    ("device", "executor", "workers", "mps", "advised"),
    [
        ("cuda", "processes", 15, False, True),
        ("cuda:0", "ray", 4, False, True),
        ("cuda", "processes", 15, True, False),  # MPS's control pipe is there: nothing to advise
        ("cuda", "processes", 1, False, False),
        ("cuda", "sequential", 1, False, False),
        ("cpu", "processes", 15, False, False),
    ],
)
def test_workers_sharing_a_gpu_without_mps_are_told_to_start_it(
    tmp_path: Path, device: str, executor: str, workers: int, mps: bool, advised: bool
):
    if mps:
        (tmp_path / "control").touch()
    advice = gpu_sharing_advice(device, executor, workers, pipe_dir=tmp_path)
    if advised:
        assert advice is not None and f"{workers} worker processes" in advice
        assert "nvidia-cuda-mps-control -d" in advice
    else:
        assert advice is None


def test_the_mps_pipe_folder_follows_cuda_mps_pipe_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert executors.mps_pipe_dir() == tmp_path
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY")
    assert executors.mps_pipe_dir() == Path("/tmp/nvidia-mps")


@pytest.mark.parametrize(
    ("cores", "max_parallel", "factory", "expected"),
    [(8, 10, True, "processes"), (1, 10, True, "sequential"), (8, 1, True, "sequential"), (8, 10, False, "sequential")],
)
def test_auto_picks_processes_when_cores_allow_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    cores: int,
    max_parallel: int,
    factory: bool,
    expected: str,
):
    made: dict[str, Any] = {}

    class FakePool(ExecutorBase):
        def __init__(self, factory: Any, workers: int, **kwargs: Any) -> None:
            made.update(workers=workers, **kwargs)

    monkeypatch.setattr(executors, "usable_cores", lambda: cores)
    monkeypatch.setattr(executors, "ProcessExecutor", FakePool)
    exp = prepare(CONFIGS["fedavg"])
    clients = [EdgeClient("c000", exp.client_data("c000"), TorchBackend("tiny_mlp", (1, 8, 8), 10))]
    with caplog.at_level(logging.INFO, logger="sim.executors"):
        exe = make_executor(
            "auto", 0, ExperimentClients(exp.config) if factory else None, clients=clients, max_parallel=max_parallel
        )
    assert f"executor auto: {expected}" in caplog.text
    if expected == "processes":
        assert made["workers"] == min(cores, max_parallel) and made["threads_per_worker"] == 1
    else:
        assert isinstance(exe, SequentialExecutor)


def test_ray_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'fedge\[ray\]'"):
        make_executor("ray", 2, ExperimentClients(CONFIGS["fedavg"]))


# --- Ray ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_instance() -> Any:
    """A local Ray instance for this module's Ray tests."""
    try:
        import ray
    except ImportError:
        pytest.skip("Ray is not installed (pip install 'fedge[ray]'); CI installs it")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    # Actors unpickle the crash test's classes: send this module by value (Ray workers cannot import it by name).
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield ray
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    ray.shutdown()


# Ray actors start slowly (seconds each), so each algorithm family is compared once: DS-FL here (actors that read
# the dataset files themselves), FedAvg with the experiment in the object store, FD through the resume test (which
# ends on the sequential run's model); the processes executor runs all three the same way.
def test_ray_gives_the_sequential_model_bit_for_bit(ray_instance: Any):
    _assert_same(_sequential("dsfl"), _run(CONFIGS["dsfl"], "ray", workers=2))


def test_ray_with_the_experiment_in_the_object_store(ray_instance: Any):
    exp = prepare(CONFIGS["fedavg"])  # shipped once through the object store: actors read no dataset files
    outcome = _run(CONFIGS["fedavg"], "ray", workers=2, factory=ExperimentClients(exp.config, experiment=exp))
    _assert_same(_sequential("fedavg"), outcome)


@pytest.mark.timeout(120)
def test_a_ray_actor_that_dies_mid_round_fails_its_clients_not_the_run(ray_instance: Any):
    config = dataclasses.replace(CONFIGS["fedavg"], rounds=2, min_replies=0.5)
    factory = CrashingClients(ExperimentClients(config), victim="c001", round=1)
    first, second = _run(config, "ray", workers=2, factory=factory).history.rounds
    assert first.replied == ("c000", "c002") and first.aggregated
    assert {d.client for d in first.drops} == {"c001", "c003"}
    assert all("client failed: Ray worker 1 died" in d.reason for d in first.drops)
    assert second.replied == ("c000", "c001", "c002", "c003")


def test_ray_resumed_run_gives_its_clients_their_stored_state(ray_instance: Any):
    _check_resume("ray")
