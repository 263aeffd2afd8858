"""A real edge client over a real mosquitto says what it does, and skips work nobody will use.

One client (the torch runtime and MQTT side of ``fedge client``) is served from a thread of this process. Against the
real coordinator it logs each task, each epoch, the time of each part and the bytes it sent. Against tasks published
by hand (built by the real FedAvg server half, stamped as the coordinator stamps them) it drops a task past its
deadline, abandons one whose deadline passes during training, drops the tasks of a coordinator session once a newer
session has spoken (even while it is computing one of them), and warns when no task comes, naming its run and topic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mqtt_support import require_mosquitto

from coordinator.run import run_coordinator
from edge_client.client import EdgeClient
from edge_client.data import ClientDataInfo, save_client_data
from edge_client.mqtt import MqttEdgeClient
from fedge.config import RunConfig, TrainConfig
from fedge.learning.backend import TorchBackend
from fedge.wire.message import Message, encode
from fedge.wire.protocol import BROADCAST_ROUND, DEADLINE, SESSION, BrokerAddress, Topics
from fedge_io.experiment import Experiment, prepare
from fedge_io.mqtt import MqttLink
from sim.brokers import mosquitto_broker

pytestmark = pytest.mark.broker

CONFIG = RunConfig(
    algorithm="fedavg",
    dataset="digits",
    model="tiny_mlp",
    num_clients=2,
    rounds=1,
    partition="iid",
    eval_samples=100,
    train=TrainConfig(local_epochs=2, batch_size=10),
)
CLIENT = "c000"


@pytest.fixture(scope="module")
def mosquitto_url() -> Iterator[str]:
    """One private mosquitto for the module's tests (each uses its own run name)."""
    require_mosquitto()
    with mosquitto_broker() as url:
        yield url


@pytest.fixture(scope="module")
def exp() -> Experiment:
    base = prepare(CONFIG)
    return dataclasses.replace(base, parts={c: idx[:40] for c, idx in base.parts.items()})  # 4 steps per epoch


class Logged(logging.Handler):
    """The edge client's log lines, and an event per wanted fragment (so a test can act on what the client says)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self._waits: list[tuple[str, threading.Event]] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = f"{record.levelname} {record.getMessage()}"
        self.lines.append(line)
        for fragment, event in self._waits:
            if fragment in line:
                event.set()

    def wait_for(self, fragment: str, timeout: float = 30.0) -> str:
        event = threading.Event()
        self._waits.append((fragment, event))
        if not any(fragment in line for line in self.lines):
            assert event.wait(timeout), f"no log line with {fragment!r} in {timeout} s; got:\n" + "\n".join(self.lines)
        return next(line for line in self.lines if fragment in line)

    def having(self, fragment: str) -> list[str]:
        return [line for line in self.lines if fragment in line]


@pytest.fixture
def logged() -> Iterator[Logged]:
    handler = Logged()
    logger = logging.getLogger("edge_client")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


@contextlib.contextmanager
def serving(exp: Experiment, url: str, run: str, idle_warning_s: float = 300.0) -> Iterator[MqttEdgeClient]:
    backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes)
    info = ClientDataInfo(CLIENT, exp.model, exp.input_shape, exp.num_classes)
    client = EdgeClient(CLIENT, exp.client_data(CLIENT), backend)
    server = MqttEdgeClient(client, info, BrokerAddress.parse(url), run, idle_warning_s=idle_warning_s)
    thread = threading.Thread(target=server.serve, kwargs={"connect_timeout": 10}, daemon=True)
    thread.start()
    try:
        assert server.link.wait_ready(10)
        yield server
    finally:
        server.stop()
        thread.join(10)


class HandCoordinator:
    """Publishes real FedAvg rounds (the server half's own messages) under a session and deadline of its choosing."""

    def __init__(self, exp: Experiment, url: str, run: str, name: str = "hand") -> None:
        self.exp, self.topics = exp, Topics(run)
        self.strategy = exp.strategy(run)
        self.link = MqttLink(BrokerAddress.parse(url), f"{name}-{run}", subscriptions=[]).start(10)

    def round(self, rnd: int, session: str, *, deadline_in: float | None = 60.0, epochs: int | None = None) -> None:
        plan = self.strategy.configure(rnd, [CLIENT])
        assert plan.broadcast is not None
        self.link.send(self.topics.broadcast, encode(dataclasses.replace(plan.broadcast, transport={SESSION: session})))
        task: Message = plan.tasks[CLIENT]
        if epochs is not None:  # a long task, to be interrupted
            task = dataclasses.replace(task, params={**task.params, "epochs": str(epochs)})
        meta = {SESSION: session, BROADCAST_ROUND: str(rnd)}
        if deadline_in is not None:
            meta[DEADLINE] = f"{time.time() + deadline_in:.3f}"
        self.link.send(self.topics.task(CLIENT), encode(dataclasses.replace(task, transport=meta)))

    def close(self) -> None:
        self.link.close(wait=0.5)


def test_against_the_coordinator_the_client_logs_each_task_epoch_and_timing(
    exp: Experiment, mosquitto_url: str, logged: Logged, tmp_path: Path
) -> None:
    config = dataclasses.replace(exp.config, num_clients=1)
    one = dataclasses.replace(exp, config=config, parts={CLIENT: exp.parts[CLIENT]})
    with serving(one, mosquitto_url, "told"):
        result = run_coordinator(
            config, tmp_path / "told", broker=mosquitto_url, experiment=one, round_timeout=60, join_timeout=20
        )
    assert len(result.rounds) == 1 and result.rounds[0].aggregated
    received = logged.having("round 1: task received")
    assert len(received) == 1
    # Algorithm, epochs, samples, and the time left before the coordinator's 60 s deadline.
    assert "fedavg, 2 local epoch(s) on 40 samples, due in " in received[0]
    due = float(received[0].rsplit("due in ", 1)[1].split()[0])
    assert 30 <= due <= 60
    epochs = logged.having("round 1: epoch ")
    assert [line.split("round 1: epoch ")[1].split(" on")[0] for line in epochs] == ["1/2", "2/2"]
    assert all("on 40 samples: loss " in line for line in epochs)
    assert logged.having("round 1: update computed in ") and "over 2 epoch(s)" in logged.wait_for("update computed")
    assert logged.having("round 1: sent update (")
    assert not logged.having("dropped")


def test_a_task_past_its_deadline_is_skipped_and_one_that_runs_past_it_is_abandoned(
    exp: Experiment, mosquitto_url: str, logged: Logged
) -> None:
    coordinator = HandCoordinator(exp, mosquitto_url, "late")
    try:
        with serving(exp, mosquitto_url, "late") as client:
            coordinator.round(1, "s1", deadline_in=-5.0)  # queued too long: its reply would be refused as late
            line = logged.wait_for("round 1: task dropped")
            assert "deadline passed 5 s ago" in line
            # 10,000 epochs take minutes: the deadline passes between two of them.
            coordinator.round(2, "s1", deadline_in=3.0, epochs=10_000)
            line = logged.wait_for("round 2: task abandoned")
            assert "deadline passed" in line
            seconds = float(line.split("abandoned ")[1].split(" s")[0])
            assert 1.0 <= seconds < 30  # it trained until the deadline, not longer
            coordinator.round(3, "s1")  # the next task is computed as usual
            logged.wait_for("round 3: sent update")
        assert client.updates_sent == 1 and client.tasks_dropped == 2
    finally:
        coordinator.close()


def test_tasks_of_an_older_coordinator_session_are_dropped_once_a_newer_one_speaks(
    exp: Experiment, mosquitto_url: str, logged: Logged
) -> None:
    old = HandCoordinator(exp, mosquitto_url, "restarted", "old")
    new = HandCoordinator(exp, mosquitto_url, "restarted", "new")
    try:
        with serving(exp, mosquitto_url, "restarted") as client:
            old.round(1, "old", epochs=10_000)
            logged.wait_for("round 1: epoch 1/10000")  # busy with the old session's long task
            old.round(2, "old")  # queued behind it (a coordinator that died would never read its reply)
            new.round(1, "new")  # the restarted coordinator speaks
            logged.wait_for("round 1: sent update")
            # MQTT orders messages per publisher only: the old session's round 2 may reach the client after the new
            # session's round 1 (under load it does), and is dropped whenever it comes.
            logged.wait_for("round 2: task dropped")
            time.sleep(0.5)
        lines = logged.lines
        abandoned = logged.having("round 1: task abandoned")
        assert len(abandoned) == 1 and "coordinator session old, over since session new spoke" in abandoned[0]
        dropped = logged.having("round 2: task dropped")
        assert len(dropped) == 1 and "session old, over since session new spoke" in dropped[0]
        assert any("new coordinator session new: session old is over" in line for line in lines)
        # Only the new session's round 1 was answered, after the old session's tasks were given up.
        assert client.updates_sent == 1 and client.tasks_dropped == 2
    finally:
        old.close()
        new.close()


def test_a_client_without_tasks_warns_with_its_run_and_topic(
    exp: Experiment, mosquitto_url: str, logged: Logged
) -> None:
    with serving(exp, mosquitto_url, "typo", idle_warning_s=1.0):
        started = time.monotonic()
        line = logged.wait_for("no task for client c000", timeout=10)
        time.sleep(max(0.0, started + 3.0 - time.monotonic()))  # warned after 1 s and 2 s; the next one after 4 s
    assert line.startswith("WARNING")
    assert "run 'typo'" in line and "fedge/typo/task/c000" in line and "--run typo" in line
    assert len(logged.having("no task for client")) == 2


def test_fedge_client_idle_warning_flag(exp: Experiment, mosquitto_url: str, tmp_path: Path) -> None:
    """``fedge client --idle-warning``: a process started with a run name no coordinator uses says so on stderr."""
    data = save_client_data(
        tmp_path / "c000.safetensors",
        exp.client_data(CLIENT),
        ClientDataInfo(CLIENT, exp.model, exp.input_shape, exp.num_classes),
    )
    base = [sys.executable, "-m", "fedge_cli.main", "client", "--broker", mosquitto_url, "--data", str(data)]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    bad = subprocess.run(
        [*base, "--client-id", CLIENT, "--idle-warning", "-1"], capture_output=True, text=True, env=env
    )
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("fedge: error: --idle-warning")
    proc = subprocess.Popen(
        [*base, "--client-id", CLIENT, "--run", "nobody", "--idle-warning", "1"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, f"fedge client exited with {proc.returncode}"
            if "no task for client c000 of run 'nobody'" in line:
                assert "fedge/nobody/task/c000" in line
                break
        else:
            raise AssertionError("no idle warning within 60 s")
    finally:
        proc.terminate()
        proc.wait(30)
