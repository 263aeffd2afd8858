"""A coordinator that dies and one whose broker restarted, with real processes over mosquitto.

- `fedge coordinator` SIGKILLed in the middle of a round and restarted with `--resume RUN_DIR` ends with the
  uninterrupted run's model, bit for bit (FedNTD: clients keep no state, so the re-sync is exact); the killed run's
  directory is readable by `fedge report` meanwhile, and a second `--resume` says the run is finished.
- A broker whose byte counters went backwards (it restarted during the run) makes the comparison "not comparable",
  never a negative count, and never a failing exit status.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from mqtt_support import require_mosquitto
from safetensors.torch import load_file

from coordinator.broker_counters import BrokerCounters
from coordinator.mqtt import MqttTransport
from fedge.accounting.ledger import read_ledger_csv
from fedge.errors import ConfigError, TransportError
from fedge.wire.message import decode
from fedge.wire.protocol import BrokerAddress, Topics
from fedge_cli.main import main
from fedge_io.mqtt import MqttLink
from fedge_io.rundir import fixed_run_dir_state
from sim.brokers import mosquitto_broker
from sim.laptop import client_processes

pytestmark = pytest.mark.broker

RUN = "crash"
FLAGS = ["--algorithm", "fedntd", "--dataset", "digits", "--model", "tiny_mlp", "--num-clients", "3"]
FLAGS += ["--rounds", "6", "--local-epochs", "1"]
KILL_IN_ROUND = 4


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A mosquitto, the provisioned fleet's config, and its three `fedge client` processes (shared by the tests)."""
    require_mosquitto()
    root = tmp_path_factory.mktemp("fleet")
    assert main(["provision", "--out", str(root / "data"), *FLAGS]) == 0
    files = {p.stem: p for p in (root / "data").glob("c*.safetensors")}
    with mosquitto_broker() as url, client_processes(files, url, RUN, log_dir=root / "logs"):
        yield url, root / "data" / "config.json"


def coordinator_args(url: str, config: Path, *more: str) -> list[str]:
    return [
        *("coordinator", "--broker", url, "--run", RUN, "--config", str(config), "--round-timeout", "60"),
        *("--join-timeout", "120", "--no-report", *more),
    ]


def tensor_ledger(run_dir: Path) -> list[tuple[int, str, str, str, int, int]]:
    return sorted(
        (e.round, e.direction, e.client, e.kind, e.recipients, e.tensor_bytes)
        for e in read_ledger_csv(run_dir / "ledger.csv")
    )


def kill_mid_round(url: str, config: Path, out: Path, *, run_dir: bool = False) -> Path:
    """Run `fedge coordinator` in its own process and SIGKILL it as soon as a client answered round KILL_IN_ROUND
    (the round before is journaled); the killed run's directory (``out`` itself with ``run_dir``: --run-dir OUT)."""
    sniffer = MqttLink(BrokerAddress.parse(url), "sniffer", subscriptions=[(Topics(RUN).all_updates, 1)]).start(10)
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}  # the same float sums as this process
    where = ("--run-dir" if run_dir else "--out", str(out))
    args = coordinator_args(url, config, *where, "--broker-counters", "off")
    proc = subprocess.Popen([sys.executable, "-m", "fedge_cli.main", *args], env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            item = sniffer.get(0.2)
            if item is not None and decode(item.payload).round >= KILL_IN_ROUND:
                proc.send_signal(signal.SIGKILL)
                break
        assert proc.wait(10) == -signal.SIGKILL, "the coordinator was not killed mid-run"
    finally:
        sniffer.close(wait=0.5)
        if proc.poll() is None:
            proc.kill()
    if run_dir:
        return out
    (killed,) = out.iterdir()
    return killed


def test_a_coordinator_killed_mid_round_resumes_to_the_uninterrupted_model(
    fleet: tuple[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, config = fleet
    assert main(coordinator_args(url, config, "--out", str(tmp_path / "ref"), "--broker-counters", "off")) == 0
    (reference,) = (tmp_path / "ref").iterdir()

    # The run to kill: a separate process, SIGKILLed as soon as a client answered round 4 (round 3 is journaled).
    killed = kill_mid_round(url, config, tmp_path / "killed")
    journal = json.loads((killed / "journal.json").read_text())
    assert journal["round"] >= KILL_IN_ROUND - 1 and not (killed / "summary.json").exists()
    assert main(["report", str(killed), "--out", str(tmp_path / "report")]) == 0  # a killed run is readable

    assert main(coordinator_args(url, config, "--resume", str(killed), "--broker-counters", "on")) == 0
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["resumed_after"] == [journal["round"]]
    a, b = load_file(reference / "global_model.safetensors"), load_file(killed / "global_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the resumed model differs"
    rounds = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    expected = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2, 3, 4, 5, 6]
    assert [r["accuracy"] for r in rounds] == [r["accuracy"] for r in expected]
    # Clients that had answered the interrupted round in the dead session answered it again in the new one.
    assert all(r["replied"] == ["c000", "c001", "c002"] for r in rounds)
    assert tensor_ledger(killed) == tensor_ledger(reference)
    # The broker's counters were read in the resumed session only, and compared with that session's rounds.
    assert summary["broker_bytes"]["comparable"], summary["broker_bytes"]

    capsys.readouterr()
    assert main(coordinator_args(url, config, "--resume", str(killed))) == 2
    assert "is finished: all 6 rounds ran" in capsys.readouterr().err


def test_one_run_dir_command_starts_resumes_and_then_leaves_the_finished_run_alone(
    fleet: tuple[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a service restarting `fedge coordinator --run-dir DIR` sees: the same command every time."""
    url, config = fleet
    run_dir = tmp_path / "service" / "run"
    killed = kill_mid_round(url, config, run_dir, run_dir=True)  # the first start, killed in round 4
    journal = json.loads((killed / "journal.json").read_text())
    assert main(coordinator_args(url, config, "--run-dir", str(run_dir))) == 0  # the restart resumes it
    assert "resuming run directory" in capsys.readouterr().out
    summary = (run_dir / "summary.json").read_text()
    assert json.loads(summary)["resumed_after"] == [journal["round"]]
    assert main(coordinator_args(url, config, "--run-dir", str(run_dir))) == 0  # finished: nothing to do
    assert "the run has finished" in capsys.readouterr().out
    assert (run_dir / "summary.json").read_text() == summary
    # A start killed before its first round completed left config.json and no journal: removed, started anew.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.json").write_text(config.read_text())
    (fresh / "coordinator.log").write_text("")
    assert fixed_run_dir_state(fresh) == "start" and not fresh.exists()
    # Not a run: a provisioned folder (config.json beside the data files), a config.json that is not a run's, a note.
    for name, text in (("c000.safetensors", ""), ("notes.txt", "mine")):
        fresh.mkdir()
        (fresh / "config.json").write_text(config.read_text())
        (fresh / name).write_text(text)
        with pytest.raises(ConfigError, match="holds files but no run"):
            fixed_run_dir_state(fresh)
        assert (fresh / name).exists() and (fresh / "config.json").exists()
        shutil.rmtree(fresh)
    fresh.mkdir()
    (fresh / "config.json").write_text('{"not": "a run config"}')
    with pytest.raises(ConfigError, match="holds files but no run"):
        fixed_run_dir_state(fresh)
    assert (fresh / "config.json").exists()


def test_a_broker_restart_during_a_good_run_never_fails_the_cli(
    fleet: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url, config = fleet
    readings = iter([BrokerCounters(5_000_000_000, 4_000_000_000, 0), BrokerCounters(1_000, 2_000, 0)])
    monkeypatch.setattr(MqttTransport, "broker_counters", lambda self, *a, **k: next(readings))
    assert main(coordinator_args(url, config, "--out", str(tmp_path / "restarted"), "--broker-counters", "on")) == 0
    (run_dir,) = (tmp_path / "restarted").iterdir()
    bb = json.loads((run_dir / "summary.json").read_text())["broker_bytes"]
    assert bb["comparable"] is False and "broker restarted" in bb["note"]
    assert all(not isinstance(v, int) or v >= 0 for v in bb.values())  # never a negative byte count
    assert "broker restarted during the run" in capsys.readouterr().out

    def gone(self: MqttTransport, *args: object, **kwargs: object) -> BrokerCounters:
        if gone.calls:  # type: ignore[attr-defined]
            raise TransportError("the broker went away after the last round")
        gone.calls += 1  # type: ignore[attr-defined]
        return BrokerCounters(1_000, 2_000, 0)

    gone.calls = 0  # type: ignore[attr-defined]
    monkeypatch.setattr(MqttTransport, "broker_counters", gone)
    assert main(coordinator_args(url, config, "--out", str(tmp_path / "lost"), "--broker-counters", "on")) == 0
    (run_dir,) = (tmp_path / "lost").iterdir()
    bb = json.loads((run_dir / "summary.json").read_text())["broker_bytes"]
    assert bb["comparable"] is False and "could not be read after the run" in bb["note"]


STATEFUL = {
    "scaffold": ["--algorithm", "scaffold"],
    "dsfl": ["--algorithm", "dsfl", "--open-size", "200", "--open-per-round", "50", "--distill-epochs", "1"],
}


@pytest.mark.parametrize("algorithm", sorted(STATEFUL))
def test_clients_keep_their_state_across_a_killed_and_resumed_coordinator(algorithm: str, tmp_path: Path) -> None:
    """SCAFFOLD's control variates and DS-FL's own models live on the clients: a resumed coordinator re-runs the
    interrupted round, and each client answers it from its state saved before that round (edge_client/state.py), so
    the resumed run ends with the uninterrupted run's model. The same fleet with its state wiped is reported."""
    require_mosquitto()
    flags = [*STATEFUL[algorithm], "--dataset", "digits", "--model", "tiny_mlp", "--num-clients", "3"]
    flags += ["--rounds", "6", "--local-epochs", "1"]
    assert main(["provision", "--out", str(tmp_path / "data"), *flags]) == 0
    config = tmp_path / "data" / "config.json"
    files = {p.stem: p for p in (tmp_path / "data").glob("c*.safetensors")}
    with mosquitto_broker() as url, client_processes(files, url, RUN, log_dir=tmp_path / "logs"):
        assert main(coordinator_args(url, config, "--out", str(tmp_path / "ref"), "--broker-counters", "off")) == 0
        (reference,) = (tmp_path / "ref").iterdir()
        killed = kill_mid_round(url, config, tmp_path / "killed")
        assert main(coordinator_args(url, config, "--resume", str(killed), "--broker-counters", "off")) == 0
        a, b = load_file(reference / "global_model.safetensors"), load_file(killed / "global_model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the resumed model differs"
        summary = json.loads((killed / "summary.json").read_text())
        assert "client_state_lost" not in summary and summary["resumed_after"]
        if algorithm != "scaffold":
            return

        # The same kill, then c001's state files wiped (a device reset): the run goes on and says who lost what.
        wiped = kill_mid_round(url, config, tmp_path / "wiped")
        for stale in (tmp_path / "data" / "state").glob(f"{RUN}-c001-*"):
            stale.unlink()
        assert main(coordinator_args(url, config, "--resume", str(wiped), "--broker-counters", "off")) == 0
    lost = json.loads((wiped / "summary.json").read_text())["client_state_lost"]
    assert list(lost) == ["c001"] and "lost its state" in lost["c001"], lost
