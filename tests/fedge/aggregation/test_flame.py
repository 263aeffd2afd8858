"""FLAME's rule (``--robust flame``): the majority cluster by cosine distance, clipped to the median norm, averaged,
with optional noise; on synthetic updates whose answer is known."""

from __future__ import annotations

import pytest
import torch

from fedge.aggregation.robust import majority_cluster, robust_average
from fedge.errors import ConfigError

DIM = 200


def _updates(honest: int, poisoned: int, seed: int = 0) -> torch.Tensor:
    """``honest`` updates around one direction (cosine ~0.9 with it), then ``poisoned`` ones around another direction
    (a backdoor's), all of norm ~1: no norm bound tells them apart."""
    g = torch.Generator().manual_seed(seed)
    good, bad = torch.randn(DIM, generator=g, dtype=torch.float64), torch.randn(DIM, generator=g, dtype=torch.float64)
    rows = [good + 0.4 * torch.randn(DIM, generator=g, dtype=torch.float64) for _ in range(honest)]
    rows += [bad + 0.4 * torch.randn(DIM, generator=g, dtype=torch.float64) for _ in range(poisoned)]
    stacked = torch.stack(rows)  # (K, DIM)
    return stacked / stacked.norm(dim=1, keepdim=True)


@pytest.mark.parametrize(("honest", "poisoned"), [(7, 3), (6, 4), (9, 1), (3, 2)])
def test_the_majority_cluster_leaves_out_a_planted_minority(honest: int, poisoned: int) -> None:
    kept = majority_cluster(_updates(honest, poisoned))
    assert set(kept) <= set(range(honest)) and len(kept) >= (honest + poisoned) // 2 + 1, kept


def test_sign_flips_and_zero_updates_are_left_out() -> None:
    rows = _updates(7, 0)
    attacked = torch.cat([rows, -rows[:2], torch.zeros(1, DIM, dtype=torch.float64)])  # (10, DIM)
    kept = majority_cluster(attacked)
    assert set(kept) <= set(range(7)) and len(kept) >= 6, kept


def test_fewer_than_three_updates_are_all_kept() -> None:
    assert majority_cluster(_updates(1, 1)) == [0, 1]


def _states(rows: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    return [{"w": r.float().reshape(10, 20)} for r in rows]


def test_flame_averages_the_honest_updates_clipped_to_the_median_norm() -> None:
    rows = _updates(7, 3)
    rows[:7] *= torch.linspace(0.5, 2.0, 7, dtype=torch.float64).unsqueeze(1)  # honest norms 0.5 .. 2.0
    rows[7:] *= 3.0  # the poisoned are long too
    reference = {"w": torch.zeros(10, 20)}
    out = robust_average(_states(rows), [1.0] * 10, reference, rule="flame")
    kept = majority_cluster(rows)
    assert set(kept) <= set(range(7))
    norms = rows.norm(dim=1)
    median = float(norms.sort().values[4:6].mean())  # the median over all ten updates (FLAME's S_t)
    clipped = rows[kept] * (median / norms[kept]).clamp(max=1.0).unsqueeze(1)
    torch.testing.assert_close(out["w"].double().flatten(), clipped.mean(dim=0), atol=1e-6, rtol=0)
    mean = robust_average(_states(rows), [1.0] * 10, reference, rule="mean")
    assert (mean["w"].double().flatten() - clipped.mean(dim=0)).norm() > 0.1  # the mean does take them in


def test_flame_caps_a_claimed_data_size_at_the_median() -> None:
    rows = _updates(7, 0)
    reference = {"w": torch.zeros(10, 20)}
    fair = robust_average(_states(rows), [10.0] * 7, reference, rule="flame")
    claimed = robust_average(_states(rows), [10.0] * 6 + [2.0**40], reference, rule="flame")
    torch.testing.assert_close(claimed["w"], fair["w"])


def test_the_noise_has_the_asked_scale_and_is_seeded() -> None:
    rows = torch.ones(5, 20_000, dtype=torch.float64) * 0.01  # every update of norm ~1.41, all alike
    states = [{"w": r.float()} for r in rows]
    reference = {"w": torch.zeros(20_000)}
    plain = robust_average(states, [1.0] * 5, reference, rule="flame")["w"]

    def noisy(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return robust_average(states, [1.0] * 5, reference, rule="flame", noise_factor=0.01, generator=g)["w"]

    std = float((noisy(1) - plain).double().std())
    assert std == pytest.approx(0.01 * float(rows[0].norm()), rel=0.05)
    torch.testing.assert_close(noisy(1), noisy(1))
    assert not torch.equal(noisy(1), noisy(2))
    with pytest.raises(ConfigError):
        robust_average(states, [1.0] * 5, reference, rule="flame", noise_factor=-1.0)


def test_flame_does_not_clip_a_second_time() -> None:
    """A deployment's clip_factor (1) leaves FLAME's own clip to the median norm as it is."""
    rows = _updates(7, 3) * torch.linspace(0.5, 2.0, 10, dtype=torch.float64).unsqueeze(1)
    reference = {"w": torch.zeros(10, 20)}
    alone = robust_average(_states(rows), [1.0] * 10, reference, rule="flame")
    clipped = robust_average(_states(rows), [1.0] * 10, reference, rule="flame", clip_factor=1.0)
    torch.testing.assert_close(alone["w"], clipped["w"])
