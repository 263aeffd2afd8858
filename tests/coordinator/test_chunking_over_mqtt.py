"""Chunked messages over a real mosquitto that refuses packets over 1,000,000 bytes (EMQX's default is 1 MB).

A fedavg_cnn run on digits scaled to 24x24 (1,237,386 parameters: 4.9 MB broadcasts and updates) with two clients
served from threads of this process: it fails at once with a clear error when chunking is off, completes with it,
gives the same model as the unchunked run over an unlimited broker, and its ledger agrees with the broker's $SYS
counters. A client that loses one chunk of its reply is dropped for that round with the reason while the run goes
on. Hostile chunks (bad hash, disagreeing counts, absurd sizes, floods of partial messages, unknown senders) are
rejected under the reply policy's categories, and reassembly never holds more than its budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from mqtt_support import FakeClient, fake_clients, require_mosquitto  # noqa: F401 - a pytest fixture
from safetensors.torch import load_file

from coordinator.kit.accounts import FleetSpec
from coordinator.kit.broker_files import mosquitto_conf
from coordinator.mqtt import MqttTransport
from coordinator.replies import CATEGORIES
from coordinator.run import run_coordinator
from edge_client.client import EdgeClient
from edge_client.data import ClientDataInfo
from edge_client.mqtt import MqttEdgeClient
from fedge.accounting.ledger import read_ledger_csv
from fedge.algorithms.base import CheckedReply, Evaluation, RoundPlan, ServerContext, Strategy, TensorSpec
from fedge.config import RunConfig, TrainConfig
from fedge.data.datasets import Dataset
from fedge.errors import ConfigError
from fedge.learning.backend import TorchBackend
from fedge.types import ClientId
from fedge.wire import chunking
from fedge.wire.message import BROADCAST, TASK, UPDATE, Message, encode
from fedge.wire.protocol import SESSION, BrokerAddress, publish_packet_bytes
from fedge_io.experiment import Experiment, prepare
from fedge_io.mqtt import MqttLink, PacketLimit, PacketTooLarge, parse_packet_limit
from fedge_io.rundir import RunResult
from sim.brokers import mosquitto_broker

pytestmark = pytest.mark.broker

LIMIT = 1_000_000
CONFIG = RunConfig(
    algorithm="fedavg",
    dataset="digits",
    model="fedavg_cnn",
    num_clients=2,
    rounds=2,
    partition="iid",
    eval_samples=100,
    train=TrainConfig(local_epochs=1, batch_size=10),
)


def _scaled(d: Dataset, factor: int = 3) -> Dataset:
    """The 8x8 digits as 24x24 images (each pixel a 3x3 block): a model over the 1 MB limit, data that still learns."""
    x = np.repeat(np.repeat(d.x, factor, axis=2), factor, axis=3)
    return dataclasses.replace(d, x=np.ascontiguousarray(x))


@pytest.fixture(scope="module")
def exp() -> Experiment:
    base = prepare(CONFIG)
    parts = {c: idx[:30] for c, idx in base.parts.items()}  # 30 samples per client keep each round short
    return dataclasses.replace(base, train=_scaled(base.train), test=_scaled(base.test), parts=parts)


@pytest.fixture(scope="module")
def limited_url() -> Iterator[str]:
    require_mosquitto()
    with mosquitto_broker(max_packet_size=LIMIT) as url:
        yield url


@pytest.fixture(scope="module")
def unlimited_url() -> Iterator[str]:
    require_mosquitto()
    with mosquitto_broker() as url:
        yield url


@contextlib.contextmanager
def thread_clients(
    exp: Experiment, url: str, run: str, *, max_packet_size: PacketLimit = "auto"
) -> Iterator[dict[ClientId, MqttEdgeClient]]:
    """Real edge clients (the torch runtime and MQTT side of ``fedge client``) served from threads of this process."""
    servers: dict[ClientId, MqttEdgeClient] = {}
    threads = []
    for cid in sorted(exp.parts):
        backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes)
        info = ClientDataInfo(cid, exp.model, exp.input_shape, exp.num_classes)
        client = EdgeClient(cid, exp.client_data(cid), backend)
        servers[cid] = MqttEdgeClient(client, info, BrokerAddress.parse(url), run, max_packet_size=max_packet_size)
        threads.append(threading.Thread(target=servers[cid].serve, kwargs={"connect_timeout": 10}, daemon=True))
    for thread in threads:
        thread.start()
    try:
        yield servers
    finally:
        for server in servers.values():
            server.stop()
        for thread in threads:
            thread.join(10)


def coordinate(exp: Experiment, url: str, run_dir: Path, **kwargs: Any) -> RunResult:
    kwargs = {"round_timeout": 30.0, "join_timeout": 20.0, "broker_counters": True, **kwargs}
    return run_coordinator(exp.config, run_dir, broker=url, experiment=exp, **kwargs)


@pytest.fixture(scope="module")
def unchunked(exp: Experiment, unlimited_url: str, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """The reference: the same run over a broker without a packet limit, where nothing is chunked."""
    run_dir = tmp_path_factory.mktemp("unchunked") / "plain"
    with thread_clients(exp, unlimited_url, "plain"):
        return coordinate(exp, unlimited_url, run_dir, broker_counters=False)


def test_without_chunking_the_run_fails_at_once_with_the_reason(
    exp: Experiment, limited_url: str, tmp_path: Path
) -> None:
    one_round = dataclasses.replace(exp, config=dataclasses.replace(exp.config, rounds=1))
    started = time.monotonic()
    # Clients that may not chunk say why instead of updating; the coordinator records it as their drop reason.
    with thread_clients(exp, limited_url, "client-off", max_packet_size="off"):
        result = coordinate(one_round, limited_url, tmp_path / "client-off", broker_counters=False)
    assert [d["client"] for d in result.summary["drops"]] == ["c000", "c001"]
    assert all("exceeds the broker's maximum packet size" in d["reason"] for d in result.summary["drops"])
    assert [r.aggregated for r in result.rounds] == [False]
    # A coordinator that may not chunk cannot send its broadcast: a clear error, before anyone waits for a deadline.
    with (
        thread_clients(exp, limited_url, "off"),
        pytest.raises(PacketTooLarge, match=r"exceeds the broker's maximum packet size .* of 1,000,000 bytes; chunk"),
    ):
        coordinate(one_round, limited_url, tmp_path / "off", max_packet_size="off", broker_counters=False)
    assert time.monotonic() - started < 30


def test_with_chunking_the_run_completes_with_the_unchunked_model_and_the_brokers_byte_count(
    exp: Experiment, limited_url: str, unchunked: RunResult, tmp_path: Path
) -> None:
    with thread_clients(exp, limited_url, "chunked") as clients:
        result = coordinate(exp, limited_url, tmp_path / "chunked")
        assert all(c.link.broker_max_packet_size == LIMIT and c.link.chunked == 2 for c in clients.values())
    s = result.summary
    assert s["max_packet_size"] == s["broker_max_packet_size"] == LIMIT and s["chunked_messages_sent"] == 2
    assert unchunked.summary["max_packet_size"] is None and unchunked.summary["chunked_messages_sent"] == 0
    assert s["dropped"] == [] and s["rejected"] == 0
    # The same global model, bit for bit, and the same tensor bytes.
    ours, plain = (load_file(r.path / "global_model.safetensors") for r in (result, unchunked))
    assert ours.keys() == plain.keys() and all(torch.equal(ours[k], plain[k]) for k in ours)
    assert [r.accuracy for r in result.rounds] == [r.accuracy for r in unchunked.rounds]
    rows, plain_rows = (read_ledger_csv(r.path / "ledger.csv") for r in (result, unchunked))
    key = [(e.round, e.direction, e.client, e.kind, e.tensor_bytes) for e in rows]
    assert sorted(key) == sorted((e.round, e.direction, e.client, e.kind, e.tensor_bytes) for e in plain_rows)
    # Chunk headers are counted: a 4.9 MB broadcast travels as 5 chunks of 68 header bytes each.
    (first, *_), (plain_first, *_) = ([e for e in r if e.kind == "broadcast"] for r in (rows, plain_rows))
    slice_bytes = chunking.largest_payload("fedge/chunked/broadcast", LIMIT) - chunking.HEADER_BYTES
    chunks = -(-plain_first.payload_bytes // slice_bytes)
    assert chunks == 5 and first.payload_bytes == plain_first.payload_bytes + chunks * chunking.HEADER_BYTES
    # The ledger's wire bytes against the broker's own counters, every chunk's PUBLISH and PUBACK included.
    bb = s["broker_bytes"]
    assert bb["comparable"] and abs(bb["diff_pct"]) < 3.0, bb
    print(f"ledger wire {bb['ledger_wire']:,} B, broker $SYS {bb['broker_total']:,} B ({bb['diff_pct']:+.3f}%)")


def test_a_lost_chunk_drops_that_client_for_the_round_and_the_run_goes_on(
    exp: Experiment, limited_url: str, tmp_path: Path
) -> None:
    # Two clients, one of whose replies is lost: a round of one reply is aggregated only with the cohort floor at 1.
    config = dataclasses.replace(exp.config, min_replies=0.5, min_cohort=1)
    with thread_clients(exp, limited_url, "lossy") as clients:
        link = clients["c001"].link
        publish, lost = link.publish, []

        def lose_one(topic: str, payload: bytes, **kwargs: Any) -> Any:
            if "/update/" in topic and chunking.is_chunk(payload) and not lost:
                lost.append(chunking.parse_header(payload).index)  # its first chunk never reaches the broker
                return None
            return publish(topic, payload, **kwargs)

        link.publish = lose_one  # type: ignore[method-assign]
        # 10 s: round 1 waits it out for c001, and the honest clients need their 5 MB exchange done within it even
        # on a loaded 2-core machine (3 s was tight).
        lossy = dataclasses.replace(exp, config=config)
        result = coordinate(lossy, limited_url, tmp_path / "lossy", round_timeout=10.0)
    assert lost == [0]
    (drop,) = result.summary["drops"]
    assert (drop["round"], drop["client"]) == (1, "c001")
    assert drop["reason"] == "incomplete reply: 4 of 5 chunks by the 10 s deadline"
    assert [r.aggregated for r in result.rounds] == [True, True]
    assert [sorted(t.client for t in r.timings) for r in result.rounds] == [["c000"], ["c000", "c001"]]
    rows = [e for e in read_ledger_csv(result.path / "ledger.csv") if e.kind == "incomplete"]
    assert [(e.round, e.client) for e in rows] == [(1, "c001")] and rows[0].payload_bytes > 3 * LIMIT


def test_the_probe_learns_the_limit_and_send_keeps_every_packet_within_it(limited_url: str, unlimited_url: str) -> None:
    topic = "fedge/probe/update/c000"
    receiver = MqttLink(BrokerAddress.parse(limited_url), "receiver", subscriptions=[(topic, 1)]).start(10)
    sender = MqttLink(BrokerAddress.parse(limited_url), "sender").start(10)
    assert sender.broker_max_packet_size == LIMIT == sender.packet_limit
    payload = np.random.default_rng(0).bytes(2_500_000)
    sizes = sender.send(topic, payload)
    assert len(sizes) == 3 and max(publish_packet_bytes(topic, s) for s in sizes) <= LIMIT
    reassembler = chunking.Reassembler()
    verdicts = []
    for _ in sizes:
        item = receiver.get(10)
        assert item is not None
        verdicts.append(reassembler.add("sender", item.payload, time.monotonic()))
    assert verdicts[-1].payload == payload
    with pytest.raises(PacketTooLarge, match="1,000,000 bytes"):
        sender.publish(topic, payload)  # one whole PUBLISH: refused here, not by a disconnect
    smaller = MqttLink(BrokerAddress.parse(limited_url), "smaller", max_packet_size=200_000).start(10)
    assert smaller.packet_limit == 200_000 and len(smaller.send(topic, payload)) == 13
    for link in (receiver, sender, smaller):
        link.close(wait=1)
    plain = MqttLink(BrokerAddress.parse(unlimited_url), "plain").start(10)
    assert plain.broker_max_packet_size is None and plain.send(topic, payload) == [len(payload)]
    plain.close(wait=1)


# --- hostile chunks, at the transport ---------------------------------------------------------------------------

N = 3000  # float32 values of the reply: 12 kB, 7 chunks of at most 2,048-byte packets


class VectorStrategy(Strategy):
    """Just enough of a strategy to judge replies: one float32 tensor "w" of N values."""

    def configure(self, rnd: int, clients: Sequence[ClientId]) -> RoundPlan:
        return RoundPlan(
            broadcast=Message(BROADCAST, rnd, run=self.run_id, tensors={"w": torch.zeros(4)}),  # small: not chunked
            tasks={c: Message(TASK, rnd, run=self.run_id, client=c, params={"algorithm": "vector"}) for c in clients},
        )

    def aggregate(self, rnd: int, replies: Mapping[ClientId, CheckedReply]) -> dict[str, float]:
        return {}

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> Evaluation | None:
        return None

    def reply_tensors(self) -> dict[str, TensorSpec]:
        return {"w": ((N,), torch.float32)}


def _header(msg_id: int, index: int, count: int, total: int, slice_bytes: int) -> bytes:
    return struct.pack(">8sQIIQI32s", chunking.MAGIC, msg_id, index, count, total, slice_bytes, bytes(32))


def test_hostile_chunks_are_rejected_by_the_reply_policy_with_bounded_memory(
    unlimited_url: str,
    fake_clients: Callable[..., FakeClient],  # noqa: F811
) -> None:
    run = "hostile-chunks"
    strategy = VectorStrategy(RunConfig(), ServerContext(lambda: torch.nn.Linear(1, 1), 2, run_id=run))
    address = BrokerAddress.parse(unlimited_url)
    with MqttTransport(address, run, round_timeout=20, max_packet_size=2048) as transport:
        transport.max_payload = 4 * N + 64 * 1024  # as run_coordinator sets it: the tensors plus metadata slack
        fakes = [fake_clients(unlimited_url, run, c) for c in ("c000", "c001", "c002")]
        transport.wait_for_clients(3, 10)
        attacker = MqttLink(address, "attacker").start(10)
        holder: dict[str, Any] = {}
        plan = strategy.configure(1, ["c000", "c001"])  # c002 is online but not sampled
        thread = threading.Thread(
            target=lambda: holder.setdefault("ex", transport.exchange(plan, lambda c, m: strategy.accept(1, c, m))),
            daemon=True,
        )
        thread.start()
        for fake in fakes[:2]:
            fake.next(TASK)
        t = transport.topics
        honest = encode(
            Message(
                UPDATE,
                1,
                run=run,
                client="c000",
                params={"num_examples": "3"},
                tensors={"w": torch.ones(N)},
                transport={SESSION: transport.session},
            )
        )
        limit = chunking.largest_payload(t.update("c000"), 2048)
        good = chunking.split(honest, limit, message_id=1)
        tampered = chunking.split(honest, limit, message_id=2)
        tampered[3] = tampered[3][:-1] + bytes([tampered[3][-1] ^ 1])  # one flipped bit: the hash no longer matches
        other_count = chunking.split(honest + bytes(2000), limit, message_id=1)  # id 1 again, but 8 chunks, not 7
        flood = [chunking.split(honest, limit, message_id=100 + i)[0] for i in range(300)]
        sent: list[tuple[str, bytes]] = [
            *((t.update("c999"), c) for c in chunking.split(honest, limit, message_id=7)[:3]),  # unknown: 1 verdict
            (t.update("c002"), good[0]),  # known, but not sampled
            (t.update("c000"), _header(9, 0, 2, 1 << 29, 1 << 28)[:-1] + b"x"),  # a malformed header
            (t.update("c000"), _header(9, 0, 1024, 1 << 29, 1 << 19) + bytes(1 << 19)[:10]),  # short of its slice
            (t.update("c000"), _header(10, 0, -(-(1 << 29) // 1000), 1 << 29, 1000) + bytes(1000)),  # 512 MiB declared
            *((t.update("c000"), c) for c in flood),  # partial messages: each evicts the one before
            *((t.update("c000"), c) for c in tampered),
            (t.update("c000"), good[0]),
            (t.update("c000"), good[0]),  # QoS 1 may deliver twice: a duplicate, not a second message
            (t.update("c000"), other_count[1]),  # same id, another count and hash
            *((t.update("c000"), c) for c in good[1:]),
            (
                t.update("c001"),
                encode(
                    Message(
                        UPDATE,
                        1,
                        run=run,
                        client="c001",
                        params={"num_examples": "3"},
                        tensors={"w": torch.ones(N)},
                        transport={SESSION: transport.session},
                    )
                ),
            ),
        ]
        for topic, payload in sent:
            attacker.publish(topic, payload)
        thread.join(20)
        attacker.close(wait=1)
    ex = holder["ex"]
    assert sorted(ex.replies) == ["c000", "c001"] and ex.drops == []
    categories = Counter(r.category for r in ex.rejections)
    assert categories == {
        "unknown client": 1,
        "not sampled": 1,
        "unparseable": 4,  # the malformed header, the short slice, the SHA-256 mismatch, the disagreeing chunk
        "oversize": 1,
        "duplicate": 1,
    }, ex.rejections
    assert set(categories) <= set(CATEGORIES)
    details = " | ".join(r.detail for r in ex.rejections)
    for why in ("SHA-256", "disagrees", "536,870,912 bytes", "already held"):
        assert why in details
    # Every byte that arrived is in the ledger, once; the flood left one "incomplete" entry per message it evicted.
    ups = [e for e in ex.entries if e.direction == "up"]
    assert sum(e.payload_bytes for e in ups) == sum(len(p) for _, p in sent)
    assert Counter(e.kind for e in ups)["incomplete"] == len(flood)
    # Reassembly never held more than one largest reply of the one sender that used chunks (charged twice: size and
    # one byte per chunk at most), whatever the flood.
    assert 0 < transport.reassembly_peak <= 2 * transport.max_payload + chunking.ENTRY_OVERHEAD


def test_packet_limits_parse_and_a_fleet_kit_can_be_sized_to_chunks() -> None:
    assert parse_packet_limit("auto") == "auto" and parse_packet_limit("OFF") == "off"
    assert parse_packet_limit("1MB") == 1_000_000 and parse_packet_limit("1MiB") == 1 << 20
    assert parse_packet_limit("256kB") == 256_000 and parse_packet_limit("2048") == 2048
    for bad in ("", "-1", "100", "1.5x", "nan", "inf"):
        with pytest.raises(ConfigError, match=f"max packet size '{re.escape(bad)}': use auto, off"):
            parse_packet_limit(bad)
    spec = FleetSpec("lab", ("c001",), ("b",), max_message_bytes=6_700_000, chunk_packet_size=LIMIT)
    assert spec.max_packet_size == LIMIT
    assert f"max_packet_size {LIMIT}" in mosquitto_conf(spec, Path("/etc/mosquitto/fedge")).splitlines()
    whole = dataclasses.replace(spec, chunk_packet_size=None)
    assert whole.max_packet_size > 6_700_000  # without chunks: the largest message must fit in one packet
    with pytest.raises(ConfigError, match="must be >= 1024 bytes, got 100"):
        dataclasses.replace(spec, chunk_packet_size=100)


def test_a_run_summary_records_the_limits(unchunked: RunResult) -> None:
    summary = json.loads((unchunked.path / "summary.json").read_text())
    assert summary["broker_max_packet_size"] is None and summary["reassembly_peak_bytes"] == 0
