"""Secure aggregation (SecAgg+) over a real mosquitto, with `fedge client` processes that each run their own party.

One fleet of ten client processes serves three coordinator runs in turn (the clients that vanish stay gone):

1. N = 10, three clients vanish at different stages of round 1 (after advertising their keys, after sharing them,
   while unmasking): the round completes, the one that uploaded is in the sum, and the model is the survivors'
   weighted mean of their clipped updates to within the ring's resolution (the updates recomputed here, in process).
2. Seven clients; in round 2 four vanish after sharing their keys, leaving fewer than the threshold: that round is
   abandoned with its reason and the model stays, round 3 (the three left) completes.
3. `fedge coordinator` SIGKILLed in the middle of the protocol and resumed: the interrupted round is restarted in a
   new session, every client advertising keys it never advertised before.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from mqtt_support import require_mosquitto
from safetensors.torch import load_file

from coordinator.run import run_coordinator
from fedge.accounting.ledger import read_ledger_csv
from fedge.aggregation.flat import FlatLayout
from fedge.algorithms import run_client_step
from fedge.config import SECAGG_CLIP, RunConfig, TrainConfig
from fedge.learning.backend import TorchBackend
from fedge.secagg.encoding import ring_plan
from fedge.secagg.remote import clipped_delta
from fedge.wire.message import decode
from fedge.wire.protocol import SESSION, BrokerAddress, Topics
from fedge_io.experiment import Experiment, prepare
from fedge_io.mqtt import MqttLink
from sim.brokers import mosquitto_broker
from sim.laptop import client_processes
from sim.provision import provision

pytestmark = pytest.mark.broker

RUN = "secagg"
CONFIG = RunConfig(
    algorithm="fedavg",
    dataset="digits",
    model="tiny_mlp",
    num_clients=10,
    rounds=1,
    train=TrainConfig(local_epochs=1, batch_size=32),
    secure_aggregation=True,
    secagg_clip=1.0,
)
# (round, stage) at which a client process vanishes; the coordinator runs number their rounds from 1 each.
FAULTS = {"c000": (1, "share"), "c001": (1, "upload"), "c002": (1, "unmask")}
FAULTS |= {c: (2, "upload") for c in ("c003", "c004", "c005", "c006")}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Experiment]]:
    require_mosquitto()
    root = tmp_path_factory.mktemp("secagg")
    exp = prepare(CONFIG)
    files = provision(exp, root / "data")
    faults = {c: r for c, (r, _) in FAULTS.items()}
    stages = {c: s for c, (_, s) in FAULTS.items()}
    with (
        mosquitto_broker() as url,
        client_processes(files, url, RUN, log_dir=root / "logs", faults=faults, stage_faults=stages),
    ):
        yield url, root / "data" / "config.json", exp


def expected_mean(exp: Experiment, survivors: list[str], everyone: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The global weights before round 1 and after it as the survivors' weighted mean of their clipped updates, the
    updates computed here by the clients' own code (one torch thread, as the client processes)."""
    strategy = exp.strategy(RUN)
    plan = strategy.configure(1, everyone)
    assert plan.broadcast is not None
    layout = FlatLayout(strategy.reply_tensors())
    before = layout.flatten(plan.broadcast.tensors)
    backend = TorchBackend(exp.model, tuple(exp.input_shape), exp.num_classes)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        updates = {
            c: run_client_step(plan.tasks[c], plan.broadcast, exp.client_data(c), backend, {}) for c in survivors
        }
    finally:
        torch.set_num_threads(threads)
    sizes = {c: len(exp.parts[c]) for c in everyone}
    total = sum(sizes.values())  # A: every client that replied (advertised its keys)
    weighted = sum(
        (sizes[c] / total) * clipped_delta(layout.flatten(updates[c].tensors), before, 1.0)[0] for c in survivors
    )
    weight = sum(sizes[c] / total for c in survivors)
    return before, before + weighted / weight


def test_ten_clients_three_vanishing_at_three_stages_then_an_abandoned_round_then_a_killed_coordinator(
    fleet: tuple[str, Path, Experiment], tmp_path: Path
) -> None:
    url, config_file, exp = fleet
    everyone = sorted(exp.parts)

    # 1. Ten clients, three vanish at three stages of round 1.
    first = run_coordinator(
        CONFIG,
        tmp_path / "one",
        broker=url,
        run=RUN,
        experiment=exp,
        round_timeout=60,
        rejoin_grace=1,
        broker_counters=True,
    )
    (r1,) = first.rounds
    assert r1.aggregated and not r1.abandoned
    drops = {d.client: d.reason for d in r1.drops}
    assert set(drops) == {"c000", "c001"}, drops  # c002 uploaded: its update is in the sum, its masks removed
    assert "stage 'share'" in drops["c000"] and "stage 'upload'" in drops["c001"]
    survivors = [c for c in everyone if c not in drops]
    assert list(r1.replied) == survivors
    assert r1.metrics["secagg_survivors"] == 8 and r1.metrics["secagg_vanished_unmasking"] == 1
    before, mean = expected_mean(exp, survivors, everyone)
    model = load_file(tmp_path / "one" / "global_model.safetensors")
    got = FlatLayout(exp.strategy(RUN).reply_tensors()).flatten(model)
    plan = ring_plan(1.0, 10)
    weight = sum(len(exp.parts[c]) for c in survivors) / sum(len(exp.parts[c]) for c in everyone)
    # Each encoded coordinate is off by less than one step of the ring; float32 storage adds its own rounding.
    tolerance = len(survivors) * plan.resolution / weight + 1e-6 * float(np.abs(mean).max())
    assert float(np.abs(got - mean).max()) <= tolerance
    assert float(np.abs(mean - before).max()) > 100 * tolerance  # the round moved the model by far more than that
    # Every protocol message is in the ledger with its wire bytes: the broker counted what the ledger says it carried.
    bb = first.summary["broker_bytes"]
    assert bb["comparable"] and abs(bb["diff_pct"]) < 3.0, bb
    print(f"ledger wire {bb['ledger_wire']:,} B, broker $SYS {bb['broker_total']:,} B ({bb['diff_pct']:+.3f}%)")
    kinds = {e.kind for e in read_ledger_csv(tmp_path / "one" / "ledger.csv") if e.round == 1}
    assert {"secagg.neighbour-keys", "secagg.encrypted-shares", "secagg.masked-input", "secagg.unmask-shares"} <= kinds

    # 2. Seven clients; four vanish after sharing their keys in round 2: below the threshold, abandoned.
    three = dataclasses.replace(exp, config=dataclasses.replace(CONFIG, rounds=3))
    second = run_coordinator(
        three.config,
        tmp_path / "two",
        broker=url,
        run=RUN,
        experiment=three,
        round_timeout=60,
        rejoin_grace=1,
        min_clients=7,
    )
    r1, r2, r3 = second.rounds
    assert r1.aggregated and len(r1.replied) == 7
    assert not r2.aggregated and "abandoned" in r2.abandoned and r2.metrics.get("secagg_threshold") == 4
    assert r3.aggregated and r3.replied == ("c007", "c008", "c009")
    assert r2.accuracy == r1.accuracy  # the abandoned round left the model as it was

    # 3. The coordinator SIGKILLed in the middle of round 1's protocol, then resumed: fresh keys.
    run_dir = tmp_path / "three"
    sniffer = MqttLink(BrokerAddress.parse(url), "sniffer", subscriptions=[(Topics(RUN).all_updates, 1)]).start(10)
    args = ["coordinator", "--broker", url, "--run", RUN, "--config", str(config_file), "--round-timeout", "60"]
    args += ["--join-timeout", "60", "--no-report", "--min-clients", "3", "--run-dir", str(run_dir)]
    advertised: dict[tuple[str, str], bytes] = {}  # (session, client) -> its advertised key

    def watch(until: float, proc: subprocess.Popen[bytes] | None = None) -> None:
        while time.monotonic() < until:
            item = sniffer.get(0.2)
            if item is None:
                continue
            msg = decode(item.payload)
            if msg.kind == "update" and "secagg.c_public" in msg.tensors:
                advertised[(msg.transport[SESSION], msg.client)] = msg.tensors["secagg.c_public"].numpy().tobytes()
            if proc is not None and msg.params.get("secagg.kind") == "secagg.encrypted-shares":
                proc.send_signal(signal.SIGKILL)  # keys advertised and shared: mid-protocol
                return

    try:
        proc = subprocess.Popen([sys.executable, "-m", "fedge_cli.main", *args], stdout=subprocess.DEVNULL)
        watch(time.monotonic() + 120, proc)
        assert proc.wait(10) == -signal.SIGKILL, "the coordinator was not killed mid-protocol"
        assert not (run_dir / "summary.json").exists()
        resumed = subprocess.run([sys.executable, "-m", "fedge_cli.main", *args], timeout=240, check=False)
        assert resumed.returncode == 0
        watch(time.monotonic() + 1)
    finally:
        sniffer.close(wait=0.5)
        if proc.poll() is None:
            proc.kill()
    summary = json.loads((run_dir / "summary.json").read_text())
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1] and rounds[0]["replied"] == ["c007", "c008", "c009"]
    assert "abandoned" not in rounds[0] or not rounds[0]["abandoned"]
    sessions = {s for s, _ in advertised}
    assert len(sessions) == 2, advertised.keys()  # the killed session's and the resumed one's
    assert len(set(advertised.values())) == len(advertised) == 6  # no key advertised twice
    assert summary  # the resumed run finished
    assert math.isfinite(rounds[0]["accuracy"])

    # 4. DP-FedAvg under secure aggregation: the three clients add their noise shares on their devices.
    dp = dataclasses.replace(  # each client clips to --dp-clip (--secagg-clip at its default)
        CONFIG, dp_noise_multiplier=0.5, dp_clip="0.5", client_fraction=1.0, secagg_clip=SECAGG_CLIP
    )
    private = run_coordinator(
        dp,
        tmp_path / "dp",
        broker=url,
        run=RUN,
        experiment=dataclasses.replace(exp, config=dp),
        round_timeout=60,
        join_timeout=60,
        min_clients=3,
    )
    (r,) = private.rounds
    assert r.aggregated and r.replied == ("c007", "c008", "c009")
    assert r.metrics["dp_survivors"] == 3 and r.metrics["dp_min_survivors"] >= 1
    ledger = [e for e in read_ledger_csv(tmp_path / "dp" / "ledger.csv") if e.round == 1]
    assert {e.tensor_bytes for e in ledger if e.kind == "update"} == {64}  # keys only: no update in the clear
    layout = FlatLayout(exp.strategy(RUN).reply_tensors())
    masked = [e for e in ledger if e.kind == "secagg.masked-input"]
    assert len(masked) == 3 and all(e.tensor_bytes == 4 * (layout.dim + 1) for e in masked)  # update and count
    dp_model = layout.flatten(load_file(tmp_path / "dp" / "global_model.safetensors"))
    assert np.isfinite(dp_model).all() and float(np.abs(dp_model - before).max()) > 0
