"""What an operator reads (issue 55): timestamped round lines on the console and in the run's coordinator.log; a
SIGTERM during a round finishes that round, says so at INFO, and leaves with it in the journal; a broker that cannot
be reached through a bundle is named with the port the kit's broker listens on."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mqtt_support import mosquitto_url  # noqa: F401 - a pytest fixture
from signal_support import default_sigint

from coordinator.kit.accounts import FleetSpec
from coordinator.kit.writer import generate_fleet_kit
from coordinator.run import COORDINATOR_LOG
from fedge.config import RunConfig, TrainConfig
from fedge.errors import TransportError
from fedge_io.credentials import load_bundle
from fedge_io.experiment import prepare
from fedge_io.journal import JOURNAL
from fedge_io.mqtt import MqttLink
from sim.brokers import free_port
from sim.laptop import client_processes
from sim.provision import provision

REPO = Path(__file__).resolve().parents[2]


def _journal_round(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / JOURNAL).read_text())["round"])
    except (OSError, ValueError, KeyError):  # replaced atomically: absent or whole
        return 0


@pytest.mark.broker
def test_sigterm_mid_round_finishes_the_round_says_so_and_the_logs_carry_timestamped_round_lines(
    tmp_path: Path,
    mosquitto_url: str,  # noqa: F811
) -> None:
    config = RunConfig(
        algorithm="fedavg",
        dataset="synthetic",
        model="tiny_mlp",
        num_clients=2,
        rounds=5,
        partition="iid",
        train=TrainConfig(local_epochs=1),
    )
    files = provision(prepare(config), tmp_path / "fleet")
    run_dir = tmp_path / "run"
    argv = [
        *(
            "coordinator",
            "--broker",
            mosquitto_url,
            "--run",
            "graceful",
            "--config",
            str(tmp_path / "fleet/config.json"),
        ),
        *("--run-dir", str(run_dir), "--round-timeout", "10", "--rejoin-grace", "1", "--min-cohort", "1"),
        *("--broker-counters", "off", "--no-report"),
    ]
    with client_processes(files, mosquitto_url, "graceful", log_dir=tmp_path / "logs") as clients:
        coordinator = subprocess.Popen(
            [sys.executable, "-m", "fedge_cli.main", *argv],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=default_sigint,
        )
        try:
            deadline = time.monotonic() + 180
            while _journal_round(run_dir) < 1 and time.monotonic() < deadline and coordinator.poll() is None:
                time.sleep(0.05)
            # c001 stops answering (stopped, its connection open): round 2 waits for it until its 10 s deadline.
            clients["c001"].send_signal(signal.SIGSTOP)
            time.sleep(2.0)  # round 2's tasks are out
            coordinator.send_signal(signal.SIGTERM)
            out, err = coordinator.communicate(timeout=120)
        finally:
            clients["c001"].send_signal(signal.SIGCONT)
            if coordinator.poll() is None:
                coordinator.kill()
    assert coordinator.returncode == 143, err[-3000:]
    stopped_at = _journal_round(run_dir)
    assert stopped_at >= 2  # the round under way at the SIGTERM was finished and committed, not thrown away
    assert f"INFO coordinator.stopping: SIGTERM: finishing round {stopped_at}, then leaving" in err
    assert "continue the run with: " in err and "Traceback" not in err
    # Round lines: timestamped on the console, and in coordinator.log with the log's own timestamp.
    lines = [line for line in out.splitlines() if " round " in line]
    assert len(lines) == stopped_at and all(re.match(r"\d\d:\d\d:\d\d round +\d+  acc", line) for line in lines)
    logged = (run_dir / COORDINATOR_LOG).read_text()
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ INFO coordinator.run: round +1  acc", logged, re.M), logged
    assert f"INFO coordinator.run: run stopped by SIGTERM after finishing round {stopped_at}: the journal keeps it" in (
        logged
    )
    assert "ERROR" not in logged


def test_a_bundles_unreachable_broker_is_named_with_the_port_the_kit_listens_on(tmp_path: Path) -> None:
    kit = generate_fleet_kit(FleetSpec("lab", ("c000",), ("127.0.0.1",), 100_000, port=8883), tmp_path / "kit")
    elsewhere = free_port()
    address = load_bundle(kit.root / "coordinator", broker=f"mqtts://127.0.0.1:{elsewhere}").address
    with pytest.raises(TransportError) as refused:
        MqttLink(address, "fedge-lab-coordinator").start(timeout=0.3)
    said = str(refused.value)
    assert f"cannot reach broker at mqtts://127.0.0.1:{elsewhere}" in said
    assert "whose broker listens on port 8883" in said and f"--broker asks for port {elsewhere}" in said
    assert "mosquitto -p PORT" not in said  # the generic hint would start the wrong broker
