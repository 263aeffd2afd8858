"""The DP-FedAvg wrapper on hand-built FedAvg rounds: the new model is the broadcast plus (clipped sum + noise) / qN,
exactly; the noise has the stated std (Kolmogorov-Smirnov), also as shares before secure aggregation's masking; one
client's contribution is bounded by the clip; empty and partial cohorts; adaptive clipping's step; the state; the
budget stop; and the start-up refusals."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats
from secagg_support import seeded_bytes
from torch import nn

from fedge.algorithms import make_strategy
from fedge.algorithms.base import CheckedReply, ServerContext, UpdateReport
from fedge.algorithms.differential_privacy import DifferentialPrivacyStrategy
from fedge.algorithms.fedavg import FedAvgSettings
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.privacy.accountant import Ledger
from fedge.privacy.mechanism import adapted_clip, noise_rng
from fedge.wire import fields as wire
from fedge.wire.message import UPDATE, Message

RUN = "run"


def _config(**overrides: object) -> RunConfig:
    base: dict[str, object] = dict(
        algorithm="fedavg",
        dataset="synthetic",
        num_clients=10,
        client_fraction=0.5,
        dp_noise_multiplier=1.0,
        dp_clip="0.5",
        dp_noise_seed=3,
    )
    base.update(overrides)
    return RunConfig(**base)  # type: ignore[arg-type]


def _strategy(config: RunConfig, inputs: int = 5, outputs: int = 3) -> DifferentialPrivacyStrategy:
    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Linear(inputs, outputs)

    strategy = make_strategy(config, ServerContext(model, outputs, RUN))
    assert isinstance(strategy, DifferentialPrivacyStrategy)
    strategy._rand = seeded_bytes(0)  # deterministic keys for the secure path (tests only)
    return strategy


def _flat(tensors: dict[str, torch.Tensor]) -> np.ndarray:
    return np.concatenate([t.reshape(-1).double().numpy() for t in tensors.values()])


def _replies(strategy: Any, rnd: int, steps: dict[str, float], seed: int = 0) -> dict[str, CheckedReply]:
    """Each client's new weights: the global ones plus a random step of L2 norm ``steps[c]``."""
    gen = torch.Generator().manual_seed(seed + rnd)
    weights = strategy.global_weights()
    assert weights is not None
    out = {}
    for c, norm in steps.items():
        raw = {k: torch.randn(v.shape, generator=gen) for k, v in weights.items()}
        scale = norm / float(np.linalg.norm(_flat(raw)))
        tensors = {k: weights[k] + scale * raw[k] for k in weights}
        report = UpdateReport(num_examples=10, loss=1.0)
        message = Message(UPDATE, rnd, run=RUN, client=c, params=wire.to_params(report), tensors=tensors)
        out[c] = strategy.accept(rnd, c, message)
    return out


def _round(
    strategy: DifferentialPrivacyStrategy, rnd: int, steps: dict[str, float], cohort: list[str] | None = None
) -> tuple[np.ndarray, dict[str, CheckedReply], dict[str, float], np.ndarray]:
    weights = strategy.global_weights()
    assert weights is not None
    before = _flat(weights)
    strategy.configure(rnd, sorted(cohort if cohort is not None else steps))
    replies = _replies(strategy, rnd, steps)
    metrics = strategy.aggregate(rnd, replies)
    after = strategy.global_weights()
    assert after is not None
    return before, replies, metrics, _flat(after)


def test_the_model_is_the_broadcast_plus_clipped_sum_and_noise_over_qn() -> None:
    cfg = _config()
    strategy = _strategy(cfg)
    before, replies, metrics, after = _round(strategy, 1, {"c0": 0.1, "c1": 2.0, "c2": 7.0})
    clipped = []
    for c in sorted(replies):
        delta = _flat(dict(replies[c].update.tensors)) - before
        norm = np.linalg.norm(delta)
        clipped.append(delta * min(1.0, 0.5 / norm))
    dim = before.size
    noise = noise_rng(3, 1).normal(0.0, np.full(dim + 1, 1.0 * 0.5))[:-1]  # the update's part of the draw
    expected = before + (np.sum(clipped, axis=0) + noise) / (0.5 * 10)
    assert np.allclose(after, expected, atol=1e-6)  # float32 weights
    assert metrics["dp_noise_std"] == 0.5 and metrics["dp_clip"] == 0.5
    assert metrics["dp_epsilon"] == Ledger(0.5, 1.0, 1 / 10**1.1).epsilon(1)


def test_each_clients_contribution_is_bounded_by_the_clip() -> None:
    """A client 10^4 times further away moves the model exactly as far as one just beyond the clip, same noise."""
    outs = []
    for far in (1.0, 1e4):
        strategy = _strategy(_config())
        _, _, _, after = _round(strategy, 1, {"c0": 0.2, "c1": far})
        assert strategy.last is not None
        assert all(n <= 0.5 for n in strategy.last.clipped_norms.values())
        assert strategy.last.clipped_norms["c1"] == 0.5
        outs.append(after)
    assert np.allclose(outs[0], outs[1], atol=1e-5)


@pytest.mark.parametrize("secure", [False, True])
def test_the_noise_has_the_stated_std(secure: bool) -> None:
    """Zero updates: what the model moves by, times qN, is the noise; KS against N(0, (Z C)^2) (scaled by the
    survivors' share sqrt(n / t) under secure aggregation, where each client adds std Z C / sqrt(t)); a wrong std is
    rejected, so the test can fail."""
    cfg = _config(dp_noise_multiplier=1.5, dp_clip="2.0", secure_aggregation=secure, num_clients=12)
    strategy = _strategy(cfg, inputs=100, outputs=60)  # 6,060 values
    cohort = [f"c{i}" for i in range(6)]
    before, _, _, after = _round(strategy, 1, dict.fromkeys(cohort, 0.0))
    sample = (after - before) * (0.5 * 12)  # (dim,)
    std = 1.5 * 2.0
    if secure:
        from fedge.secagg.config import RoundConfig

        t = RoundConfig.new(
            run=RUN, session="s", round=1, clients=cohort, round_seed=b"0" * 32, dim=1, bound=1.0, ring_bits=32
        ).min_survivors
        assert t < len(cohort)
        std *= math.sqrt(len(cohort) / t)  # every client survived: more noise than the worst case needs
    assert stats.kstest(sample, "norm", args=(0.0, std)).pvalue > 1e-3
    assert stats.kstest(sample, "norm", args=(0.0, 1.2 * std)).pvalue < 1e-6
    assert stats.kstest(sample, "norm", args=(0.0, std / 1.2)).pvalue < 1e-6


def test_secure_aggregation_sums_noised_vectors_only() -> None:
    """Under secure aggregation the released sum is the clipped updates plus the survivors' noise shares."""
    strategy = _strategy(_config(secure_aggregation=True))
    before, _, metrics, after = _round(strategy, 1, {"c0": 0.3, "c1": 3.0, "c2": 0.1, "c3": 1.0})
    assert metrics["dp_survivors"] == 4 and 1 <= metrics["dp_min_survivors"] < 4
    last = strategy.last
    assert last is not None and len(last.survivors) == 4
    expected = before + (last.clipped_sum + last.noise) / 5.0
    assert np.allclose(after, expected, atol=1e-5)  # the ring's fixed point, then float32
    assert np.std(last.noise) > 0


def test_an_empty_cohort_moves_the_model_by_noise_and_counts_the_round() -> None:
    strategy = _strategy(_config())
    before, _, metrics, after = _round(strategy, 1, {}, cohort=[])
    noise = noise_rng(3, 1).normal(0.0, np.full(before.size + 1, 0.5))[:-1]
    assert np.allclose(after, before + noise / 5.0, atol=1e-6)
    assert metrics["dp_cohort"] == 0 and metrics["dp_epsilon"] > 0


def test_a_dropped_client_keeps_the_fixed_denominator() -> None:
    """Sampled c0..c2, c2 never replied: the sum of two over qN = 5, not over 2."""
    strategy = _strategy(_config(dp_clip="100"))
    before, replies, _, after = _round(strategy, 1, {"c0": 0.2, "c1": 0.4}, cohort=["c0", "c1", "c2"])
    total = sum(_flat(dict(r.update.tensors)) - before for r in replies.values())
    noise = noise_rng(3, 1).normal(0.0, np.full(before.size + 1, 100.0))[:-1]
    assert np.allclose(after, before + (total + noise) / 5.0, atol=1e-4)


def test_adaptive_clipping_steps_the_clip_from_the_noised_count() -> None:
    cfg = _config(dp_clip="adaptive:0.5", num_clients=100, client_fraction=0.2)  # m = 20, sigma_b = 1
    strategy = _strategy(cfg)
    assert strategy.count_std == 1.0 and strategy.z_update == pytest.approx((1 - 1 / 4) ** -0.5)  # Andrew et al.
    steps = {f"c{i}": (0.1 if i < 7 else 3.0) for i in range(10)}  # 7 of 10 within the clip
    before, _, metrics, _ = _round(strategy, 1, steps)
    draw = noise_rng(3, 1).normal(0.0, np.append(np.full(before.size, strategy.z_update * 0.5), 1.0))
    count = 7 + draw[-1]
    assert metrics["dp_unclipped_share"] == pytest.approx(count / 20)
    assert strategy.clip == pytest.approx(adapted_clip(0.5, count, 20.0, 0.5, 0.2))
    assert strategy.clip > 0.5  # 7 of an expected 20 fit: below the median, the clip grows
    tensors, values = strategy.state()
    other = _strategy(cfg)
    other.load_state(tensors, values)
    assert other.clip == strategy.clip


def test_the_budget_stops_before_the_round_that_would_exceed_it() -> None:
    ledger = Ledger(0.5, 1.0, 1 / 10**1.1)
    budget = (ledger.epsilon(3) + ledger.epsilon(4)) / 2
    strategy = _strategy(_config(dp_epsilon_budget=budget))
    assert [strategy.stop_before(r) for r in (1, 2, 3)] == ["", "", ""]
    why = strategy.stop_before(4)
    assert why.startswith("privacy budget: round 4 would spend epsilon") and "stopped after round 3" in why
    assert _strategy(_config()).stop_before(1000) == ""


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(algorithm="fednova"), "cannot run --algorithm fednova: DP-FedAvg bounds each client's whole"),
        (dict(algorithm="dsfl"), "cannot run --algorithm dsfl: it uploads outputs (logits)"),
        (dict(algorithm="fd"), "cannot run --algorithm fd"),
        (dict(algorithm="fedcurv"), "cannot run --algorithm fedcurv: DP-FedAvg bounds each client's whole"),
        (dict(algo=FedAvgSettings(robust="median")), "--robust median with --dp-noise-multiplier"),
        (dict(algo=FedAvgSettings(clip_factor=2.0)), "--clip-factor 2 with --dp-noise-multiplier"),
        (dict(algo=FedAvgSettings(max_update_ratio=3.0)), "--max-update-ratio 3 with --dp-noise-multiplier"),
        (dict(upload_codec="int8"), "compressed exchanges are not supported"),
        (dict(dp_clip="wide"), "dp_clip must be a positive number or adaptive[:C0]"),
        (dict(dp_clip="-1"), "dp_clip must be positive"),
        (dict(dp_noise_multiplier=0.0), "--dp-clip needs --dp-noise-multiplier > 0"),
        (dict(dp_accountant="moments"), "dp_accountant must be rdp or pld"),
        (dict(dp_target_quantile=1.0), "dp_target_quantile must be in (0, 1)"),
        (dict(secure_aggregation=True, secagg_clip=2.0), "--secagg-clip with --dp-noise-multiplier"),
    ],
)
def test_refusals(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _config(**overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_dp_weighs_uniformly_and_turns_the_update_norm_check_off() -> None:
    cfg = _config()
    assert cfg.algo.weighting == "uniform" and cfg.algo.max_update_ratio == 0  # type: ignore[attr-defined]
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


def test_adaptive_clipping_needs_enough_count_noise() -> None:
    with pytest.raises(ConfigError, match="clipped-count noise"):
        _strategy(_config(dp_clip="adaptive", num_clients=10, client_fraction=0.5))  # sigma_b = 0.25 < Z / 2 = 0.5
