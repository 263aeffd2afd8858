"""A coordinator that dies without a clean exit (kill -9) shows as gone in ``fedge status``, terminal and ``--web``:
its retained last will on ``fedge/<run>/run-status`` replaces its live status on the kit's mosquitto (whose ACL lets
the coordinator's login set that will). A clean exit (SIGTERM) publishes its final state instead, and the will is
discarded."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mqtt_support import require_mosquitto
from signal_support import default_sigint

from coordinator.run import provision_fleet
from fedge.config import RunConfig
from fedge_io.experiment import prepare
from sim.brokers import fleet_mosquitto, free_port, stop_process

pytestmark = pytest.mark.broker

RUN = "mortal"
FEDGE = [sys.executable, "-m", "fedge_cli.main"]


def status_once(monitor: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FEDGE, "status", "--bundle", str(monitor), "--once"], capture_output=True, text=True)


def wait_for_status(monitor: Path, text: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    out = ""
    while time.monotonic() < deadline:
        done = status_once(monitor)
        out = done.stdout + done.stderr
        if done.returncode == 0 and text in done.stdout:
            return done.stdout
        time.sleep(0.3)
    raise AssertionError(f"fedge status never showed {text!r}; last output:\n{out}")


@contextlib.contextmanager
def coordinator(kit: Path, tmp: Path, name: str) -> Iterator[subprocess.Popen[bytes]]:
    cmd = [*FEDGE, "coordinator", "--bundle", str(kit / "coordinator"), "--out", str(tmp / "runs"), "--no-report"]
    cmd += ["--dataset", "digits", "--model", "tiny_mlp", "--num-clients", "2", "--rounds", "3"]
    cmd += ["--join-timeout", "300"]
    with open(tmp / f"{name}.out", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=default_sigint)
    try:
        yield proc
    finally:
        stop_process(proc)


def page_state(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/status.json", timeout=5) as answer:
        doc: dict[str, Any] = json.loads(answer.read())
        return doc


def wait_for_page(url: str, state: str, timeout: float, phase: str = "") -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    doc: dict[str, Any] = {}
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            doc = page_state(url)
            if doc["state"] == state and phase in doc["view"]["phase"]:
                return doc
        time.sleep(0.2)
    raise AssertionError(f"the page never said {state!r}; last: {doc}")


def test_a_killed_coordinator_shows_as_gone_and_a_clean_exit_as_stopped(tmp_path: Path) -> None:
    require_mosquitto()
    exp = prepare(RunConfig(dataset="digits", model="tiny_mlp", num_clients=2, rounds=3))
    kit = provision_fleet(
        exp, tmp_path / "kit", run=RUN, broker_hosts=["127.0.0.1"], port=free_port(), bind_address="127.0.0.1"
    )
    monitor = kit.root / "monitor"
    web_port = free_port()
    with fleet_mosquitto(kit.broker_dir):
        with coordinator(kit.root, tmp_path, "first") as first:
            # The web page and the `--once` snapshots below share the kit's monitor bundle (a login each).
            web = subprocess.Popen(
                [*FEDGE, "status", "--bundle", str(monitor), "--web", f"127.0.0.1:{web_port}"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=default_sigint,
            )
            try:
                url = f"http://127.0.0.1:{web_port}"
                live = wait_for_page(url, "live", timeout=120, phase="waiting for clients, 0 of 2 online")
                first.send_signal(signal.SIGKILL)  # no clean exit: no final status, no DISCONNECT
                assert first.wait(30) == -signal.SIGKILL
                gone = wait_for_page(url, "gone", timeout=30)
                web.send_signal(signal.SIGINT)
                assert web.wait(30) == 0
            finally:
                stop_process(web)
        # The will kept the page's last news and belongs to the same session.
        assert gone["status"]["session"] == live["status"]["session"]
        assert gone["status"]["phase"] == "stopped" and gone["status"]["rounds"] == 3
        assert gone["view"]["state"].startswith("coordinator gone: its connection to the broker ended"), gone
        # A monitor started after the death sees the retained will.
        after_death = status_once(monitor)
        assert after_death.returncode == 0, after_death.stderr
        assert after_death.stdout.splitlines()[0].endswith("): coordinator gone"), after_death.stdout
        assert "without a clean exit" in after_death.stdout

        # A new coordinator replaces the will; stopped cleanly (SIGTERM), it says so itself and its will is not sent.
        with coordinator(kit.root, tmp_path, "second") as second:
            wait_for_status(monitor, "waiting for clients, 0 of 2 online")
            second.send_signal(signal.SIGTERM)
            assert second.wait(60) == 128 + signal.SIGTERM
        time.sleep(1.0)  # a will would arrive right after the connection ends
        stopped = status_once(monitor)
        assert "stopped after round 0 of 3" in stopped.stdout and "gone" not in stopped.stdout, stopped.stdout
