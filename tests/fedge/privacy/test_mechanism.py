"""Poisson sampling, clipping, the noise source and adaptive clipping's convergence on a fixed set of norms."""

from __future__ import annotations

import numpy as np
import pytest

from fedge.privacy.mechanism import adapted_clip, clip, count_std, noise_rng, poisson_sample

CLIENTS = [f"c{i:03d}" for i in range(200)]


def test_poisson_sample_is_seeded_by_run_and_round_and_has_rate_q() -> None:
    assert poisson_sample(CLIENTS, 0.1, 7, 3) == poisson_sample(list(reversed(CLIENTS)), 0.1, 7, 3)
    assert poisson_sample(CLIENTS, 0.1, 7, 3) != poisson_sample(CLIENTS, 0.1, 7, 4)
    assert poisson_sample(CLIENTS, 0.1, 7, 3) != poisson_sample(CLIENTS, 0.1, 8, 3)
    sizes = [len(poisson_sample(CLIENTS, 0.1, 0, r)) for r in range(1, 301)]
    assert np.mean(sizes) == pytest.approx(20, abs=1.0)  # qN
    assert len(set(sizes)) > 5  # the cohort's size varies: not a fixed-size sample
    assert any(not poisson_sample(CLIENTS[:5], 0.1, 0, r) for r in range(1, 50))  # a cohort may be empty


def test_clip_bounds_the_norm_and_keeps_short_deltas() -> None:
    long, short = np.full(100, 1.0), np.full(100, 0.01)
    clipped, norm = clip(long, 2.0)
    assert norm == pytest.approx(10.0) and np.linalg.norm(clipped) == pytest.approx(2.0)
    assert np.allclose(clipped / np.linalg.norm(clipped), long / 10.0)  # the direction stays
    same, _ = clip(short, 2.0)
    assert np.array_equal(same, short)


def test_noise_rng_is_reproducible_only_with_a_seed() -> None:
    assert np.array_equal(noise_rng(5, 2).normal(size=4), noise_rng(5, 2).normal(size=4))
    assert not np.array_equal(noise_rng(5, 2).normal(size=4), noise_rng(5, 3).normal(size=4))
    assert not np.array_equal(noise_rng(None, 2).normal(size=4), noise_rng(None, 2).normal(size=4))


@pytest.mark.parametrize("target", [0.2, 0.5, 0.8])
def test_adaptive_clip_converges_to_the_target_quantile(target: float) -> None:
    """Andrew et al. Algorithm 1 on 100 clients a round drawn from a fixed set of 1,000 update norms, the count
    noised with std m / 20: the clip ends near the norms' target quantile."""
    gen = np.random.default_rng(0)
    norms = gen.lognormal(mean=0.0, sigma=1.0, size=1000)
    m, c = 100, 0.1
    for _ in range(400):
        cohort = gen.choice(norms, size=m, replace=False)
        count = float((cohort <= c).sum()) + gen.normal(0, count_std(m))
        c = adapted_clip(c, count, m, target, 0.2)
    assert float((norms <= c).mean()) == pytest.approx(target, abs=0.06)
    assert c == pytest.approx(float(np.quantile(norms, target)), rel=0.3)


def test_adaptive_clip_moves_the_right_way() -> None:
    assert adapted_clip(1.0, 90, 100, 0.5, 0.2) < 1.0  # 90% unclipped: the clip is too loose
    assert adapted_clip(1.0, 10, 100, 0.5, 0.2) > 1.0
    assert adapted_clip(1.0, 50, 100, 0.5, 0.2) == pytest.approx(1.0)
