"""MqttTransport against real brokers, with fake clients the test controls message by message."""

from __future__ import annotations

import dataclasses
import math
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest
import torch
from mqtt_support import (  # noqa: F401 - pytest fixtures
    FakeClient,
    broker_url,
    embedded_url,
    fake_clients,
    mosquitto_url,
    require_mosquitto,
)

from coordinator.mqtt import MqttTransport
from coordinator.replies import CATEGORIES
from coordinator.transport import Exchange
from fedge.algorithms.base import CheckedReply, Evaluation, RoundPlan, ServerContext, Strategy, TensorSpec
from fedge.config import RunConfig
from fedge.errors import TransportError
from fedge.types import ClientId
from fedge.wire.message import BROADCAST, TASK, UPDATE, Message, decode, encode
from fedge.wire.protocol import (
    COMPUTE_S,
    REFUSED,
    SESSION,
    BrokerAddress,
    ClientStatus,
    delivery_wire_bytes,
    encode_status,
    error_message,
)
from fedge_io.mqtt import MqttLink
from sim.brokers import free_port, mosquitto_broker

pytestmark = pytest.mark.broker


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


def vector_strategy(run: str) -> VectorStrategy:
    return VectorStrategy(RunConfig(), ServerContext(lambda: torch.nn.Linear(1, 1), 2, run_id=run))


def update(
    run: str,
    client: str,
    rnd: int,
    w: torch.Tensor | None = None,
    transport: dict[str, str] | None = None,
    *,
    session: str | None,
    **params: str,
) -> bytes:
    """An update of ``client``; ``session`` is the coordinator session it answers (None: the field is missing)."""
    w = torch.ones(4) if w is None else w
    params = {"num_examples": "3", **params}
    meta = {**({SESSION: session} if session is not None else {}), **(transport or {})}
    return encode(Message(UPDATE, rnd, run=run, client=client, params=params, tensors={"w": w}, transport=meta))


def start_round(
    transport: MqttTransport, strategy: Strategy, clients: list[str], rnd: int = 1
) -> tuple[threading.Thread, dict[str, Exchange], RoundPlan]:
    """Run ``exchange`` in a thread; the test plays the clients meanwhile."""
    holder: dict[str, Exchange] = {}
    plan = strategy.configure(rnd, clients)
    thread = threading.Thread(
        target=lambda: holder.setdefault("ex", transport.exchange(plan, lambda c, m: strategy.accept(rnd, c, m))),
        daemon=True,  # a failing test must not leave pytest waiting for the round's deadline
    )
    thread.start()
    return thread, holder, plan


def test_every_bad_message_is_rejected_with_its_reason_and_the_round_completes(
    broker_url: str,  # noqa: F811
    fake_clients: Callable[..., FakeClient],  # noqa: F811
) -> None:
    run = "bad"
    strategy = vector_strategy(run)
    with MqttTransport(BrokerAddress.parse(broker_url), run, round_timeout=30) as transport:
        fakes = [fake_clients(broker_url, run, c) for c in ("c000", "c001", "c002")]
        assert transport.wait_for_clients(3, 10) == ["c000", "c001", "c002"]
        sender = MqttLink(BrokerAddress.parse(broker_url), "attacker").start(10)
        thread, holder, _ = start_round(transport, strategy, ["c000", "c001"])  # c002 is online but not sampled
        for fake in fakes[:2]:
            fake.next(TASK)
            fake.next(BROADCAST)
        t = transport.topics
        nan = torch.tensor([1.0, float("nan"), 0.0, 0.0])
        # One sender, QoS 1: the broker keeps their order, so the duplicate arrives before the round closes.
        for topic, payload in [
            (t.update("c000"), b"\x10\x00\x00\x00\x00\x00\x00\x00garbage"),
            (t.update("c000"), update(run, "c000", 0, session=transport.session)),
            (t.update("c000"), update(run, "c000", 2, session=transport.session)),
            (t.update("c999"), update(run, "c999", 1, session=transport.session)),
            (t.update("c002"), update(run, "c002", 1, session=transport.session)),
            (t.update("c001"), update(run, "c001", 1, torch.ones(5), session=transport.session)),
            (t.update("c001"), update(run, "c001", 1, torch.ones(4, dtype=torch.float64), session=transport.session)),
            (t.update("c001"), update(run, "c001", 1, nan, session=transport.session)),
            (t.update("c000"), update(run, "c001", 1, session=transport.session)),
            (t.update("c000"), update("other-run", "c000", 1, session=transport.session)),
            (
                t.update("c000"),
                update(run, "c000", 1, loss="low", session=transport.session),
            ),  # aggregation would choke on it later
            (t.update("c000"), update(run, "c000", 1, session=None)),  # no session: refused with a reason
            (t.update("c000"), update(run, "c000", 1, session="0123456789ab")),  # another coordinator's session
            (t.update("c000"), update(run, "c000", 1, transport={COMPUTE_S: "0.25"}, session=transport.session)),
            (t.update("c000"), update(run, "c000", 1, session=transport.session)),
            (
                t.update("c001"),
                update(run, "c001", 1, transport={COMPUTE_S: "soon"}, session=transport.session),
            ),  # bad timing: accepted
        ]:
            sender.publish(topic, payload)
        thread.join(30)
        sender.close()
    ex = holder["ex"]
    assert sorted(ex.replies) == ["c000", "c001"] and ex.drops == []
    categories = Counter(r.category for r in ex.rejections)
    assert categories == {
        "unparseable": 1,
        "late": 2,  # an earlier round, another session
        "wrong round": 1,
        "unknown client": 1,
        "not sampled": 1,
        "invalid": 6,  # wrong shape, wrong dtype, NaN, wrong run, a loss that is not a number, no session
        "wrong sender": 1,
        "duplicate": 1,
    }
    assert set(categories) <= set(CATEGORIES)
    invalid = [r for r in ex.rejections if r.category == "invalid"]
    for rejection, why in zip(
        invalid, ("[5]", "float64", "NaN", "'other-run'", "'loss'", "without the session"), strict=True
    ):
        assert why in rejection.detail, rejection
    assert [r.client for r in ex.rejections if r.category in ("unknown client", "not sampled")] == ["c999", "c002"]
    # The timings of the accepted replies travel in the exchange; a client's nonsense compute time becomes NaN.
    timings = {x.client: x for x in ex.timings}
    assert timings["c000"].compute_s == 0.25 and math.isnan(timings["c001"].compute_s)
    assert all(x.round_trip_s >= 0 for x in ex.timings)
    # Every message that arrived is in the ledger: 16 uploads, the broadcast and two tasks.
    ups = [e for e in ex.entries if e.direction == "up"]
    assert len(ups) == 16 and ups[0].kind == "invalid" and ups[0].tensor_bytes == 0
    (bc,) = [e for e in ex.entries if e.kind == "broadcast"]
    assert bc.recipients == 2 and bc.tensor_bytes == 16
    # Counted for the two sampled clients, but the broker delivers a copy to every online subscriber.
    assert bc.wire_bytes == delivery_wire_bytes(transport.topics.broadcast, bc.payload_bytes, subscribers=3)


def test_silent_failed_and_offline_clients_are_dropped_with_reasons(
    embedded_url: str,  # noqa: F811
    fake_clients: Callable[..., FakeClient],  # noqa: F811
) -> None:
    run = "drops"
    strategy = vector_strategy(run)
    clients = ["c000", "c001", "c002", "c003"]
    with MqttTransport(BrokerAddress.parse(embedded_url), run, round_timeout=2.0, rejoin_grace=0.5) as transport:
        fakes = {c: fake_clients(embedded_url, run, c) for c in clients}
        transport.wait_for_clients(4, 10)
        thread, holder, plan = start_round(transport, strategy, clients)
        for fake in fakes.values():
            fake.next(TASK)
        fakes["c000"].link.publish(transport.topics.update("c000"), update(run, "c000", 1, session=transport.session))
        # c001 says goodbye the way its last will would; c002 stays silent; c003 cannot do its task.
        offline = encode_status(ClientStatus(client="c001", state="offline", reason="connection lost"), run)
        fakes["c001"].link.publish(transport.topics.status("c001"), offline, retain=True)
        task = dataclasses.replace(plan.tasks["c003"], transport={SESSION: transport.session})  # as it arrived
        failed = encode(error_message(task, "no open set here"))
        fakes["c003"].link.publish(transport.topics.update("c003"), failed)
        started = time.monotonic()
        thread.join(10)
        assert time.monotonic() - started < 5
        assert "c001" not in transport.available_clients()
    ex = holder["ex"]
    assert list(ex.replies) == ["c000"] and ex.dropped == ["c001", "c002", "c003"]
    drops = {d.client: d for d in ex.drops}
    assert drops["c001"].reason.startswith("went offline") and "connection lost" in drops["c001"].reason
    assert drops["c001"].after_s < 1.5  # when it went offline, not when the round gave up on it
    assert drops["c002"].reason.startswith("silent past the 2 s deadline") and drops["c002"].after_s >= 2.0
    assert drops["c003"].reason == "client failed: no open set here"
    assert [(r.client, r.category, r.detail) for r in ex.rejections] == [("c003", "client failed", "no open set here")]


def test_a_client_that_reconnects_mid_round_gets_its_task_again(
    mosquitto_url: str,  # noqa: F811
    fake_clients: Callable[..., FakeClient],  # noqa: F811
) -> None:
    run = "resend"
    strategy = vector_strategy(run)
    with MqttTransport(BrokerAddress.parse(mosquitto_url), run, round_timeout=20) as transport:
        fake = fake_clients(mosquitto_url, run, "c000")
        transport.wait_for_clients(1, 10)
        thread, holder, _ = start_round(transport, strategy, ["c000"])
        fake.next(TASK)
        # Cut the TCP connection without DISCONNECT: the broker publishes the will, the link reconnects and says hello.
        sock = fake.link._client.socket()
        assert isinstance(sock, socket.socket)
        sock.shutdown(socket.SHUT_RDWR)
        fake.next(TASK)  # sent again, on the task topic, together with its own copy of the broadcast
        fake.link.publish(transport.topics.update("c000"), update(run, "c000", 1, session=transport.session))
        thread.join(20)
        assert fake.link.connections == 2
    ex = holder["ex"]
    assert list(ex.replies) == ["c000"] and ex.drops == []
    resent = [e for e in ex.entries if e.direction == "down" and e.client == "c000"]
    assert sorted(e.kind for e in resent) == ["broadcast", "task", "task"]


def test_resends_are_bounded_one_per_reconnect_none_per_hello_and_a_flapping_client_is_dropped(
    mosquitto_url: str,  # noqa: F811
    fake_clients: Callable[..., FakeClient],  # noqa: F811
) -> None:
    run = "flap"
    strategy = vector_strategy(run)
    address = BrokerAddress.parse(mosquitto_url)
    with MqttTransport(address, run, round_timeout=30, max_reconnects=2) as transport:
        fakes = {c: fake_clients(mosquitto_url, run, c) for c in ("c000", "c001")}
        transport.wait_for_clients(2, 10)
        thread, holder, _ = start_round(transport, strategy, ["c000", "c001"])
        for fake in fakes.values():
            fake.next(TASK)
        # c000 repeats its hello on its live connection (spaced past the presence rate limit): no resend.
        for _ in range(4):
            fakes["c000"]._announce(fakes["c000"].link)
            time.sleep(0.6)
        # c001 drops its connection three times; the limit is two reconnects, each worth one resend.
        for cut in range(3):
            sock = fakes["c001"].link._client.socket()
            assert isinstance(sock, socket.socket)
            sock.shutdown(socket.SHUT_RDWR)
            deadline = time.monotonic() + 10
            while fakes["c001"].link.connections < cut + 2:
                assert time.monotonic() < deadline, "no reconnect"
                time.sleep(0.05)
            if cut < 2:
                fakes["c001"].next(TASK)  # its task again, with its own copy of the broadcast
        fakes["c000"].link.publish(transport.topics.update("c000"), update(run, "c000", 1, session=transport.session))
        thread.join(30)
        assert not thread.is_alive()
    ex = holder["ex"]
    assert list(ex.replies) == ["c000"]
    (drop,) = ex.drops
    assert drop.client == "c001" and drop.reason == "reconnected 3 times during the round (limit 2)"
    down = Counter((e.client, e.kind) for e in ex.entries if e.direction == "down")
    # The resent bytes are in the ledger: c000 got one task (its hellos cost nothing), c001 its task twice more.
    assert down[("c000", "task")] == 1 and down[("c000", "broadcast")] == 0
    assert down[("c001", "task")] == 3 and down[("c001", "broadcast")] == 2
    assert all(e.payload_bytes > 0 for e in ex.entries if e.direction == "down")


def test_waiting_for_clients_times_out_naming_who_is_missing_and_who_was_refused(
    embedded_url: str,  # noqa: F811
    fake_clients: Callable[..., FakeClient],  # noqa: F811
) -> None:
    def admit(s: ClientStatus) -> str | None:
        return None if s.model == "tiny_mlp" else f"model {s.model!r} is not tiny_mlp"

    with MqttTransport(BrokerAddress.parse(embedded_url), "join", admit=admit) as transport:
        fake_clients(embedded_url, "join", "c000", model="tiny_mlp")
        fake_clients(embedded_url, "join", "c001", model="resnet")
        with pytest.raises(TransportError, match=r"only 1 of 2 clients.*c001 refused: model 'resnet'"):
            transport.wait_for_clients(2, 1.0)
        assert transport.presence.available() == ["c000"] and list(transport.presence.refused) == ["c001"]


def test_refusals_that_leave_too_few_provisioned_clients_stop_the_wait_at_once_and_the_refused_client_is_told(
    embedded_url: str,  # noqa: F811
    fake_clients: Callable[..., FakeClient],  # noqa: F811
) -> None:
    def admit(s: ClientStatus) -> str | None:
        return None if s.model == "tiny_mlp" else f"model {s.model!r} is not tiny_mlp"

    with MqttTransport(BrokerAddress.parse(embedded_url), "quorum", admit=admit) as transport:
        fake_clients(embedded_url, "quorum", "c000", model="tiny_mlp")
        wrong = fake_clients(embedded_url, "quorum", "c001", model="resnet")
        started = time.monotonic()
        with pytest.raises(
            TransportError,
            match=r"2 clients cannot join .*of the 2 provisioned, 1 were refused "
            r"\(c001 refused: model 'resnet' is not tiny_mlp\)",
        ):
            transport.wait_for_clients(2, 120.0, among=["c000", "c001"])
        assert time.monotonic() - started < 15  # not the join timeout
        notice = decode(wrong.next(REFUSED).payload)
        assert notice.client == "c001" and notice.params["reason"] == "model 'resnet' is not tiny_mlp"
        # Among three provisioned clients one refusal still leaves two: the wait goes on (to its timeout here).
        with pytest.raises(TransportError, match=r"only 1 of 2 clients"):
            transport.wait_for_clients(2, 1.0, among=["c000", "c001", "c002"])


def test_a_refused_client_process_exits_with_the_coordinators_reason(
    embedded_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    import subprocess
    import sys

    from fedge_io.experiment import prepare
    from sim.provision import write_client_files

    config = RunConfig(algorithm="fedavg", dataset="digits", model="tiny_mlp", num_clients=2, rounds=1)
    data = write_client_files(prepare(config), tmp_path)["c000"]

    def admit(s: ClientStatus) -> str | None:
        return "this run wants other devices"

    with MqttTransport(BrokerAddress.parse(embedded_url), "refusing", admit=admit) as transport:
        args = ["client", "--data", str(data), "--broker", embedded_url, "--run", "refusing", "--client-id", "c000"]
        client = subprocess.Popen(
            [sys.executable, "-m", "fedge_cli.main", *args],
            cwd=Path(__file__).resolve().parents[2],
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            with pytest.raises(TransportError, match="c000 refused: this run wants other devices"):
                transport.wait_for_clients(1, 300.0, among=["c000"])
            _, err = client.communicate(timeout=60)
        finally:
            client.kill()
    assert client.returncode == 3, err[-2000:]
    assert "refused by the coordinator of run refusing: this run wants other devices" in err


def test_an_unreachable_broker_is_a_clear_error() -> None:
    link = MqttLink(BrokerAddress("127.0.0.1", free_port()), "nobody")
    with pytest.raises(TransportError, match=r"cannot reach broker at mqtt://127\.0\.0\.1:\d+: .*is it running"):
        link.start(timeout=0.5)


def test_the_link_reconnects_and_resubscribes_after_a_broker_restart() -> None:
    require_mosquitto()
    port = free_port()
    ready: list[int] = []
    with mosquitto_broker(port) as url:
        address = BrokerAddress.parse(url)
        link = MqttLink(
            address, "survivor", subscriptions=[("t/#", 1)], on_ready=lambda _: ready.append(1), backoff=(0.1, 0.5)
        ).start(10)
    deadline = time.monotonic() + 10
    while link.connected and time.monotonic() < deadline:  # the broker is gone; the link notices
        time.sleep(0.05)
    assert not link.connected
    try:
        with mosquitto_broker(port):
            assert link.wait_ready(10), "the link did not reconnect"
            other = MqttLink(address, "other").start(10)
            other.publish("t/x", b"after restart").wait_for_publish(5)
            item = link.get(5)
            assert item is not None and item.payload == b"after restart"  # subscribed again without being asked
            assert link.connections == 2 and len(ready) == 2
            other.close()
    finally:
        link.close(wait=0)
