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
from secagg_support import FramedChannel, framed
from torch import nn

from fedge.aggregation.flat import FlatLayout
from fedge.algorithms import make_strategy
from fedge.algorithms.base import CheckedReply, ServerContext, UpdateReport
from fedge.algorithms.differential_privacy import DifferentialPrivacyStrategy
from fedge.algorithms.secure_aggregation import SecureAggregationStrategy
from fedge.config import RunConfig
from fedge.errors import CodecError
from fedge.privacy.mechanism import noise_rng
from fedge.privacy.shares import NoiseFloor, client_input, share_of
from fedge.secagg.errors import MessageError, ProtocolViolation
from fedge.secagg.messages import AdvertiseKeys, SecAggMessage, ShareDelivery
from fedge.secagg.protocol import SecAggServer, Stage
from fedge.secagg.remote import (
    WEIGHT_PARAM,
    ClientParty,
    clipped_delta,
    from_message,
    layout_of,
    max_frame_bytes,
    round_config_of,
    to_message,
    weight_of,
)
from fedge.secagg.rounds import rounding_rng, simulated_dropouts
from fedge.wire import fields as wire
from fedge.wire.message import UPDATE, Message

RUN = "run"


def _config(n: int, **overrides: object) -> RunConfig:
    base: dict[str, object] = dict(algorithm="fedavg", dataset="synthetic", num_clients=n, secure_aggregation=True)
    return RunConfig(**(base | overrides))  # type: ignore[arg-type]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(5, 3)


def _strategy(config: RunConfig) -> SecureAggregationStrategy:
    strategy = make_strategy(config, ServerContext(_model, 3, RUN))
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


class LocalChannel(FramedChannel):
    """Clients' parties in this process, reached through encoded frames; ``drop_at[c]``: the stage from which c
    sends nothing; ``tamper``: replaces an answer before the server sees it."""

    def __init__(self, parties: dict[str, ClientParty], drop_at: Mapping[str, Stage], tamper: object = None) -> None:
        super().__init__(drop_at, run=RUN)
        self.parties, self.tamper = parties, tamper

    def answer(self, rnd: int, stage: Stage, client: str, frame: Message) -> SecAggMessage:
        down = from_message(frame)
        answer = self.parties[client].answer(down, weight_of(frame) if isinstance(down, ShareDelivery) else None)
        if callable(self.tamper):
            answer = self.tamper(stage, answer)
        return from_message(framed(to_message(answer, run=RUN)))


def _remote_round(
    config: RunConfig, clients: list[str], drop_at: Mapping[str, Stage], tamper: object = None
) -> tuple[SecureAggregationStrategy, dict[str, float]]:
    """Round 1 with remote parties, each rounding with the stream the in-process path gives it."""
    strategy = _strategy(config)
    updates = _updates(strategy.global_weights(), 1, clients)
    plan = strategy.configure(1, clients)
    broadcast = framed(plan.broadcast)  # type: ignore[arg-type]
    round_config = round_config_of(broadcast)
    assert round_config is not None
    layout = FlatLayout({n: (tuple(updates[clients[0]].tensors[n].shape), torch.float32) for n in layout_of(broadcast)})
    seeds = rounding_rng(config.seed, 1).integers(0, 2**63, size=len(clients))
    reference = layout.flatten(broadcast.tensors)
    parties = {
        c: ClientParty(
            round_config,
            c,
            clipped_delta(layout.flatten(updates[c].tensors), reference, round_config.plan.bound)[0],
            weighted=True,
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
        replies[c] = strategy.accept(1, c, framed(reply))
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
    assert metrics["secagg_s"] >= metrics["secagg_server_s"] >= metrics["secagg_unmask_server_s"] > 0
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
    assert from_message(framed(frame)) == keys
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
    assert weight_of(Message("secagg", 1)) is None  # an unweighted round's (DP-FedAvg's)
    assert round_config_of(Message("broadcast", 1)) is None  # a round without secure aggregation


def test_a_client_party_answers_in_order_only_and_a_weighted_round_needs_its_share() -> None:
    strategy = _strategy(_config(4, secagg_clip=0.5))
    plan = strategy.configure(1, ["a", "b", "c", "d"])
    config = round_config_of(plan.broadcast)  # type: ignore[arg-type]
    assert config is not None
    assert max_frame_bytes(config, "upload") >= 4 * config.dim
    delta, clipped = clipped_delta(np.full(config.dim, 10.0), np.zeros(config.dim), config.plan.bound)
    assert clipped and np.linalg.norm(delta) == pytest.approx(0.5)  # the ring bound is the norm bound
    with pytest.raises(ProtocolViolation):
        ClientParty(config, "a", np.zeros(config.dim + 1), weighted=True)
    parties = {c: ClientParty(config, c, delta, weighted=True) for c in config.clients}
    server = SecAggServer(config)
    for party in parties.values():
        server.receive_advertise(party.protocol.advertise())
    with pytest.raises(ProtocolViolation):  # a share delivery before the keys were shared
        parties["a"].answer(ShareDelivery(1, "a", (), ()), 0.5)
    for c, keys in server.close_advertise().items():
        server.receive_shares(parties[c].answer(keys))  # type: ignore[arg-type]
    delivery = server.close_share()["a"]
    with pytest.raises(ProtocolViolation, match="averaging share"):
        parties["a"].answer(delivery)  # a weighted round without the share: nothing is masked or sent
    assert parties["a"].answer(delivery, 0.25).client == "a"


@pytest.mark.parametrize("clip", ["0.5", "adaptive:0.5"])
def test_dp_noise_shares_added_on_the_devices_give_the_in_process_model_bit_for_bit(clip: str) -> None:
    """DP-FedAvg under secure aggregation: each remote party clips its update, appends the count bit (adaptive
    clipping) and adds its share of the noise before masking; with the in-process path's noise and rounding streams
    the model (and the next clip) is the in-process one, bit for bit, with a client vanishing after sharing keys."""
    config = _config(100, dp_noise_multiplier=1.0, dp_clip=clip, dp_noise_seed=5, client_fraction=0.2, seed=2)
    clients = [f"c{i}" for i in range(6)]
    drop_at: dict[str, Stage] = {"c4": "upload"}
    strategies: dict[bool, DifferentialPrivacyStrategy] = {}
    for remote in (False, True):
        strategy = make_strategy(config, ServerContext(_model, 3, RUN))
        assert isinstance(strategy, DifferentialPrivacyStrategy)
        weights = strategy.global_weights()
        assert weights is not None
        updates = _updates(weights, 1, clients)
        if remote:
            strategy.use_channel(LocalChannel({}, drop_at))
        plan = strategy.configure(1, clients)
        if not remote:
            assert "dp.clip" not in plan.broadcast.params  # type: ignore[union-attr]  # in process: nothing to send
            inputs = {c: updates[c] for c in clients}
            with pytest.MonkeyPatch.context() as patch:  # the in-process protocol loses c4 at the same stage
                patch.setattr("fedge.algorithms.differential_privacy.simulated_dropouts", lambda *a: dict(drop_at))
                strategy.aggregate(1, {c: strategy.accept(1, c, inputs[c]) for c in clients})
            strategies[remote] = strategy
            continue
        broadcast = framed(plan.broadcast)  # type: ignore[arg-type]
        round_config, share = round_config_of(broadcast), share_of(broadcast.params)
        assert round_config is not None and share is not None and share.count == clip.startswith("adaptive")
        floor = NoiseFloor.of_config(config)  # what a device provisioned for this run accepts: the honest share passes
        assert floor is not None
        floor.check(share, len(round_config.index))
        with pytest.raises(CodecError, match="less than"):
            floor.check(dataclasses.replace(share, noise_std=share.noise_std / 2), len(round_config.index))
        layout = FlatLayout({n: (tuple(updates["c0"].tensors[n].shape), torch.float32) for n in layout_of(broadcast)})
        reference = layout.flatten(broadcast.tensors)
        noise = noise_rng(5, 1)  # the in-process stream: each client's draw in id order
        seeds = rounding_rng(config.seed, 1).integers(0, 2**63, size=len(clients))
        channel = strategy._remote
        assert isinstance(channel, LocalChannel)
        for c, s in zip(clients, seeds, strict=True):
            vector = client_input(layout.flatten(updates[c].tensors), reference, share, noise)
            channel.parties[c] = ClientParty(round_config, c, vector, weighted=False, rng=np.random.default_rng(int(s)))
        replies = {}
        for c in clients:
            reply = to_message(channel.parties[c].advertise(), run=RUN, kind=UPDATE, params=updates[c].params)
            replies[c] = strategy.accept(1, c, framed(reply))
        metrics = strategy.aggregate(1, replies)
        assert metrics["dp_survivors"] == 5 and strategy.last is None  # the coordinator knows no client's noise
        strategies[remote] = strategy
    a, b = strategies[True].global_weights(), strategies[False].global_weights()
    assert a is not None and b is not None and all(torch.equal(a[k], b[k]) for k in a)
    assert strategies[True].clip == strategies[False].clip
