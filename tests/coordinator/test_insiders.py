"""One admitted attacker among five honest clients over mosquitto started from fedge's own fleet kit (TLS, passwords,
ACL), with the defaults ``fedge coordinator`` gives a deployment (updates and weights clipped to the round's median,
then the mean; quorum 0.5).

The attacker holds a real device bundle and runs one attack per coordinator run (:mod:`insiders`): model replacement
at 0.95 x the update bound, a sign flip at the bound, size inflation by a re-hello claiming 2^40 samples (then an
all-zero model claiming 2^40 examples) and a label-rotating model. Asserted per attack: no round skipped, and the
final accuracy within 2 points of the all-honest run of the same seed and defaults (in process, the sixth client
honest). The int8 attack needs a run with int8 uploads: it is in ``experiments/insiders.py``'s table.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from insiders import Insider
from mqtt_support import require_mosquitto

from cli.main import _run_config, build_parser
from common.credentials import load_bundle
from common.experiment import Experiment, prepare
from common.rundir import RunResult
from coordinator.run import provision_fleet, run_coordinator
from edge_client.client import EdgeClient
from edge_client.data import ClientDataInfo
from edge_client.mqtt import MqttEdgeClient
from fedge.backend import TorchBackend
from fedge.protocol import decode_status, encode_status
from sim.brokers import fleet_mosquitto, free_port
from sim.laptop import client_processes
from sim.provision import write_client_files
from sim.run import run_inprocess

pytestmark = pytest.mark.broker

RUN = "insiders"
ATTACKER = "c005"
FLAGS = ["--algorithm", "fedavg", "--dataset", "digits", "--model", "tiny_mlp", "--num-clients", "6"]
FLAGS += ["--rounds", "4", "--partition", "iid", "--local-epochs", "2", "--lr", "0.1"]


@dataclasses.dataclass
class Fleet:
    exp: Experiment
    insider: Insider
    bundle_dir: Path
    url: str
    root: Path


def deployment_config() -> Experiment:
    """What `fedge coordinator` FLAGS runs: the deployment's defaults, nothing set by hand."""
    config = _run_config(build_parser().parse_args(["coordinator", *FLAGS]), deployment=True)
    assert (config.algo.robust, config.algo.clip_factor, config.min_replies) == ("mean", 1.0, 0.5)
    return prepare(config)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    require_mosquitto()
    root = tmp_path_factory.mktemp("insiders")
    exp = deployment_config()
    files = write_client_files(exp, root / "data")
    kit = provision_fleet(exp, root / "kit", run=RUN, broker_hosts=["127.0.0.1"], port=free_port())
    bundles = {c: kit.root / "clients" / c for c in files}
    honest = {c: path for c, path in files.items() if c != ATTACKER}
    backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes)
    insider = Insider(EdgeClient(ATTACKER, exp.client_data(ATTACKER), backend), "replacement")
    with fleet_mosquitto(kit.broker_dir) as url:
        address = load_bundle(bundles[ATTACKER], broker=url).address  # the attacker's own, real device bundle
        info = ClientDataInfo(ATTACKER, exp.model, exp.input_shape, exp.num_classes)
        server = MqttEdgeClient(insider, info, address, RUN)
        hello = decode_status(server._hello)

        def rehello(size: int) -> None:  # a new hello on its live connection, as any device may send
            fake = encode_status(dataclasses.replace(hello, dataset_size=size), RUN)
            server.link.publish(server.topics.status(ATTACKER), fake, qos=1, retain=True)

        insider.rehello = rehello
        insider.reset = lambda: server._announce(server.link)  # its true hello again, retained for the next run
        thread = threading.Thread(target=server.serve, name="insider", daemon=True)
        thread.start()
        try:
            with client_processes(honest, url, RUN, log_dir=root / "logs", bundles=bundles):
                yield Fleet(exp, insider, kit.coordinator_dir, url, root)
        finally:
            server.stop()
            thread.join(10)


@pytest.fixture(scope="module")
def honest_accuracy(fleet: Fleet) -> float:
    """The all-honest run with the same seed and defaults, in process."""
    result = run_inprocess(fleet.exp.config, fleet.root / "honest", experiment=fleet.exp)
    accuracy = result.rounds[-1].accuracy
    assert accuracy is not None and accuracy > 0.85
    return accuracy


def attacked(fleet: Fleet, attack: str) -> RunResult:
    fleet.insider.attack = attack
    assert fleet.insider.reset is not None
    fleet.insider.reset()  # a re-hello of an earlier run must not decide this one's admission
    bundle = load_bundle(fleet.bundle_dir, broker=fleet.url)
    return run_coordinator(
        fleet.exp.config,
        fleet.root / attack,
        broker=bundle.address,
        run=bundle.run,
        provisioned=bundle.clients,
        experiment=fleet.exp,
        round_timeout=20,
        join_timeout=120,
    )


@pytest.mark.parametrize("attack", ["replacement", "sign_flip", "label_rotation", "rehello"])
def test_the_deployment_defaults_survive_one_admitted_attacker(
    fleet: Fleet, honest_accuracy: float, attack: str
) -> None:
    result = attacked(fleet, attack)
    assert [r.round for r in result.rounds] == [1, 2, 3, 4]
    assert all(r.aggregated for r in result.rounds), [(r.round, r.replied, r.drops) for r in result.rounds]
    honest = {f"c00{i}" for i in range(5)}
    assert all(honest <= set(r.replied) for r in result.rounds)  # no honest client refused or dropped
    if attack in ("replacement", "label_rotation"):  # inside every bound: the aggregation alone must hold it off
        assert ATTACKER in result.rounds[0].replied
    accuracy = result.rounds[-1].accuracy
    # 2 points = 9 of the 450 test images; the sign flip lands on exactly that (measured: 92.67% vs 94.67%).
    assert accuracy is not None and abs(accuracy - honest_accuracy) <= 0.02 + 1e-9, (attack, accuracy, honest_accuracy)
