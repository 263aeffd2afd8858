"""The edge client's message handling without a broker: tasks and broadcasts, duplicates, new runs, failures."""

from __future__ import annotations

from typing import Any

import torch

from edge_client.data import ClientDataInfo
from edge_client.mqtt import MqttEdgeClient
from fedge.algorithms.base import ClientData
from fedge.errors import ConfigError
from fedge.learning.backend import Backend, TorchBackend
from fedge.wire.message import BROADCAST, TASK, UPDATE, Message, decode
from fedge.wire.protocol import BROADCAST_ROUND, COMPUTE_CPU_S, COMPUTE_S, SESSION, BrokerAddress


class StubClient:
    """Counts how often it computed, keeps a store, fails on request."""

    def __init__(self) -> None:
        self.client_id = "c000"
        self.data = ClientData(x=torch.zeros(3, 2), y=torch.zeros(3, dtype=torch.long), num_classes=2)
        self.store: dict[str, torch.Tensor] = {}
        self.calls: list[tuple[int, int | None]] = []
        self.broadcast_sessions: list[str | None] = []  # the coordinator session of the broadcast each call got
        self.backend = TorchBackend("tiny_mlp", (2,), 2)

    def handle(self, task: Message, broadcast: Message | None, backend: Backend | None = None) -> Message:
        if task.params.get("fail"):
            raise ConfigError("no open set here")
        self.calls.append((task.round, None if broadcast is None else broadcast.round))
        self.broadcast_sessions.append(None if broadcast is None else broadcast.transport.get(SESSION))
        self.store["seen"] = torch.tensor(task.round)
        return Message(UPDATE, task.round, run=task.run, client=task.client, params={"num_examples": "3"})


def make() -> tuple[MqttEdgeClient, StubClient, list[Message]]:
    stub = StubClient()
    info = ClientDataInfo("c000", "tiny_mlp", (2,), 2)
    server = MqttEdgeClient(stub, info, BrokerAddress("127.0.0.1", 1), "lab")  # type: ignore[arg-type]
    sent: list[Message] = []

    def publish(topic: str, payload: bytes, **kwargs: Any) -> None:
        assert topic == "fedge/lab/update/c000"
        sent.append(decode(payload))

    server.link.publish = publish  # type: ignore[assignment,method-assign]
    return server, stub, sent


def task(rnd: int, session: str = "s1", *, with_broadcast: bool = True, **params: str) -> Message:
    meta = {SESSION: session, **({BROADCAST_ROUND: str(rnd)} if with_broadcast else {})}
    return Message(TASK, rnd, run="lab", client="c000", params=params, transport=meta)


def broadcast(rnd: int, session: str = "s1") -> Message:
    return Message(BROADCAST, rnd, run="lab", tensors={"w": torch.ones(2)}, transport={SESSION: session})


def test_a_task_waits_for_its_broadcast_whichever_arrives_first() -> None:
    server, stub, sent = make()
    server._on_task(task(1))
    assert stub.calls == []  # the broadcast is not there yet
    server._on_broadcast(broadcast(1))
    server._on_broadcast(broadcast(2))
    server._on_task(task(2))
    server._on_task(task(3, with_broadcast=False))
    assert stub.calls == [(1, 1), (2, 2), (3, None)]
    assert [(m.kind, m.round) for m in sent] == [("update", 1), ("update", 2), ("update", 3)]
    # The client's timings travel as transport metadata, apart from the algorithm's fields.
    assert sent[0].params == {"num_examples": "3"}
    assert float(sent[0].transport[COMPUTE_S]) >= 0 and float(sent[0].transport[COMPUTE_CPU_S]) >= 0


def test_a_task_delivered_twice_is_computed_once_and_answered_with_the_stored_reply() -> None:
    server, stub, sent = make()
    server._on_broadcast(broadcast(1))
    server._on_task(task(1))
    server._on_task(task(1))  # resent after a reconnect: the first reply may have been lost with the link
    assert len(stub.calls) == 1 and len(sent) == 2 and sent[0] == sent[1]
    server._resend_latest()  # what serve() does after every reconnect
    assert len(stub.calls) == 1 and len(sent) == 3 and sent[2] == sent[0] and server.replies_resent == 2


def test_a_new_coordinator_run_under_the_same_name_starts_from_fresh_state() -> None:
    server, stub, sent = make()
    server._on_broadcast(broadcast(1, "old"))
    server._on_task(task(1, "old"))
    assert "seen" in stub.store
    stub.store["own_model"] = torch.ones(1)
    server._on_broadcast(broadcast(1, "new"))
    server._on_task(task(1, "new"))  # round 1 again, but of another run: computed, with the new run's broadcast
    assert stub.calls == [(1, 1), (1, 1)] and len(sent) == 2
    assert stub.broadcast_sessions == ["old", "new"]  # not the old run's round-1 broadcast again
    assert "own_model" not in stub.store


def test_a_task_the_client_cannot_do_is_answered_with_an_error() -> None:
    server, _, sent = make()
    server._on_task(task(1, with_broadcast=False, fail="1"))
    assert [(m.kind, m.params["error"]) for m in sent] == [("error", "no open set here")]
