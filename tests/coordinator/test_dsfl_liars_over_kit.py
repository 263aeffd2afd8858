"""Issue 52 over a real fleet: DS-FL with confidently-wrong uploaders (valid probability rows, each all on the class
after the one its model predicts; ``confident_wrong`` in :mod:`insiders`) against what ``fedge coordinator`` runs by
default for DS-FL (``--robust median``, ERA, quorum 0.5): a fleet kit (TLS, one login per device, the least-privilege
ACL) served by mosquitto, ten clients each logged in with its own device bundle and serving from a thread of the test.
One kit, one broker and one set of clients serve three coordinator runs: all honest, 1 liar of 10, 3 liars of 10
(c000, c001, c002 lie or answer honestly as the run needs).

What the defaults hold, asserted: the kit gives the in-process run's accuracy at every round (so the 20-round,
three-seed measurements of ``experiments/backdoor.py dsfl`` are the deployment's), and from round 8 on every round
is within 2 points of the honest run with one liar and within 5 with three.

What they do not hold, kept as a strict xfail: the issue's "within 2 and 5 points at every round from round 3 on".
The median delays learning by about a round while the honest rows are still flat (seed 0: with one liar 5.3, 3.8,
6.4, 8.4, 4.9 points behind in rounds 3-7; with three 9.1, 11.6, 7.3, 4.4, 5.3). No rule that leaves the liars out
meets it either: the same fleet with the liars simply absent lags the all-honest run by up to 4.9 / 14.5 points in
rounds 3-6 under the median and 7.3 / 11.8 under the mean (worst of seeds 0-2; ``experiments/backdoor.py floor``): a
run in its steep rise moves that much with which uploads it averages. A default that meets it makes the xfail pass,
and strict makes that a failure: then drop the marker.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from insiders import Insider, dsfl_accuracies
from mqtt_support import require_mosquitto

from coordinator.run import provision_fleet, run_coordinator
from edge_client.client import EdgeClient
from edge_client.data import ClientDataInfo
from edge_client.mqtt import MqttEdgeClient
from fedge.aggregation.robust import DEPLOYMENT_SOFT_LABEL_RULE
from fedge.learning.backend import Backend, TorchBackend
from fedge.wire.message import Message
from fedge_cli.main import _run_config, build_parser
from fedge_io.credentials import load_bundle
from fedge_io.experiment import prepare
from sim.brokers import fleet_mosquitto, free_port

pytestmark = pytest.mark.broker

RUN = "dsfl-liars"
ROUNDS = 10
FLAGS = ["--algorithm", "dsfl", "--dataset", "digits", "--model", "tiny_mlp", "--num-clients", "10"]
FLAGS += ["--rounds", str(ROUNDS), "--partition", "iid", "--local-epochs", "2", "--lr", "0.1"]
FLAGS += ["--open-per-round", "300"]
LIARS = ("c000", "c001", "c002")
HELD_FROM = 8  # the first round from which the defaults hold both (measured, seed 0)


# One client step at a time: a DS-FL client builds its own model from the task's seed, which seeds torch's process-wide
# generator (fedge.learning.models.build_model); clients stepping at once in threads of one process would draw from
# each other's seeds (measured: up to 6.9 points off the in-process run). A device is its own process.
STEP = threading.Lock()


class Client(EdgeClient):
    """An honest client stepping under :data:`STEP`."""

    def handle(self, task: Message, broadcast: Message | None, backend: Backend | None = None) -> Message:
        with STEP:
            return super().handle(task, broadcast, backend)


class Liar(Insider):
    """A confidently-wrong uploader while ``lying``, an honest client otherwise; stepping under :data:`STEP`."""

    def __init__(self, honest: EdgeClient) -> None:
        super().__init__(honest, "confident_wrong")
        self.lying = False

    def handle(self, task: Message, broadcast: Message | None, backend: Backend | None = None) -> Message:
        with STEP:
            if self.lying:
                return super().handle(task, broadcast, backend)
            return EdgeClient.handle(self, task, broadcast, backend)


@pytest.fixture(scope="module")
def accuracy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, list[float]]]:
    """Liars (0, 1, 3) -> the accuracy after each round of a coordinator run over the kit's mosquitto."""
    require_mosquitto()
    root = tmp_path_factory.mktemp("dsfl-liars")
    config = _run_config(build_parser().parse_args(["coordinator", *FLAGS]), deployment=True)
    assert config.algo.robust == DEPLOYMENT_SOFT_LABEL_RULE == "median"  # type: ignore[attr-defined]
    assert config.algo.aggregation == "era" and config.min_replies == 0.5  # type: ignore[attr-defined]
    exp = prepare(config)
    kit = provision_fleet(exp, root / "kit", run=RUN, broker_hosts=["127.0.0.1"], port=free_port(),
                          bind_address="127.0.0.1")  # fmt: skip
    open_x = exp.open_x()
    liars: list[Liar] = []
    out: dict[int, list[float]] = {}
    with fleet_mosquitto(kit.broker_dir) as url, ExitStack() as stack:
        for c in sorted(exp.parts):
            backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes)  # its own: the threads train at once
            client: EdgeClient = Client(c, exp.client_data(c, open_x), backend)
            if c in LIARS:
                liars.append(Liar(client))
                client = liars[-1]
            info = ClientDataInfo(c, exp.model, exp.input_shape, exp.num_classes)
            server = MqttEdgeClient(client, info, load_bundle(kit.root / "clients" / c, broker=url).address, RUN)
            thread = threading.Thread(target=server.serve, name=c, daemon=True)
            thread.start()
            stack.callback(thread.join, 10)
            stack.callback(server.stop)
        coordinator = load_bundle(kit.coordinator_dir, broker=url)
        for n in (0, 1, 3):
            for i, liar in enumerate(liars):
                liar.lying = i < n
            result = run_coordinator(
                config,
                root / f"liars-{n}",
                broker=coordinator.address,
                run=RUN,
                provisioned=coordinator.clients,
                round_timeout=60,
                join_timeout=120,
                experiment=exp,
            )
            assert [r.round for r in result.rounds] == list(range(1, ROUNDS + 1))
            assert all(r.aggregated and len(r.replied) == 10 for r in result.rounds)  # the liars are not refused
            out[n] = [float(r.accuracy or 0.0) for r in result.rounds]
    yield out


def _gaps(accuracy: dict[int, list[float]], liars: int, first: int) -> list[float]:
    """Points (as a share) the run with ``liars`` is behind the honest run, rounds ``first``..ROUNDS."""
    return [h - a for h, a in zip(accuracy[0][first - 1 :], accuracy[liars][first - 1 :], strict=True)]


def test_over_the_kit_three_liars_give_what_they_give_in_process(accuracy: dict[int, list[float]]) -> None:
    in_process = dsfl_accuracies(DEPLOYMENT_SOFT_LABEL_RULE, 3, ROUNDS)
    assert max(abs(a - b) for a, b in zip(accuracy[3], in_process, strict=True)) <= 1e-9, (accuracy[3], in_process)


def test_the_default_holds_one_and_three_liars_from_round_8(accuracy: dict[int, list[float]]) -> None:
    assert accuracy[0][-1] > 0.85, accuracy[0]
    assert max(_gaps(accuracy, 1, HELD_FROM)) <= 0.02 + 1e-9, _gaps(accuracy, 1, 3)
    assert max(_gaps(accuracy, 3, HELD_FROM)) <= 0.05 + 1e-9, _gaps(accuracy, 3, 3)


@pytest.mark.xfail(strict=True, reason="the median runs about a round behind in rounds 3-7 (issue 52; module doc)")
def test_the_default_holds_one_and_three_liars_from_round_3(accuracy: dict[int, list[float]]) -> None:
    assert max(_gaps(accuracy, 1, 3)) <= 0.02 and max(_gaps(accuracy, 3, 3)) <= 0.05, accuracy
