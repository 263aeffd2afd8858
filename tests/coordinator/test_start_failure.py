"""A run that cannot start says so at once, to the operator and to every device waiting for it (issue 55).

Over a real mosquitto, without a fleet kit (the config's partition is the fleet): a refused device that makes the
quorum unreachable, or ``--min-clients`` above the clients provisioned, fails the coordinator within seconds (not
at the 600 s join timeout), and every client online at the time is told why; a real ``fedge client`` process exits
with status 4 and the reason. A client whose runtime cannot run the config's algorithm stops before it builds
anything.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from mqtt_support import FakeClient, fake_clients, require_mosquitto  # noqa: F401 - pytest fixtures

from coordinator.run import run_coordinator
from edge_client.cli import CANCELLED_EXIT, run_client
from fedge.config import RunConfig
from fedge.errors import TransportError
from fedge.wire.message import decode
from fedge.wire.protocol import CANCELLED
from fedge_io.experiment import Experiment, prepare
from sim.brokers import mosquitto_broker
from sim.provision import provision

pytestmark = pytest.mark.broker

CONFIG = RunConfig(algorithm="fedavg", dataset="digits", model="tiny_mlp", num_clients=2, rounds=1, eval_samples=50)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mosquitto_url() -> Iterator[str]:
    require_mosquitto()
    with mosquitto_broker() as url:
        yield url


@pytest.fixture(scope="module")
def exp() -> Experiment:
    return prepare(CONFIG)


@pytest.fixture(scope="module")
def fleet(exp: Experiment, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The data files and config.json that `fedge provision` writes."""
    return provision(exp, tmp_path_factory.mktemp("fleet"))


def _client_process(data: Path, url: str, run: str, cid: str, *extra: str) -> subprocess.Popen[str]:
    args = ["client", "--data", str(data), "--broker", url, "--run", run, "--client-id", cid, "--threads", "1"]
    return subprocess.Popen(
        [sys.executable, "-m", "fedge_cli.main", *args, *extra], cwd=REPO, stderr=subprocess.PIPE, text=True
    )


def _wait_until_serving(proc: subprocess.Popen[str], timeout: float = 120.0) -> list[str]:
    """Lines of the client's log up to the one that says it waits for tasks (its hello is on the broker then)."""
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if "waiting for tasks" in line:
            return lines
    raise AssertionError("the client never said it was serving:\n" + "".join(lines[-30:]))


def test_a_refusal_that_makes_the_quorum_unreachable_stops_the_run_and_every_waiting_client(
    exp: Experiment,
    fleet: dict[str, Path],
    mosquitto_url: str,
    fake_clients: Callable[..., FakeClient],  # noqa: F811
    tmp_path: Path,
) -> None:
    client = _client_process(fleet["c000"], mosquitto_url, "refusal", "c000")
    try:
        _wait_until_serving(client)
        wrong = fake_clients(mosquitto_url, "refusal", "c001", model="resnet")  # a data file for another model
        started = time.monotonic()
        with pytest.raises(TransportError, match=r"2 clients cannot join .*c001 refused: its data is for model"):
            run_coordinator(CONFIG, tmp_path / "refusal", broker=mosquitto_url, experiment=exp, join_timeout=600)
        assert time.monotonic() - started < 30  # seconds, not the join timeout
        _, err = client.communicate(timeout=60)
    finally:
        client.kill()
    assert client.returncode == CANCELLED_EXIT, err[-3000:]
    assert "run refusal cannot start: 2 clients cannot join run 'refusal'" in err
    assert "c001 refused: its data is for model 'resnet'" in err
    # The refused device hears its own refusal, and that the run is off.
    notice = decode(wrong.next(CANCELLED).payload)
    assert notice.client == "c001" and "2 clients cannot join" in notice.params["reason"]


def test_more_clients_required_than_provisioned_fails_in_seconds_and_tells_the_waiting_ones(
    exp: Experiment,
    mosquitto_url: str,
    fake_clients: Callable[..., FakeClient],  # noqa: F811
    tmp_path: Path,
) -> None:
    size = len(exp.parts["c000"])
    waiting = [fake_clients(mosquitto_url, "toomany", c, model="tiny_mlp", dataset_size=size) for c in ("c000",)]
    started = time.monotonic()
    with pytest.raises(TransportError, match=r"3 clients cannot join run 'toomany': only 2 were provisioned"):
        run_coordinator(
            CONFIG, tmp_path / "toomany", broker=mosquitto_url, experiment=exp, min_clients=3, join_timeout=600
        )
    assert time.monotonic() - started < 20
    for fake in waiting:
        reason = decode(fake.next(CANCELLED).payload).params["reason"]
        assert "lower --min-clients to 2 or less" in reason


def test_a_runtime_that_cannot_run_the_algorithm_stops_before_building_anything(
    fleet: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from fedge_cli.main import build_parser

    def exported(*_: object) -> tuple[bytes, str]:
        raise AssertionError("the client built a program for a run it cannot serve")

    args = build_parser().parse_args(
        ["client", "--data", str(fleet["c000"]), "--broker", "mqtt://127.0.0.1:1", "--runtime", "onnxruntime"]
    )
    args.client_id = "c000"
    assert isinstance(args, argparse.Namespace)
    assert run_client(args, onnx_model=exported) == 3
    err = capsys.readouterr().err
    assert "the onnxruntime runtime cannot run 'fedavg'" in err and "--runtime torch or executorch" in err


def test_a_notice_is_matched_to_the_process_it_was_meant_for_whatever_the_clocks_say() -> None:
    """The notice echoes the instance id of the process whose hello the coordinator saw: a client whose clock runs
    ahead of the coordinator's still takes it, and a notice meant for an earlier process (queued for a persistent
    session) is ignored even when its time is later. Without an instance id, the times decide."""
    import threading
    from types import SimpleNamespace

    from edge_client.mqtt import MqttEdgeClient
    from fedge.wire.message import Message
    from fedge.wire.protocol import INSTANCE

    def told(params: dict[str, str], started_at: float) -> bool:
        client = SimpleNamespace(_instance="ab12", _started_at=started_at, _stop=threading.Event(), cancelled=None)
        MqttEdgeClient._on_cancelled(client, Message(CANCELLED, 0, "r", "c000", params))  # type: ignore[arg-type]
        return client._stop.is_set() and client.cancelled == "too few clients"

    now = time.time()
    skewed = {"reason": "too few clients", "at": f"{now - 30:.3f}"}  # the coordinator's clock 30 s behind
    assert told({**skewed, INSTANCE: "ab12"}, started_at=now)
    assert not told({"reason": "too few clients", "at": f"{now + 30:.3f}", INSTANCE: "ffff"}, started_at=now)
    assert not told(skewed, started_at=now)  # no instance: the times decide
    assert told({"reason": "too few clients", "at": f"{now + 1:.3f}"}, started_at=now)
