"""Pure parts of the MQTT deployment: topics, broker URLs, status messages, wire-byte formulas, client data files."""

from __future__ import annotations

import pytest
import torch
from amqtt.mqtt.publish import PublishPacket
from amqtt.mqtt.subscribe import SubscribePacket

from edge_client.data import ClientDataInfo, load_client_data, save_client_data, save_shared_data
from fedge.algorithms.base import ClientData
from fedge.errors import CodecError, ConfigError, DatasetError
from fedge.wire.message import TASK, Message, encode
from fedge.wire.protocol import (
    BrokerAddress,
    ClientStatus,
    Topics,
    connect_packet_bytes,
    decode_status,
    delivery_wire_bytes,
    encode_status,
    error_message,
    publish_packet_bytes,
    subscribe_packet_bytes,
    varint_size,
)


def test_topics_build_and_parse() -> None:
    t = Topics("lab1")
    assert t.task("c003") == "fedge/lab1/task/c003"
    assert t.broadcast == "fedge/lab1/broadcast"
    assert t.update("c003") == "fedge/lab1/update/c003"
    assert t.status("c003") == "fedge/lab1/status/c003"
    assert t.all_updates == "fedge/lab1/update/+"
    assert t.parse("fedge/lab1/update/c003") == ("update", "c003")
    assert t.parse("fedge/lab1/broadcast") == ("broadcast", None)
    with pytest.raises(CodecError, match="'fedge/lab2/update/c003' is not under 'fedge/lab1/'"):
        t.parse("fedge/lab2/update/c003")
    for bad in ("fedge/lab1/update", "fedge/lab1/update/a/b", "fedge/lab1/other/c1"):
        with pytest.raises(
            CodecError, match=r"is not a fedge topic \(expected fedge/lab1/task\|update\|status/<client>\)"
        ):
            t.parse(bad)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("", "must not be empty"),
        ("a/b", r"contains \['/'\]"),
        ("a+b", r"contains \['\+'\]"),
        ("#", r"contains \['#'\]"),
        ("$SYS", "must not start with '\\$'"),
        ("x" * 129, "longer than 128 bytes"),
    ],
)
def test_names_that_cannot_be_a_topic_level_are_refused(name: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        Topics(name)


def test_broker_address_parsing() -> None:
    assert BrokerAddress.parse("mqtt://10.0.0.5:1884") == BrokerAddress("10.0.0.5", 1884)
    assert BrokerAddress.parse("localhost") == BrokerAddress("localhost", 1883)
    assert BrokerAddress.parse("tcp://h:7").url == "mqtt://h:7"
    assert BrokerAddress.parse("mqtts://h").port == 8883  # TLS, default port
    for bad, says in (
        ("http://h", "must look like mqtt://"),
        ("mqtt://:1883", "lacks a host"),
        ("mqtt://h:99999", "invalid port"),
    ):
        with pytest.raises(ConfigError, match=says):
            BrokerAddress.parse(bad)


def test_status_round_trip() -> None:
    hello = ClientStatus(
        client="c001",
        state="online",
        runtime="torch",
        device="cuda:0",
        dataset_size=600,
        model="dsfl_mnist_cnn",
        input_shape=(1, 28, 28),
        num_classes=10,
        open_size=20000,
        capabilities=("dsfl", "fedavg"),
        extra={"host": "jetson-07"},
    )
    assert decode_status(encode_status(hello, "lab")) == hello
    will = ClientStatus(client="c001", state="offline", reason="connection lost")
    assert decode_status(encode_status(will, "lab")) == will
    with pytest.raises(CodecError, match="expected a 'status' message, got 'task'"):
        decode_status(encode(Message(TASK, 1, run="lab", client="c001")))
    with pytest.raises(CodecError, match=r"header length \d+ exceeds the payload"):
        decode_status(b"\x00garbage")


def test_error_message_answers_its_task() -> None:
    task = Message(TASK, 4, run="lab", client="c2")
    err = error_message(task, "no open set")
    assert (err.kind, err.round, err.run, err.client, err.params["error"]) == ("error", 4, "lab", "c2", "no open set")


@pytest.mark.parametrize("n,size", [(0, 1), (127, 1), (128, 2), (16_383, 2), (16_384, 3), (2_097_152, 4)])
def test_varint_size(n: int, size: int) -> None:
    assert varint_size(n) == size


@pytest.mark.parametrize("payload", [0, 5, 120, 130, 20_000, 3_000_000])
@pytest.mark.parametrize("qos", [0, 1])
def test_publish_size_matches_an_independent_encoder(payload: int, qos: int) -> None:
    topic = "fedge/run-ä/update/c001"  # non-ASCII: lengths are UTF-8 bytes
    packet = PublishPacket.build(topic, b"x" * payload, 7 if qos else None, False, qos, False)
    assert publish_packet_bytes(topic, payload, qos) == len(packet.to_bytes())


def test_subscribe_size_matches_an_independent_encoder() -> None:
    filters = ["fedge/r/task/c001", "fedge/r/broadcast"]
    assert subscribe_packet_bytes(filters) == len(SubscribePacket.build([(f, 1) for f in filters], 3).to_bytes())


def test_connect_and_delivery_arithmetic() -> None:
    # CONNECT of client id "x", no will: 10-byte variable header + 3-byte id, 2-byte fixed header.
    assert connect_packet_bytes("x") == 15
    assert connect_packet_bytes("x", will_topic="w", will_payload_bytes=4) == 15 + 3 + 6
    # A QoS-1 publish of 100 bytes on "t" to 3 subscribers: 4 PUBLISH packets and 4 PUBACKs.
    one = 1 + 1 + (2 + 1 + 2 + 100)
    assert delivery_wire_bytes("t", 100, subscribers=3) == 4 * (one + 4)
    assert delivery_wire_bytes("t", 100, subscribers=0, qos=0) == one - 2


def test_client_data_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    shared_part = ClientData(
        x=torch.zeros(0, 1, 4, 4), y=torch.zeros(0, dtype=torch.long), num_classes=3, open_x=torch.rand(9, 1, 4, 4)
    )
    shared = save_shared_data(tmp_path / "shared.safetensors", shared_part)
    data = ClientData(
        x=torch.rand(5, 1, 4, 4, generator=g), y=torch.tensor([0, 1, 2, 1, 0]), num_classes=3, open_x=shared_part.open_x
    )
    info = ClientDataInfo(client="c007", model="tiny_mlp", input_shape=(1, 4, 4), num_classes=3)
    path = save_client_data(tmp_path / "c007.safetensors", data, info, shared=shared)
    loaded, loaded_info = load_client_data(path)
    assert loaded_info == info
    assert torch.equal(loaded.x, data.x) and torch.equal(loaded.y, data.y)
    assert loaded.open_x is not None and torch.equal(loaded.open_x, shared_part.open_x)
    assert loaded.eval_x is None

    shared.unlink()
    with pytest.raises(DatasetError, match="shared data file"):
        load_client_data(path)
    with pytest.raises(DatasetError, match="does not exist"):
        load_client_data(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(DatasetError, match=r"junk\.safetensors is not a safetensors file"):
        load_client_data(tmp_path / "junk.safetensors")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1790000000.250", 1790000000.25),
        (None, None),
        ("soon", None),
        ("nan", None),
        ("inf", None),
        ("-1", None),
        ("1e12", None),
        ("9" * 40, None),
    ],
)
def test_a_tasks_deadline_is_read_only_when_it_is_a_plausible_unix_time(value, expected) -> None:
    from fedge.wire.protocol import DEADLINE, task_deadline

    transport = {} if value is None else {DEADLINE: value}
    assert task_deadline(Message(TASK, 1, run="r", client="c", transport=transport)) == expected
