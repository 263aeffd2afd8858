"""Secure aggregation with the parties apart: the server's side driven over a :class:`StageChannel`, each client's
party on its own (:class:`ClientParty`), every message framed and encoded as it would travel over MQTT. With the
same rounding streams it gives the in-process model bit for bit, dropouts included; hostile answers and frames are
refused without stopping the round."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import pytest
import torch
from torch import nn

from fedge.accounting.ledger import LedgerEntry
from fedge.aggregation.flat import FlatLayout
from fedge.algorithms import make_strategy
from fedge.algorithms.base import CheckedReply, ServerContext, UpdateReport
from fedge.config import RunConfig
from fedge.secagg.config import RoundConfig
from fedge.secagg.errors import MessageError, ProtocolViolation
from fedge.secagg.messages import AdvertiseKeys, SecAggMessage, ShareDelivery
from fedge.secagg.protocol import STAGES, Stage
from fedge.secagg.remote import (
    WEIGHT_PARAM,
    ClientParty,
    from_message,
    layout_of,
    max_frame_bytes,
    round_config_of,
    to_message,
    weight_of,
)
from fedge.secagg.strategy import SecureAggregationStrategy, rounding_rng, simulated_dropouts
from fedge.wire import fields as wire
from fedge.wire.message import UPDATE, Message, decode, encode

RUN = "run"


def _config(n: int, **overrides: object) -> RunConfig:
    base: dict[str, object] = dict(algorithm="fedavg", dataset="synthetic", num_clients=n, secure_aggregation=True)
    return RunConfig(**(base | overrides))  # type: ignore[arg-type]


def _strategy(config: RunConfig) -> SecureAggregationStrategy:
    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Linear(5, 3)

    strategy = make_strategy(config, ServerContext(model, 3, RUN))
    assert isinstance(strategy, SecureAggregationStrategy)
    return strategy


def _updates(weights: Mapping[str, torch.Tensor], rnd: int, clients: list[str]) -> dict[str, Message]:
    """Each client's update: the global weights moved by a random step, data size 10 + 7 i, loss i."""
    gen = torch.Generator().manual_seed(rnd)
    out = {}
    for i, c in enumerate(clients):
        tensors = {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
        params = wire.to_params(UpdateReport(num_examples=10 + 7 * i, loss=float(i)))
        out[c] = Message(UPDATE, rnd, run=RUN, client=c, params=params, tensors=tensors)
    return out


def _wire(frame: Message) -> Message:
    return decode(encode(frame))  # what the broker carries: fedge's safetensors frame


class LocalChannel:
    """Clients' parties in this process, reached through encoded frames; ``drop_at[c]``: the stage from which c
    sends nothing; ``tamper``: replaces an answer before the server sees it."""

    def __init__(self, parties: dict[str, ClientParty], drop_at: Mapping[str, Stage], tamper: object = None) -> None:
        self.parties, self.drop_at, self.tamper = parties, drop_at, tamper
        self.entries: list[LedgerEntry] = []

    def stage(
        self,
        rnd: int,
        config: RoundConfig,
        stage: Stage,
        messages: Mapping[str, SecAggMessage],
        params: Mapping[str, Mapping[str, str]],
    ) -> list[SecAggMessage]:
        answers = []
        for c, message in messages.items():
            frame = _wire(to_message(message, run=RUN, params=params.get(c, {})))
            self.entries.append(LedgerEntry(rnd, "down", c, message.KIND, 1, frame.tensor_bytes, len(encode(frame))))
            if c in self.drop_at and STAGES.index(self.drop_at[c]) <= STAGES.index(stage):
                continue
            down = from_message(frame)
            answer = self.parties[c].answer(down, weight_of(frame) if isinstance(down, ShareDelivery) else None)
            if callable(self.tamper):
                answer = self.tamper(stage, answer)
            answers.append(from_message(_wire(to_message(answer, run=RUN))))
        return answers

    def take_record(self, rnd: int) -> tuple[list[LedgerEntry], dict[str, str]]:
        gone = {c: f"vanished at stage {s!r}" for c, s in self.drop_at.items()}
        entries, self.entries = self.entries, []
        return entries, gone


def _remote_round(
    config: RunConfig, clients: list[str], drop_at: Mapping[str, Stage], tamper: object = None
) -> tuple[SecureAggregationStrategy, dict[str, float]]:
    """Round 1 with remote parties, each rounding with the stream the in-process path gives it."""
    strategy = _strategy(config)
    updates = _updates(strategy.global_weights(), 1, clients)
    plan = strategy.configure(1, clients)
    broadcast = _wire(plan.broadcast)  # type: ignore[arg-type]
    round_config = round_config_of(broadcast)
    assert round_config is not None
    layout = FlatLayout({n: (tuple(updates[clients[0]].tensors[n].shape), torch.float32) for n in layout_of(broadcast)})
    seeds = rounding_rng(config.seed, 1).integers(0, 2**63, size=len(clients))
    parties = {
        c: ClientParty(
            round_config,
            c,
            layout.flatten(updates[c].tensors),
            layout.flatten(broadcast.tensors),
            rng=np.random.default_rng(int(s)),
        )
        for c, s in zip(sorted(clients), seeds, strict=True)
    }
    strategy.use_channel(LocalChannel(parties, drop_at, tamper))
    replies: dict[str, CheckedReply] = {}
    for c in clients:
        if drop_at.get(c) == "advertise":
            continue
        reply = to_message(parties[c].advertise(), run=RUN, kind=UPDATE, params=updates[c].params)
        replies[c] = strategy.accept(1, c, _wire(reply))
    return strategy, strategy.aggregate(1, replies)


def _inprocess_round(config: RunConfig, clients: list[str]) -> SecureAggregationStrategy:
    strategy = _strategy(config)
    updates = _updates(strategy.global_weights(), 1, clients)
    strategy.configure(1, clients)
    strategy.aggregate(1, {c: strategy.accept(1, c, updates[c]) for c in clients})
    return strategy


@pytest.mark.parametrize("dropouts", [0.0, 0.3])
def test_remote_parties_give_the_in_process_model_bit_for_bit(dropouts: float) -> None:
    config = _config(10, secagg_clip=0.5, simulate_dropouts=dropouts, seed=3)
    clients = [f"c{i}" for i in range(10)]
    drop_at = simulated_dropouts(clients, dropouts, config.seed, 1)
    remote, metrics = _remote_round(config, clients, drop_at)
    local = _inprocess_round(config, clients)
    a, b = remote.global_weights(), local.global_weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert local.last is not None and metrics["secagg_survivors"] == len(local.last.result.survivors)
    record = remote.aggregation_record(1)
    assert not record.abandoned
    assert {d.client for d in record.drops} == {c for c, s in drop_at.items() if s in ("share", "upload")}
    kinds = {e.kind for e in record.entries}
    assert {"secagg.neighbour-keys", "secagg.share-delivery", "secagg.unmask-request"} <= kinds
    if dropouts:
        assert any(s == "upload" for s in drop_at.values())  # someone is unmasked from its neighbours' shares


def test_a_wrong_answer_is_refused_and_its_sender_left_out_of_the_sum() -> None:
    config = _config(8, secagg_clip=0.5)
    clients = [f"c{i}" for i in range(8)]
    liar_keys = AdvertiseKeys(1, "c3", b"\x01" * 32, b"\x02" * 32)

    def tamper(stage: Stage, answer: SecAggMessage) -> SecAggMessage:
        return liar_keys if stage == "share" and answer.client == "c3" else answer

    strategy, metrics = _remote_round(config, clients, {}, tamper)
    assert metrics["secagg_survivors"] == 7
    assert [d.client for d in strategy.aggregation_record(1).drops] == ["c3"]


def test_frames_are_checked_before_the_protocol_sees_them() -> None:
    keys = AdvertiseKeys(2, "c1", b"\x01" * 32, b"\x02" * 32)
    frame = to_message(keys, run=RUN)
    assert from_message(_wire(frame)) == keys
    with pytest.raises(MessageError, match="only secagg"):
        from_message(dataclasses.replace(frame, tensors={**frame.tensors, "w": torch.zeros(1)}))
    with pytest.raises(MessageError, match="the frame is for"):
        from_message(dataclasses.replace(frame, client="c2"))
    with pytest.raises(MessageError):
        from_message(dataclasses.replace(frame, tensors={"secagg.c_public": torch.zeros(31, dtype=torch.uint8)}))
    for bad in ("0", "1.5", "nan", "-0.1", "x"):
        with pytest.raises(MessageError):
            weight_of(Message("secagg", 1, params={WEIGHT_PARAM: bad}))
    assert weight_of(Message("secagg", 1, params={WEIGHT_PARAM: "0.25"})) == 0.25
    assert round_config_of(Message("broadcast", 1)) is None  # a round without secure aggregation


def test_a_client_party_clips_its_own_update_and_answers_in_order_only() -> None:
    strategy = _strategy(_config(4, secagg_clip=0.5))
    plan = strategy.configure(1, ["a", "b", "c", "d"])
    config = round_config_of(plan.broadcast)  # type: ignore[arg-type]
    assert config is not None
    assert max_frame_bytes(config, "upload") >= 4 * config.dim
    reference = np.zeros(config.dim)
    party = ClientParty(config, "a", np.full(config.dim, 10.0), reference)
    assert party.clipped and np.linalg.norm(party.delta) == pytest.approx(0.5)  # the ring bound is the norm bound
    with pytest.raises(ProtocolViolation):
        ClientParty(config, "a", np.zeros(config.dim + 1), np.zeros(config.dim + 1))
    party.advertise()
    with pytest.raises(ProtocolViolation):  # a share delivery before the keys were shared
        party.answer(ShareDelivery(1, "a", (), ()), 0.5)
