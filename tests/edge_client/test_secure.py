"""The device's party of a secure round (edge_client/secure.py), without a broker: a reply that carries keys and the
report instead of the update, answers only to the round in flight, and refusals of broadcasts that do not fit."""

from __future__ import annotations

import dataclasses
from typing import cast

import pytest
import torch
from torch import nn

from edge_client.secure import SecureRounds
from fedge.algorithms import make_strategy
from fedge.algorithms.base import ServerContext, UpdateReport
from fedge.config import RunConfig
from fedge.errors import CodecError
from fedge.secagg.protocol import SecAggServer
from fedge.secagg.remote import from_message, round_config_of, to_message
from fedge.wire import fields as wire
from fedge.wire.message import UPDATE, Message, decode, encode
from fedge.wire.protocol import SESSION

RUN = "run"


def _round(secure: bool = True) -> tuple[Message, dict[str, Message], dict[str, Message]]:
    config = RunConfig(algorithm="fedavg", dataset="synthetic", num_clients=3, secure_aggregation=secure)

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Linear(4, 2)

    strategy = make_strategy(config, ServerContext(model, 2, RUN))
    plan = strategy.configure(1, ["a", "b", "c"])
    assert plan.broadcast is not None
    stamp = {SESSION: "s1"}
    broadcast = decode(encode(dataclasses.replace(plan.broadcast, transport=stamp)))
    tasks = {c: dataclasses.replace(t, transport=stamp) for c, t in plan.tasks.items()}
    params = wire.to_params(UpdateReport(num_examples=5, loss=0.5))
    moved = {k: v + 0.01 for k, v in broadcast.tensors.items()}
    updates = {c: Message(UPDATE, 1, run=RUN, client=c, params=params, tensors=moved) for c in tasks}
    return broadcast, tasks, updates


def test_the_reply_carries_fresh_keys_and_the_report_never_the_update() -> None:
    broadcast, tasks, updates = _round()
    rounds = SecureRounds("a")
    reply = rounds.reply(tasks["a"], broadcast, updates["a"])
    assert reply is not None and reply.kind == UPDATE and reply.params["num_examples"] == "5"
    assert set(reply.tensors) == {"secagg.c_public", "secagg.s_public"}  # keys only
    again = SecureRounds("a").reply(tasks["a"], broadcast, updates["a"])
    assert again is not None and not torch.equal(again.tensors["secagg.c_public"], reply.tensors["secagg.c_public"])
    plain_broadcast, plain_tasks, plain_updates = _round(secure=False)
    assert SecureRounds("a").reply(plain_tasks["a"], plain_broadcast, plain_updates["a"]) is None


def test_it_answers_the_round_in_flight_only() -> None:
    broadcast, tasks, updates = _round()
    config = round_config_of(broadcast)
    assert config is not None
    parties = {c: SecureRounds(c) for c in tasks}
    server = SecAggServer(config)
    for c, party in parties.items():
        reply = party.reply(tasks[c], broadcast, updates[c])
        assert reply is not None
        server.receive_advertise(from_message(reply))  # type: ignore[arg-type]
    keys = server.close_advertise()
    frame = dataclasses.replace(to_message(keys["a"], run=RUN), transport={SESSION: "s1"})
    assert parties["a"].answer(dataclasses.replace(frame, transport={SESSION: "s0"})) is None  # an old session's
    answer = parties["a"].answer(frame)
    assert answer is not None and from_message(answer).KIND == "secagg.encrypted-shares"
    assert parties["a"].answer(frame) is None  # asked twice: the protocol refuses, nothing is sent
    parties["a"].forget()  # a new coordinator session
    assert parties["a"].answer(frame) is None


def test_a_broadcast_that_does_not_fit_the_update_is_refused() -> None:
    broadcast, tasks, updates = _round()
    wrong_layout = dataclasses.replace(broadcast, params={**broadcast.params, "secagg.layout": "weight,nope"})
    with pytest.raises(CodecError, match="does not exchange"):
        SecureRounds("a").reply(tasks["a"], wrong_layout, updates["a"])
    with pytest.raises(CodecError, match="cohort does not include"):
        SecureRounds("z").reply(dataclasses.replace(tasks["a"], client="z"), broadcast, updates["a"])
    bad_seed = dataclasses.replace(broadcast, params={**broadcast.params, "secagg.round_seed": "zz"})
    with pytest.raises(CodecError, match="malformed"):
        SecureRounds("a").reply(tasks["a"], bad_seed, updates["a"])


def test_a_device_provisioned_for_dp_refuses_a_round_that_asks_for_less_noise() -> None:
    """The broadcast says how much noise each client adds; a device whose config.json names the noise multiplier
    refuses less than an honest coordinator ever asks (z C / sqrt(cohort)), and a secure round without noise at all;
    the honest coordinator's own broadcast passes."""
    from fedge.privacy.shares import NoiseFloor, share_of, share_params
    from fedge.secagg.remote import StageChannel

    dp = RunConfig(
        algorithm="fedavg", dataset="synthetic", num_clients=3, dp_noise_multiplier=1.0, dp_clip="1.0",
        secure_aggregation=True,
    )  # fmt: skip
    floor = NoiseFloor.of_config(dp)
    assert floor == NoiseFloor(1.0, 3.0, adaptive=False)
    assert NoiseFloor.of_config(RunConfig(dataset="synthetic")) is None
    torch.manual_seed(0)
    strategy = make_strategy(dp, ServerContext(lambda: nn.Linear(4, 2), 2, RUN))
    strategy.use_channel(cast(StageChannel, object()))  # type: ignore[attr-defined]  # a deployment's broadcast
    plan = strategy.configure(1, ["a", "b", "c"])
    assert plan.broadcast is not None
    stamp = {SESSION: "s1"}
    broadcast = decode(encode(dataclasses.replace(plan.broadcast, transport=stamp)))
    task = dataclasses.replace(plan.tasks["a"], transport=stamp)
    update = Message(UPDATE, 1, run=RUN, client="a", params=wire.to_params(UpdateReport(num_examples=5, loss=0.5)),
                     tensors={k: v + 0.01 for k, v in broadcast.tensors.items()})  # fmt: skip
    honest = share_of(broadcast.params)
    assert honest is not None and honest.noise_std >= 1 / 3**0.5  # z C / sqrt(t), t <= 3
    assert SecureRounds("a", noise_floor=floor).reply(task, broadcast, update) is not None

    def asked(noise: float) -> Message:
        share = dataclasses.replace(honest, noise_std=noise)
        return dataclasses.replace(broadcast, params={**broadcast.params, **share_params(share)})

    # Cohort of 3, clip 1: the floor is 1 x 1 / sqrt(3) = 0.577 per value.
    assert SecureRounds("a", noise_floor=floor).reply(task, asked(0.6), update) is not None
    with pytest.raises(CodecError, match=r"less than the 0\.57735"):
        SecureRounds("a", noise_floor=floor).reply(task, asked(0.5), update)
    without = dataclasses.replace(
        broadcast, params={k: v for k, v in broadcast.params.items() if not k.startswith("dp.")}
    )
    with pytest.raises(CodecError, match="asks for no noise"):
        SecureRounds("a", noise_floor=floor).reply(task, without, update)
    assert SecureRounds("a").reply(task, asked(0.0), update) is not None  # no config to say: taken as asked
