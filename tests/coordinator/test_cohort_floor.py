"""The cohort floor (issue 55): a round never aggregates fewer replies than ``--min-cohort`` (default 2), whatever
the quorum's share; a round with fewer clients available than it samples waits for the floor first, and gives a client
that comes online early in the round its task (over a real mosquitto)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

import pytest
import torch
from mqtt_support import FakeClient, fake_clients, require_mosquitto  # noqa: F401 - pytest fixtures

from coordinator.engine import RoundEngine
from coordinator.mqtt import MqttTransport
from coordinator.transport import Exchange, ReplyCheck
from edge_client.client import EdgeClient
from fedge.accounting.records import Drop
from fedge.algorithms.base import CheckedReply, Evaluation, RoundPlan, ServerContext, Strategy, TensorSpec
from fedge.config import RunConfig, TrainConfig
from fedge.learning.backend import TorchBackend
from fedge.types import ClientId
from fedge.wire.message import BROADCAST, TASK, UPDATE, Message, decode, encode
from fedge.wire.protocol import SESSION, BrokerAddress
from fedge_io.experiment import prepare
from sim.brokers import mosquitto_broker
from sim.inprocess import InProcessTransport

CONFIG = RunConfig(
    algorithm="fedavg",
    dataset="synthetic",
    model="tiny_mlp",
    num_clients=3,
    rounds=1,
    partition="iid",
    min_replies=0.5,
    train=TrainConfig(local_epochs=1, batch_size=32),
)


class Silent:
    """The in-process transport, except that ``silent`` clients never reply (dropped, as over a broker)."""

    def __init__(self, inner: InProcessTransport, silent: set[str]) -> None:
        self.inner, self.silent = inner, silent

    def available_clients(self) -> Sequence[ClientId]:
        return self.inner.available_clients()

    def exchange(self, plan: RoundPlan, check: ReplyCheck) -> Exchange:
        kept = RoundPlan(plan.broadcast, {c: t for c, t in plan.tasks.items() if c not in self.silent})
        out = self.inner.exchange(kept, check)
        out.drops += [Drop(c, "silent past the deadline", 1.0) for c in sorted(plan.tasks) if c in self.silent]
        return out


def _one_round(config: RunConfig) -> tuple[bool, int, int]:
    exp = prepare(config)
    backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes)
    clients = [EdgeClient(c, exp.client_data(c, None), backend) for c in sorted(exp.parts)]
    x, y = exp.test_tensors()
    engine = RoundEngine(exp.config, exp.strategy("floor"), Silent(InProcessTransport(clients), {"c001", "c002"}), x, y)
    (record,) = engine.run().rounds
    return record.aggregated, len(record.replied), record.quorum


def test_one_reply_of_three_is_no_aggregate_by_default_and_min_cohort_says_how_many() -> None:
    # The quorum's share alone (half of 3 sampled: 2) would already refuse one reply; with 2 of 3 sampled silent and
    # a share of a third, the floor is what decides.
    third = dataclasses.replace(CONFIG, min_replies=0.3)
    assert _one_round(third) == (False, 1, 2)  # the default floor: 2
    assert _one_round(dataclasses.replace(third, min_cohort=1)) == (True, 1, 1)
    assert dataclasses.replace(CONFIG, num_clients=1).cohort_floor == 1  # capped at the clients per round


def test_the_flag_sets_the_floor() -> None:
    from fedge_cli.main import _run_config, build_parser

    args = build_parser().parse_args(["coordinator", "--min-cohort", "3", "--num-clients", "4"])
    assert _run_config(args, deployment=True).cohort_floor == 3


# --- over a broker ----------------------------------------------------------------------------------------------


class VectorStrategy(Strategy):
    """Just enough of a strategy to judge replies: one float32 tensor "w" of 4 values."""

    def configure(self, rnd: int, clients: Sequence[ClientId]) -> RoundPlan:
        return RoundPlan(
            broadcast=Message(BROADCAST, rnd, run=self.run_id, tensors={"w": torch.zeros(4)}),
            tasks={c: Message(TASK, rnd, run=self.run_id, client=c, params={"algorithm": "vector"}) for c in clients},
        )

    def aggregate(self, rnd: int, replies: Mapping[ClientId, CheckedReply]) -> dict[str, float]:
        return {}

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> Evaluation | None:
        return None

    def reply_tensors(self) -> dict[str, TensorSpec]:
        return {"w": ((4,), torch.float32)}


@pytest.fixture(scope="module")
def mosquitto_url() -> Iterator[str]:
    require_mosquitto()
    with mosquitto_broker() as url:
        yield url


def _reply(fake: FakeClient, run: str, session: str) -> None:
    task = decode(fake.next(TASK).payload)
    fake.next(BROADCAST)
    msg = Message(
        UPDATE, task.round, run=run, client=fake.client, params={"num_examples": "3"}, tensors={"w": torch.ones(4)}
    )
    fake.link.publish(fake.topics.update(fake.client), encode(dataclasses.replace(msg, transport={SESSION: session})))


def _round(
    transport: MqttTransport, strategy: Strategy, plan: RoundPlan
) -> tuple[threading.Thread, dict[str, Exchange]]:
    holder: dict[str, Exchange] = {}
    rnd = next(iter(plan.tasks.values())).round
    thread = threading.Thread(
        target=lambda: holder.setdefault("ex", transport.exchange(plan, lambda c, m: strategy.accept(rnd, c, m))),
        daemon=True,  # a failing test must not leave pytest waiting for the round's deadline
    )
    thread.start()
    return thread, holder


@pytest.mark.broker
def test_a_round_short_of_clients_waits_for_the_floor_and_takes_a_latecomer(
    mosquitto_url: str,
    fake_clients: Callable[..., FakeClient],  # noqa: F811
) -> None:
    run = "latecomer"
    strategy = VectorStrategy(RunConfig(), ServerContext(lambda: torch.nn.Linear(1, 1), 2, run_id=run))
    with MqttTransport(BrokerAddress.parse(mosquitto_url), run, round_timeout=30) as transport:
        c000 = fake_clients(mosquitto_url, run, "c000")
        assert transport.wait_for_clients(1, 10) == ["c000"]
        # One client available and a floor of 2: sampling waits for a second one instead of sampling one.
        transport.min_available = 2
        started: list[FakeClient] = []
        later = threading.Timer(1.0, lambda: started.append(fake_clients(mosquitto_url, run, "c001")))
        later.start()
        assert transport.available_clients() == ["c000", "c001"]
        later.join()

        # Round 1 samples the two; a third client comes online early in the round and is given its task.
        plan = strategy.configure(1, ["c000", "c001"])
        plan = dataclasses.replace(plan, late_task=lambda c: strategy.configure(1, [c]).tasks[c], cohort=3)
        thread, holder = _round(transport, strategy, plan)
        c002 = fake_clients(mosquitto_url, run, "c002")
        # The latecomer answers first: once both sampled clients have replied the round is complete, and a hello
        # that the broker delivers after their replies (its publisher's network thread is slower under load) would
        # find no round to join.
        for fake in (c002, c000, started[0]):
            _reply(fake, run, transport.session)
        thread.join(40)
        ex = holder["ex"]
        assert ex.added == ["c002"] and sorted(ex.replies) == ["c000", "c001", "c002"] and not ex.drops

        # Round 2 takes no latecomers (no late_task: what DP and secure aggregation runs plan): c003 gets nothing.
        thread, holder = _round(transport, strategy, strategy.configure(2, ["c000"]))
        c003 = fake_clients(mosquitto_url, run, "c003")
        _reply(c000, run, transport.session)
        thread.join(40)
        assert holder["ex"].added == [] and sorted(holder["ex"].replies) == ["c000"]
        # Nothing on its own task topic. The round's broadcast goes to every subscriber: c003 has it when its
        # subscription reached the broker before the coordinator's publish did (a loaded machine).
        received = []
        while (item := c003.link.get(1.0)) is not None:
            received.append(item.topic)
        assert all(topic.endswith("/broadcast") for topic in received), received
