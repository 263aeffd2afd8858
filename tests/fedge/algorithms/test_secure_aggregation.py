"""The secure-aggregation wrapper on a hand-built FedAvg round: the global model it produces is the plaintext
fixed-point aggregation of the clipped, weighted, stochastically rounded deltas, bit for bit in the ring; dropouts,
abandoned rounds, the ledger entries and the start-up refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedge.algorithms import make_strategy
from fedge.algorithms.base import CheckedReply, ServerContext, Strategy, UpdateReport
from fedge.algorithms.fedavg import FedAvgSettings
from fedge.algorithms.secure_aggregation import SecureAggregationStrategy
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.secagg import decode, encode, ring_sum
from fedge.secagg.messages import MaskedInput
from fedge.secagg.remote import clipped_delta
from fedge.secagg.rounds import SUM_CLIENT, rounding_rng, simulated_dropouts
from fedge.wire import fields as wire
from fedge.wire.message import UPDATE, Message

RUN = "run"


def _config(n: int = 6, **overrides: object) -> RunConfig:
    base: dict[str, object] = dict(algorithm="fedavg", dataset="synthetic", num_clients=n, secure_aggregation=True)
    base.update(overrides)
    return RunConfig(**base)  # type: ignore[arg-type]


def _model_factory() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(5, 3)


def _secure(config: RunConfig) -> SecureAggregationStrategy:
    strategy = make_strategy(config, ServerContext(_model_factory, 3, RUN))
    assert isinstance(strategy, SecureAggregationStrategy)
    return strategy


def _replies(
    strategy: Strategy, rnd: int, clients: list[str], scales: dict[str, float] | None = None, seed: int = 0
) -> dict[str, CheckedReply]:
    """Each client's new weights: the global ones moved by a random step (``scales[c]`` times larger), its data
    size 10 + 7 i and its loss i."""
    gen = torch.Generator().manual_seed(seed + rnd)
    weights = strategy.global_weights()
    assert weights is not None
    out = {}
    for i, c in enumerate(clients):
        scale = (scales or {}).get(c, 1.0)
        tensors = {k: v + scale * 0.1 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
        report = UpdateReport(num_examples=10 + 7 * i, loss=float(i))
        message = Message(UPDATE, rnd, run=RUN, client=c, params=wire.to_params(report), tensors=tensors)
        out[c] = strategy.accept(rnd, c, message)
    return out


def _flat(tensors: dict[str, torch.Tensor]) -> np.ndarray:
    return np.concatenate([t.reshape(-1).double().numpy() for t in tensors.values()])


def _expected(
    strategy: SecureAggregationStrategy,
    replies: dict[str, CheckedReply],
    cohort: list[str],
    rnd: int,
    survivors: tuple[str, ...],
    before: dict[str, torch.Tensor],
) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
    """The plaintext fixed-point aggregation, computed here: clip each delta to C, weight it by n_k / sum n, encode it
    with the same per-client rounding stream, add the survivors' codes in the ring, decode and divide."""
    cfg = strategy.secure_config
    assert strategy.last is not None
    plan = strategy.last.result.plan
    g = _flat(before)
    total = sum(replies[c].report.num_examples for c in replies)
    seeds = rounding_rng(cfg.seed, rnd).integers(0, 2**63, size=len(cohort))  # one child per client, in id order
    codes = {}
    for c, s in zip(sorted(cohort), seeds, strict=True):
        if c in survivors:
            delta, _ = clipped_delta(_flat(replies[c].update.tensors), g, cfg.secagg_clip)
            x = delta * (replies[c].report.num_examples / total)
            codes[c] = encode(x, plan, rng=np.random.default_rng(int(s)))
    ring = ring_sum(codes.values(), plan.ring_bits, len(g))
    weight = sum(replies[c].report.num_examples / total for c in survivors)
    flat = g + decode(ring, plan) / weight
    out, start = {}, 0
    for k, v in before.items():
        out[k] = torch.from_numpy(flat[start : start + v.numel()].copy()).reshape(v.shape).float()
        start += v.numel()
    return ring, out


def test_the_global_model_is_the_plaintext_fixed_point_aggregation_bit_for_bit() -> None:
    config = _config(6, secagg_clip=0.5)
    strategy = _secure(config)
    clients = [f"c{i}" for i in range(6)]
    before = {k: v.clone() for k, v in strategy.global_weights().items()}
    plan = strategy.configure(1, clients)
    assert plan.broadcast is not None and plan.broadcast.params["secagg.config.bound"] == "0.5"
    replies = _replies(strategy, 1, clients, scales={"c2": 20.0})  # c2's update is far longer than C: clipped
    metrics = strategy.aggregate(1, replies)
    assert metrics["secagg_clipped"] >= 1 and metrics["secagg_survivors"] == 6
    assert (metrics["secagg_bound"], metrics["secagg_ring_bits"]) == (0.5, 32)
    ring, weights = _expected(strategy, replies, clients, 1, tuple(clients), before)
    assert strategy.last is not None
    np.testing.assert_array_equal(strategy.last.result.sum_ring, ring)
    after = strategy.global_weights()
    assert all(torch.equal(after[k], weights[k]) for k in after)
    # The inner FedAvg saw one reply, the mean: its loss is the survivors' mean loss.
    assert metrics["mean_local_loss"] == pytest.approx(np.mean(range(6)))
    # And that is plain FedAvg of the clipped updates up to the fixed point's resolution.
    g = _flat(before)
    n = np.array([10 + 7 * i for i in range(6)], dtype=float)
    deltas = [clipped_delta(_flat(replies[c].update.tensors), g, 0.5)[0] for c in clients]
    plain = g + sum(w * d for w, d in zip(n / n.sum(), deltas, strict=True))
    resolution = strategy.last.result.plan.resolution
    assert np.abs(_flat(after) - plain).max() < 6 * resolution + 1e-6  # + float32 rounding of the weights


def test_the_clip_changes_the_result_only_when_it_clips() -> None:
    results = {}
    for clip in (0.05, 100.0):
        strategy = _secure(_config(4, secagg_clip=clip))
        clients = [f"c{i}" for i in range(4)]
        strategy.configure(1, clients)
        metrics = strategy.aggregate(1, _replies(strategy, 1, clients))
        results[clip] = (_flat(strategy.global_weights()), metrics["secagg_clipped"])
    assert results[0.05][1] == 4 and results[100.0][1] == 0
    assert np.abs(results[0.05][0] - results[100.0][0]).max() > 1e-3


def test_dropouts_before_upload_leave_the_sum_and_are_recorded() -> None:
    config = _config(10, simulate_dropouts=0.3, seed=3)
    cohort = [f"c{i}" for i in range(10)]
    drops = simulated_dropouts(cohort, 0.3, 3, 1)
    assert len(drops) == 3
    strategy = _secure(config)
    before = {k: v.clone() for k, v in strategy.global_weights().items()}
    strategy.configure(1, cohort)
    replies = _replies(strategy, 1, cohort)
    metrics = strategy.aggregate(1, replies)
    record = strategy.aggregation_record(1)
    assert not record.abandoned
    left = {c for c, s in drops.items() if s in ("share", "upload")}
    assert {d.client for d in record.drops} == left
    assert all("(simulated)" in d.reason for d in record.drops)
    assert strategy.last is not None
    survivors = strategy.last.result.survivors
    assert set(survivors) == set(cohort) - left  # a client that vanished while unmasking is in the sum
    assert metrics["secagg_vanished_unmasking"] == sum(1 for s in drops.values() if s == "unmask")
    ring, weights = _expected(strategy, replies, cohort, 1, survivors, before)
    np.testing.assert_array_equal(strategy.last.result.sum_ring, ring)
    assert all(torch.equal(strategy.global_weights()[k], weights[k]) for k in weights)


def test_a_round_below_threshold_is_abandoned_and_the_model_stays() -> None:
    strategy = _secure(_config(10, simulate_dropouts=0.9))
    cohort = [f"c{i}" for i in range(10)]
    before = {k: v.clone() for k, v in strategy.global_weights().items()}
    strategy.configure(1, cohort)
    metrics = strategy.aggregate(1, _replies(strategy, 1, cohort))
    record = strategy.aggregation_record(1)
    assert record.abandoned.startswith("secure aggregation round abandoned at stage")
    assert "secagg_survivors" not in metrics and len(record.drops) == 9
    assert all(torch.equal(strategy.global_weights()[k], before[k]) for k in before)
    assert record.entries  # the messages sent before it gave up are counted too


def test_the_ledger_gets_every_protocol_message_but_the_masked_upload() -> None:
    strategy = _secure(_config(5))
    cohort = [f"c{i}" for i in range(5)]
    strategy.configure(1, cohort)
    replies = _replies(strategy, 1, cohort)
    metrics = strategy.aggregate(1, replies)
    entries = strategy.aggregation_record(1).entries
    kinds = {(e.kind, e.direction) for e in entries}
    assert kinds == {
        ("secagg.advertise", "up"),
        ("secagg.neighbour-keys", "down"),
        ("secagg.encrypted-shares", "up"),
        ("secagg.share-delivery", "down"),
        ("secagg.unmask-request", "down"),
        ("secagg.unmask-shares", "up"),
    }
    assert MaskedInput.KIND not in {e.kind for e in entries}
    assert all(sum(1 for e in entries if e.kind == k and e.client == c) == 1 for k, _ in kinds for c in cohort)
    # The masked upload (uint32) is as large as the plain update's float32 tensors it stands for.
    assert metrics["secagg_upload_tensor_bytes"] == replies["c0"].update.tensor_bytes
    assert strategy.aggregation_record(1).entries == ()  # handed over once


def test_the_inner_strategy_sees_one_reply_the_mean() -> None:
    strategy = _secure(_config(3))
    seen: list[list[str]] = []
    inner_aggregate = strategy.inner.aggregate

    def spy(rnd: int, replies: dict[str, CheckedReply]) -> dict[str, float]:
        seen.append(sorted(replies))
        assert replies[SUM_CLIENT].report.num_examples == 10 + 17 + 24
        return inner_aggregate(rnd, replies)

    strategy.inner.aggregate = spy  # type: ignore[method-assign]
    cohort = ["a", "b", "c"]
    strategy.configure(1, cohort)
    strategy.aggregate(1, _replies(strategy, 1, cohort))
    assert seen == [[SUM_CLIENT]]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(algo=FedAvgSettings(robust="median")), "--robust median needs every client's update in the clear"),
        (dict(algo=FedAvgSettings(clip_factor=2.0)), "--clip-factor 2 clips each update"),
        (dict(algo=FedAvgSettings(max_update_ratio=5.0)), "--max-update-ratio 5 refuses an update by its norm"),
        (dict(upload_codec="int8"), "upload codecs do not apply"),
        (dict(num_clients=1), "at least 2 clients per round"),
        (dict(secagg_degree=3, secagg_threshold=4), "cannot exceed secagg_degree"),
    ],
)
def test_refusals_at_start_up(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _config(**overrides)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_what_fits_the_protocol_only_at_round_time_fails_when_the_strategy_is_made() -> None:
    with pytest.raises(ConfigError, match="degree must lie in"):
        _secure(_config(4, secagg_degree=5))
    with pytest.raises(ConfigError, match="fractional bits"):
        _secure(_config(4, secagg_clip=1e9))


def test_the_update_norm_check_is_turned_off_and_dropouts_need_secure_aggregation() -> None:
    assert _config().algo.max_update_ratio == 0.0  # type: ignore[attr-defined]
    assert RunConfig(algorithm="fedavg").algo.max_update_ratio == 10.0  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="needs --secure-aggregation"):
        RunConfig(simulate_dropouts=0.1)
    assert RunConfig.from_dict(_config().to_dict()) == _config()
