"""Secure aggregation of the algorithms whose server needs more than one weighted mean (fedge/secagg/parts.py):
SCAFFOLD (the weights' mean and the control deltas' sum), FedNova (each client's move scaled by its own step count)
and FedDyn (the mean and the plain sum of the moves). On hand-built rounds, with clients vanishing at every stage,
the secure result equals the plaintext algorithm's aggregate over the survivors within the fixed-point bound: each
client's stochastic rounding is off by less than one code 2^-frac_bits (frac_bits from the ring plan: clip bound C
and cohort N in a 32-bit ring), so a part's sum is off by less than |U3| 2^-frac_bits per value, its mean by that
over sum_{U3} s_k. The parties apart, as devices run them (edge_client/secure.py), give the same."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import pytest
import torch
from secagg_support import DeviceChannel
from torch import nn

from edge_client.secure import SecureRounds
from fedge.algorithms import make_strategy
from fedge.algorithms.base import CheckedReply, ServerContext, Strategy
from fedge.algorithms.dsfl import DSFLSettings
from fedge.algorithms.fednova import FedNova, FedNovaReport
from fedge.algorithms.secure_aggregation import SecureAggregationStrategy
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.secagg.errors import MessageError, SecAggConfigError
from fedge.secagg.messages import MaskedInput
from fedge.secagg.parts import PARTS_PARAM, PartLayout, SecurePart, parse_parts
from fedge.secagg.protocol import Stage
from fedge.wire import fields as wire
from fedge.wire.message import UPDATE, Message, decode, encode

RUN = "run"
N = 10
CLIENTS = [f"c{i}" for i in range(N)]
CLIP = 4.0  # above every part's norm below: nothing is clipped, so the plaintext aggregate is the reference


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(5, 3)


OPEN_X = torch.randn(40, 5, generator=torch.Generator().manual_seed(1))  # DS-FL's open set
DSFL = DSFLSettings(open_per_round=8, distill_epochs=1)


def _configs(algorithm: str, **overrides: object) -> tuple[RunConfig, RunConfig]:
    """The secure run's config and the plaintext one's (the same but for secure aggregation; the server's
    update-norm check off in both, as secure aggregation turns it off)."""
    base: dict[str, object] = dict(
        algorithm=algorithm, dataset="synthetic", num_clients=N, secure_aggregation=True, secagg_clip=CLIP, seed=3
    )
    secure = RunConfig(**(base | overrides))  # type: ignore[arg-type]
    plain = dataclasses.replace(secure, secure_aggregation=False, simulate_dropouts=0.0)
    return secure, plain


def _updates(strategy: Strategy | SecureAggregationStrategy, rnd: int, scale: float = 1.0) -> dict[str, Message]:
    """Each client's reply: the global weights moved by a random step, any other tensor (SCAFFOLD's control delta)
    random, ``scale`` times larger (DS-FL's soft labels: random probability rows); data size 60 + 40 i, loss i, and
    (FedNova) 1 + i mod 6 local steps."""
    gen = torch.Generator().manual_seed(rnd)
    weights = strategy.global_weights()
    assert weights is not None
    out = {}
    for i, c in enumerate(CLIENTS):
        tensors = {
            k: weights[k] + 0.1 * torch.randn(shape, generator=gen)
            if k in weights
            else scale * 0.5 * torch.randn(shape, generator=gen)
            for k, (shape, _) in strategy.reply_tensors().items()
        }
        if "soft_labels" in tensors:
            tensors["soft_labels"] = torch.softmax(3 * tensors["soft_labels"], dim=1)
        report = FedNovaReport(num_examples=60 + 40 * i, loss=float(i), local_steps=1 + i % 6)
        out[c] = Message(UPDATE, rnd, run=RUN, client=c, params=wire.to_params(report), tensors=tensors)
    return out


def _pair(algorithm: str, **overrides: object) -> tuple[SecureAggregationStrategy, Strategy]:
    secure_config, plain_config = _configs(algorithm, **overrides)
    context = ServerContext(_model, 3, RUN, open_x=OPEN_X)
    secure = make_strategy(secure_config, context)
    assert isinstance(secure, SecureAggregationStrategy)
    return secure, make_strategy(plain_config, context)


def _plain_round(plain: Strategy, rnd: int, updates: Mapping[str, Message], survivors: list[str]) -> None:
    plain.configure(rnd, CLIENTS)
    plain.aggregate(rnd, {c: plain.accept(rnd, c, updates[c]) for c in survivors})


def _bound(secure: SecureAggregationStrategy, survivors: int) -> float:
    """The fixed-point bound of a part's sum: |U3| values each off by less than one code 2^-frac_bits."""
    resolution = secure._round_config(1, CLIENTS).plan.resolution  # C = 4, N = 10: frac_bits 24
    return survivors * resolution


def _nova(secure: SecureAggregationStrategy) -> FedNova:
    assert isinstance(secure.inner, FedNova)
    return secure.inner


def _state(strategy: Strategy | SecureAggregationStrategy) -> dict[str, torch.Tensor]:
    return strategy.state()[0]


def _assert_close(
    secure: dict[str, torch.Tensor], plain: dict[str, torch.Tensor], bound: float, prefix: str = ""
) -> None:
    keys = [k for k in plain if k.startswith(prefix)]
    assert keys and set(keys) <= set(secure)
    worst = max(float((secure[k].double() - plain[k].double()).abs().max()) for k in keys)
    assert worst <= bound + 1e-6, (prefix, worst, bound)  # + float32 rounding of values below 2


@pytest.mark.parametrize("algorithm", ["scaffold", "fednova", "feddyn"])
def test_the_secure_round_is_the_plaintext_aggregate_of_the_survivors(algorithm: str) -> None:
    secure, plain = _pair(algorithm, simulate_dropouts=0.3)
    before = {k: v.clone() for k, v in _state(secure).items()}
    secure.configure(1, CLIENTS)
    updates = _updates(secure, 1)
    metrics = secure.aggregate(1, {c: secure.accept(1, c, updates[c]) for c in CLIENTS})
    assert secure.last is not None and metrics["secagg_clipped"] == 0
    survivors = list(secure.last.result.survivors)
    assert 7 <= len(survivors) < N  # 3 vanished: those before upload are out of the sum
    _plain_round(plain, 1, updates, survivors)
    sum_bound = _bound(secure, len(survivors))
    after, reference = _state(secure), _state(plain)
    shares = secure.last.shares
    if algorithm == "scaffold":  # x: the weighted mean (lr_g = 1); c: (1/N) sum of the survivors' deltas
        _assert_close(after, reference, sum_bound / sum(shares[c] for c in survivors), "weights.")
        _assert_close(after, reference, sum_bound / N, "control.")
    elif algorithm == "fednova":  # the mean of the moves scaled by p_i / a_i, times tau_eff sum(p_i / a_i) / P
        scale, extra = _nova(secure).secure_scale([secure.accept(1, c, updates[c]) for c in survivors])
        assert extra["fednova_tau_eff"] == pytest.approx(metrics["fednova_tau_eff"])
        assert scale != pytest.approx(1.0)  # unequal step counts: the plain mean of the moves would be wrong
        _assert_close(after, reference, sum_bound * scale / sum(shares[c] for c in survivors), "weights.")
    else:  # theta: the weighted mean minus h / alpha; h: -alpha / N times the survivors' summed moves
        alpha = 0.1
        mean_bound = sum_bound / sum(shares[c] for c in survivors)
        _assert_close(after, reference, alpha / N * sum_bound, "feddyn.h.")
        _assert_close(after, reference, mean_bound + sum_bound / N, "weights.")
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert set(moved) == set(before)  # every state tensor took the round's step (the comparison is not vacuous)


def test_each_scaffold_part_is_clipped_to_the_bound_on_its_own() -> None:
    secure, _ = _pair("scaffold")
    secure.configure(1, CLIENTS)
    updates = _updates(secure, 1, scale=20.0)  # control deltas of norm ~40, 10 x the bound; moves of ~0.4
    metrics = secure.aggregate(1, {c: secure.accept(1, c, updates[c]) for c in CLIENTS})
    assert metrics["secagg_clipped"] == N  # one part of each client: its control delta
    assert secure.last is not None
    dim = sum(v.numel() for v in secure.global_weights().values())
    for c, x in secure.last.vectors.items():
        move = x[:dim] / secure.last.shares[c]
        assert np.linalg.norm(move) < CLIP and np.linalg.norm(x[dim:]) == pytest.approx(CLIP)


@pytest.mark.parametrize(("algorithm", "extra"), [("scaffold", False), ("feddyn", True)])
def test_the_ledger_counts_every_masked_value_beyond_the_reply(algorithm: str, extra: bool) -> None:
    secure, _ = _pair(algorithm, simulate_dropouts=0.3)
    secure.configure(1, CLIENTS)
    updates = _updates(secure, 1)
    replies = {c: secure.accept(1, c, updates[c]) for c in CLIENTS}
    metrics = secure.aggregate(1, replies)
    entries = [e for e in secure.aggregation_record(1).entries if e.kind == MaskedInput.KIND]
    reply_bytes = replies["c0"].update.tensor_bytes
    assert secure.last is not None
    if not extra:  # SCAFFOLD's control deltas are in its reply: the update message stands for the masked upload
        assert entries == [] and metrics["secagg_upload_tensor_bytes"] == reply_bytes
        return
    # FedDyn masks its move twice: the second copy (4 bytes a value) is counted once per client that uploaded
    assert metrics["secagg_upload_tensor_bytes"] == 2 * reply_bytes
    assert {e.client for e in entries} >= set(secure.last.result.survivors)
    assert all(e.direction == "up" and e.tensor_bytes == e.payload_bytes == reply_bytes for e in entries)


def test_parts_travel_in_the_broadcast_and_malformed_ones_are_refused() -> None:
    secure, _ = _pair("scaffold")
    broadcast = decode(encode(secure.configure(1, CLIENTS).broadcast))  # type: ignore[arg-type]
    parts = parse_parts(broadcast.params["secagg.layout"].split(","), broadcast.params)
    assert [(p.relative, p.weighted, p.value_bound) for p in parts] == [(True, True, None), (False, False, None)]
    assert parts[1].tensors == ("control_delta.weight", "control_delta.bias")
    assert parse_parts(["w"], {}) == (SecurePart(("w",)),)  # FedAvg's broadcast names no parts
    assert parse_parts(["w"], {PARTS_PARAM: "awv:w"})[0].value_bound is not None
    for raw in ("xwn:w", "run:", "run:w,w", "awn:w b", "awn:v", ";".join(["run:w"] * 9)):
        with pytest.raises(MessageError):
            parse_parts(["w"], {PARTS_PARAM: raw})
    with pytest.raises(SecAggConfigError, match="the reply lacks"):
        PartLayout([SecurePart(("w",), weighted=False)], {"v": ((2,), torch.float32)})


@pytest.mark.parametrize("algorithm", ["scaffold", "fednova", "feddyn"])
def test_device_parties_give_the_plaintext_aggregate_of_the_survivors(algorithm: str) -> None:
    secure, plain = _pair(algorithm)
    drop_at: dict[str, Stage] = {"c3": "upload", "c5": "unmask", "c7": "share"}
    devices = {c: SecureRounds(c) for c in CLIENTS}
    secure.use_channel(DeviceChannel(devices, drop_at, run=RUN))
    plan = secure.configure(1, CLIENTS)
    broadcast = decode(encode(plan.broadcast))  # type: ignore[arg-type]
    updates = _updates(secure, 1)
    replies: dict[str, CheckedReply] = {}
    for c in CLIENTS:
        reply = devices[c].reply(plan.tasks[c], broadcast, updates[c])
        assert reply is not None and not set(reply.tensors) & set(updates[c].tensors)  # keys, never the update
        replies[c] = secure.accept(1, c, decode(encode(reply)))
    metrics = secure.aggregate(1, replies)
    survivors = [c for c in CLIENTS if c not in ("c3", "c7")]  # c5 uploaded, then vanished: in the sum
    assert metrics["secagg_survivors"] == len(survivors)
    _plain_round(plain, 1, updates, survivors)
    total = sum(60 + 40 * i for i in range(N))
    weight = sum((60 + 40 * int(c[1:])) / total for c in survivors)  # sum_{U3} a_k / A
    bound = _bound(secure, len(survivors))
    after, reference = _state(secure), _state(plain)
    if algorithm == "scaffold":
        _assert_close(after, reference, bound / weight, "weights.")
        _assert_close(after, reference, bound / N, "control.")
    elif algorithm == "fednova":
        scale, _ = _nova(secure).secure_scale([replies[c] for c in survivors])
        shares = _nova(secure).secure_shares([replies[c] for c in CLIENTS])
        s_weight = sum(s for c, s in zip(CLIENTS, shares, strict=True) if c in survivors) / sum(shares)
        _assert_close(after, reference, bound * scale / s_weight, "weights.")
    else:
        _assert_close(after, reference, 0.1 / N * bound, "feddyn.h.")
        _assert_close(after, reference, bound / weight + bound / N, "weights.")


@pytest.mark.parametrize("aggregation", ["sa", "era"])
@pytest.mark.parametrize("devices", [False, True])
def test_dsfl_soft_labels_are_the_plaintext_aggregate_of_the_survivors(aggregation: str, devices: bool) -> None:
    """SA: the survivors' mean soft labels, within K 2^-frac per value (K clients' equal shares 1/K: the sum's
    |U3| 2^-frac over sum_{U3} 1/K); ERA: softmax(mean / T), which moves by at most (1/2)(1/T) that (softmax's
    Jacobian has infinity-norm <= 1/2). Round 1 has no broadcast: with devices the parameters ride in the tasks."""
    secure, plain = _pair("dsfl", algo=dataclasses.replace(DSFL, aggregation=aggregation), simulate_dropouts=0.3)
    plan = secure.configure(1, CLIENTS)
    assert plan.broadcast is None and all("secagg.round_seed" in t.params for t in plan.tasks.values())
    updates = _updates(secure, 1)
    if devices:
        drop_at: dict[str, Stage] = {"c3": "upload", "c5": "unmask", "c7": "share"}
        parties = {c: SecureRounds(c) for c in CLIENTS}
        secure.use_channel(DeviceChannel(parties, drop_at, run=RUN))
        replies = {}
        for c in CLIENTS:
            reply = parties[c].reply(decode(encode(plan.tasks[c])), None, updates[c])
            assert reply is not None and "soft_labels" not in reply.tensors
            replies[c] = secure.accept(1, c, decode(encode(reply)))
        secure.aggregate(1, replies)
        survivors = [c for c in CLIENTS if c not in ("c3", "c7")]
    else:
        secure.aggregate(1, {c: secure.accept(1, c, updates[c]) for c in CLIENTS})
        assert secure.last is not None
        survivors = list(secure.last.result.survivors)
    assert len(survivors) < N
    _plain_round(plain, 1, updates, survivors)
    bound = N * secure._round_config(1, CLIENTS).plan.resolution  # K = N clients replied
    if aggregation == "era":
        bound *= 0.5 / DSFL.era_temperature
    _assert_close(_state(secure), _state(plain), bound, "soft_labels")
    mean = torch.stack([updates[c].tensors["soft_labels"] for c in survivors]).mean(dim=0)
    everyone = torch.stack([updates[c].tensors["soft_labels"] for c in CLIENTS]).mean(dim=0)
    assert float((mean - everyone).abs().max()) > 100 * bound  # the survivors' mean, not everyone's


def test_dsfl_needs_a_ring_bound_that_holds_a_probability() -> None:
    with pytest.raises(ConfigError, match="set --secagg-clip 1 or more"):
        _pair("dsfl", algo=DSFL, secagg_clip=0.5)
