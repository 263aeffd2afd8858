"""Secure aggregation's stage channel over a real mosquitto, with hand-written clients: it takes one valid answer
from each client it asked, and refuses (counting each) an answer of another coordinator session, a frame larger than
the stage allows, a message from a client it did not ask and a second answer; a client that never answers is named
with the stage's deadline."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from mqtt_support import FakeClient, fake_clients, mosquitto_url  # noqa: F401 - pytest fixtures

from coordinator.mqtt import MqttTransport
from coordinator.secagg_stages import MqttStages
from fedge.secagg.config import RoundConfig
from fedge.secagg.messages import MaskedInput, SecAggMessage
from fedge.secagg.protocol import SecAggClient, SecAggServer
from fedge.secagg.remote import SECAGG, from_message, to_message
from fedge.wire import chunking
from fedge.wire.message import decode, encode
from fedge.wire.protocol import SESSION, BrokerAddress

pytestmark = pytest.mark.broker

RUN = "stages"


def test_a_stage_takes_one_valid_answer_per_client_asked_and_refuses_the_rest(
    mosquitto_url: str,  # noqa: F811
    fake_clients: Callable[..., FakeClient],  # noqa: F811
) -> None:
    clients = ["a", "b", "c"]
    fakes = {c: fake_clients(mosquitto_url, RUN, c) for c in [*clients, "d"]}
    transport = MqttTransport(BrokerAddress.parse(mosquitto_url), RUN, round_timeout=10, rejoin_grace=0.5)
    with transport:
        transport.wait_for_clients(4, 10)
        config = RoundConfig.new(run=RUN, session="s", round=1, clients=clients, round_seed=bytes(32), dim=4, bound=1.0)
        parties = {c: SecAggClient(config, c) for c in clients}
        server = SecAggServer(config)
        for c in clients:
            server.receive_advertise(parties[c].advertise())
        keys = server.close_advertise()
        shares = {c: parties[c].share_keys(keys[c]) for c in clients}

        def send(sender: str, frame_of: str, session: str = transport.session, pad: int = 0, chunks: int = 1) -> None:
            frame = to_message(shares[frame_of], run=RUN, params={"pad": "x" * pad} if pad else None)
            payload = encode(dataclasses.replace(frame, transport={SESSION: session}))
            topic = fakes[sender].topics.update(sender)
            parts = chunking.split(payload, len(payload) // chunks + 64, 7) if chunks > 1 else [payload]
            for part in parts:
                fakes[sender].link.publish(topic, part, qos=1)

        send("a", "a", session="an-old-session")  # another coordinator's
        send("a", "a")
        send("b", "b", pad=200_000)  # larger than stage 'share' allows: refused unread
        send("d", "a")  # not asked
        send("c", "c", chunks=3)  # in chunks, as a large upload travels
        send("c", "c")  # a second answer
        stages = MqttStages(transport, stage_timeout=3)
        answers = stages.stage(1, config, "share", keys, {})
        entries, gone = stages.take_record(1)
    assert [m.client for m in answers] == ["a", "c"]
    assert answers[0] == shares["a"] and answers[1] == shares["c"]
    assert gone == {"b": "silent past the 3 s deadline of stage 'share'"}
    down = [e for e in entries if e.direction == "down"]
    assert sorted(e.client for e in down) == clients and all(e.wire_bytes > e.payload_bytes for e in down)
    up = [e for e in entries if e.direction == "up"]
    chunked = next(e for e in up if e.client == "c" and e.kind == "secagg.encrypted-shares")
    assert chunked.payload_bytes > len(encode(to_message(shares["c"], run=RUN)))  # all three chunks, headers too
    refused = sorted((e.client, e.kind) for e in up if not e.kind.startswith("secagg"))
    assert refused == [("a", "invalid"), ("b", "oversize"), ("c", "invalid"), ("d", "invalid")]
    assert sorted(e.client for e in entries if e.kind == "secagg.encrypted-shares") == ["a", "c"]
    # What a client got on its task topic: its neighbours' keys, framed and stamped with the session.
    got = decode(fakes["a"].next(SECAGG).payload)
    assert got.transport[SESSION] == transport.session and from_message(got) == keys["a"]


def test_an_earlier_stages_answer_sent_again_does_not_take_the_clients_turn(
    mosquitto_url: str,  # noqa: F811
    fake_clients: Callable[..., FakeClient],  # noqa: F811
) -> None:
    # A client that reconnects sends its latest reply again (edge_client's _resend_latest): during the upload stage
    # that is its share-stage answer. Refused and counted, it must not stand for the upload the client then sends.
    clients = ["a", "b", "c"]
    fakes = {c: fake_clients(mosquitto_url, RUN, c) for c in clients}
    transport = MqttTransport(BrokerAddress.parse(mosquitto_url), RUN, round_timeout=10, rejoin_grace=0.5)
    with transport:
        transport.wait_for_clients(3, 10)
        config = RoundConfig.new(run=RUN, session="s", round=1, clients=clients, round_seed=bytes(32), dim=4, bound=1.0)
        parties = {c: SecAggClient(config, c) for c in clients}
        server = SecAggServer(config)
        for c in clients:
            server.receive_advertise(parties[c].advertise())
        keys = server.close_advertise()
        shares = {c: parties[c].share_keys(keys[c]) for c in clients}
        for c in clients:
            server.receive_shares(shares[c])
        deliveries = server.close_share()
        masked = {c: parties[c].masked_input(deliveries[c], [0.1, 0.2, 0.3, 0.4]) for c in clients}

        def send(sender: str, message: SecAggMessage) -> None:
            frame = dataclasses.replace(to_message(message, run=RUN), transport={SESSION: transport.session})
            fakes[sender].link.publish(fakes[sender].topics.update(sender), encode(frame), qos=1)

        send("a", shares["a"])  # the share stage's answer again
        for c in clients:
            send(c, masked[c])
        stages = MqttStages(transport, stage_timeout=3)
        answers = stages.stage(1, config, "upload", deliveries, {})
        entries, gone = stages.take_record(1)
    assert [m.client for m in answers] == clients
    assert all(isinstance(m, MaskedInput) and (m.masked == masked[m.client].masked).all() for m in answers)
    assert gone == {}
    refused = [(e.client, e.kind) for e in entries if e.direction == "up" and not e.kind.startswith("secagg")]
    assert refused == [("a", "invalid")]


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_frame_whose_tensor_dtype_numpy_or_isfinite_cannot_read_is_refused_not_raised(
    mosquitto_url: str,  # noqa: F811
    fake_clients: Callable[..., FakeClient],  # noqa: F811
    dtype: str,
) -> None:
    import torch

    clients = ["a", "b", "c"]
    fakes = {c: fake_clients(mosquitto_url, RUN, c) for c in clients}
    transport = MqttTransport(BrokerAddress.parse(mosquitto_url), RUN, round_timeout=10, rejoin_grace=0.5)
    with transport:
        transport.wait_for_clients(3, 10)
        config = RoundConfig.new(run=RUN, session="s", round=1, clients=clients, round_seed=bytes(32), dim=4, bound=1.0)
        parties = {c: SecAggClient(config, c) for c in clients}
        server = SecAggServer(config)
        for c in clients:
            server.receive_advertise(parties[c].advertise())
        keys = server.close_advertise()
        shares = {c: parties[c].share_keys(keys[c]) for c in clients}
        for c in clients:
            frame = dataclasses.replace(to_message(shares[c], run=RUN), transport={SESSION: transport.session})
            if c == "a":  # its arrays in a dtype the parsers choke on (numpy has no bfloat16; isfinite no float8)
                odd = {k: torch.zeros(4).to(getattr(torch, dtype)) for k in frame.tensors}
                frame = dataclasses.replace(frame, tensors=odd)
            fakes[c].link.publish(fakes[c].topics.update(c), encode(frame), qos=1)
        stages = MqttStages(transport, stage_timeout=2)
        answers = stages.stage(1, config, "share", keys, {})
        entries, gone = stages.take_record(1)
    assert [m.client for m in answers] == ["b", "c"]
    assert [(e.client, e.kind) for e in entries if e.direction == "up" and e.kind == "invalid"] == [("a", "invalid")]
    assert gone == {"a": "silent past the 2 s deadline of stage 'share'"}
