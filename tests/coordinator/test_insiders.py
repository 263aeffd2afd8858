"""Admitted attackers over mosquitto started from fedge's own fleet kit (TLS, passwords, ACL), against the defaults
``fedge coordinator`` gives a deployment (FLAME: the majority cluster of the updates by cosine distance, clipped to
the round's median update norm, then the mean; quorum 0.5; issue 52).

One attacker among five honest clients, one attack per coordinator run (:mod:`insiders`): model replacement at 0.95 x
the update bound, a sign flip at the bound, size inflation by a re-hello claiming 2^40 samples (then an all-zero model
claiming 2^40 examples), a label-rotating model, and +5 on the output layer's bias of an int8-coded upload (a run
with ``--upload-codec int8``, inside the bound). The attacker holds a real device bundle; the honest clients are
``fedge client`` processes. Asserted per attack: no round skipped, and the final accuracy within 2 points of the
all-honest run of the same seed and defaults (in process, the sixth client honest).

Three attackers of ten (model replacement toward one rotated model: they collude) with ``--robust median``: within
5 points of the all-honest run. Every client of that fleet serves from a thread of the test (real bundles, real
broker), which starts in a fraction of the time of ten processes.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from insiders import Insider
from mqtt_support import require_mosquitto

from coordinator.run import provision_fleet, run_coordinator
from edge_client.client import EdgeClient
from edge_client.data import ClientDataInfo
from edge_client.mqtt import MqttEdgeClient
from fedge.aggregation.robust import DEPLOYMENT_RULE
from fedge.learning.backend import TorchBackend
from fedge.wire.protocol import decode_status, encode_status
from fedge_cli.main import _run_config, build_parser
from fedge_io.credentials import load_bundle
from fedge_io.experiment import Experiment, prepare
from fedge_io.rundir import RunResult
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


def deployment_config(*extra: str) -> Experiment:
    """What `fedge coordinator` FLAGS (then ``extra``) runs: the deployment's defaults for what is not set."""
    config = _run_config(build_parser().parse_args(["coordinator", *FLAGS, *extra]), deployment=True)
    assert (config.algo.clip_factor, config.min_replies) == (1.0, 0.5)
    if "--robust" not in extra:
        assert config.algo.robust == DEPLOYMENT_RULE
    return prepare(config)


@contextmanager
def served(clients: Mapping[str, EdgeClient], exp: Experiment, bundles: Mapping[str, Path], url: str) -> Iterator[None]:
    """Each client served over the broker from a thread of this process, logged in with its own device bundle."""
    with ExitStack() as stack:
        for cid, client in clients.items():
            address = load_bundle(bundles[cid], broker=url).address
            info = ClientDataInfo(cid, exp.model, exp.input_shape, exp.num_classes)
            server = MqttEdgeClient(client, info, address, RUN)
            thread = threading.Thread(target=server.serve, name=cid, daemon=True)
            thread.start()
            stack.callback(thread.join, 10)
            stack.callback(server.stop)
        yield


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


@pytest.fixture(scope="module")
def honest_int8_accuracy(fleet: Fleet) -> float:
    """The all-honest run with the same seed and defaults and int8 uploads, in process."""
    exp = prepare(dataclasses.replace(fleet.exp.config, upload_codec="int8"))
    accuracy = run_inprocess(exp.config, fleet.root / "honest-int8", experiment=exp).rounds[-1].accuracy
    assert accuracy is not None and accuracy > 0.85
    return accuracy


def coordinate(exp: Experiment, bundle_dir: Path, url: str, out: Path) -> RunResult:
    """One coordinator run of ``exp`` over the broker, from the coordinator's own bundle."""
    bundle = load_bundle(bundle_dir, broker=url)
    return run_coordinator(
        exp.config,
        out,
        broker=bundle.address,
        run=bundle.run,
        provisioned=bundle.clients,
        experiment=exp,
        round_timeout=20,
        join_timeout=120,
    )


def attacked(fleet: Fleet, attack: str) -> RunResult:
    fleet.insider.attack = attack
    assert fleet.insider.reset is not None
    fleet.insider.reset()  # a re-hello of an earlier run must not decide this one's admission
    exp = fleet.exp
    if attack == "int8_offset":  # the same fleet: the coordinator's task tells every client how to code its upload
        exp = prepare(dataclasses.replace(exp.config, upload_codec="int8"))
    return coordinate(exp, fleet.bundle_dir, fleet.url, fleet.root / attack)


# rehello last: its coordinator refuses the insider for the run, and a refused client stops serving
# (MqttEdgeClient.serve returns and clears its hello), so no later run of this fleet would see it join.
@pytest.mark.parametrize("attack", ["replacement", "sign_flip", "label_rotation", "int8_offset", "rehello"])
def test_the_deployment_defaults_survive_one_admitted_attacker(
    fleet: Fleet, request: pytest.FixtureRequest, attack: str
) -> None:
    honest_accuracy = request.getfixturevalue("honest_int8_accuracy" if attack == "int8_offset" else "honest_accuracy")
    result = attacked(fleet, attack)
    assert [r.round for r in result.rounds] == [1, 2, 3, 4]
    assert all(r.aggregated for r in result.rounds), [(r.round, r.replied, r.drops) for r in result.rounds]
    honest = {f"c00{i}" for i in range(5)}
    assert all(honest <= set(r.replied) for r in result.rounds)  # no honest client refused or dropped
    # Inside the bound in some round (round 1 judges against its own median since issue 52): the aggregation alone
    # must hold it off there. The int8 offset (+5 on every output bias) is past the deployment's bound of 5 x the
    # median update norm (issue 52) in every round, so the bound alone refuses it.
    if attack in ("replacement", "label_rotation"):
        assert any(ATTACKER in r.replied for r in result.rounds), [r.drops for r in result.rounds]
    accuracy = result.rounds[-1].accuracy
    # 2 points = 9 of the 450 test images; the sign flip lands on exactly that (measured: 92.67% vs 94.67%).
    assert accuracy is not None and abs(accuracy - honest_accuracy) <= 0.02 + 1e-9, (attack, accuracy, honest_accuracy)


def test_a_median_deployment_survives_three_colluding_attackers_of_ten(tmp_path: Path) -> None:
    require_mosquitto()
    exp = deployment_config("--num-clients", "10", "--robust", "median")
    attackers = ["c000", "c004", "c007"]
    files = write_client_files(exp, tmp_path / "data")
    kit = provision_fleet(exp, tmp_path / "kit", run=RUN, broker_hosts=["127.0.0.1"], port=free_port())
    bundles = {c: kit.root / "clients" / c for c in files}
    clients: dict[str, EdgeClient] = {}
    for c in files:  # each its own backend: the threads train at the same time
        client = EdgeClient(c, exp.client_data(c), TorchBackend(exp.model, exp.input_shape, exp.num_classes))
        clients[c] = Insider(client, "replacement", exp.config.algo.max_update_ratio) if c in attackers else client
    honest = run_inprocess(exp.config, tmp_path / "honest", experiment=exp).rounds[-1].accuracy
    assert honest is not None and honest > 0.85
    with fleet_mosquitto(kit.broker_dir) as url, served(clients, exp, bundles, url):
        result = coordinate(exp, kit.coordinator_dir, url, tmp_path / "attacked")
    assert all(r.aggregated for r in result.rounds), [(r.round, r.replied, r.drops) for r in result.rounds]
    # admitted and inside the bound in some round (round 1 judges against its own median since issue 52): the median
    # holds them there
    assert any(set(attackers) <= set(r.replied) for r in result.rounds), [r.drops for r in result.rounds]
    accuracy = result.rounds[-1].accuracy
    assert accuracy is not None and honest - accuracy <= 0.05, (accuracy, honest)
