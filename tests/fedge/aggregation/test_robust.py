"""Robust aggregation on hand-computed cases: median, trimmed mean, norm clipping, soft-label rows."""

import math

import pytest
import torch

from fedge.aggregation.robust import (
    UpdateNormHistory,
    coordinate_median,
    robust_average,
    robust_rows,
    trimmed_mean,
    update_norm,
)
from fedge.errors import ConfigError


def test_coordinate_median_and_trimmed_mean_by_hand():
    values = torch.tensor([[1.0, 10.0], [2.0, -4.0], [3.0, 0.0], [100.0, 2.0]])  # 4 clients, 2 coordinates
    assert torch.equal(coordinate_median(values), torch.tensor([2.5, 1.0]))  # middle two: (2+3)/2, (0+2)/2
    assert torch.equal(trimmed_mean(values, 0.25), torch.tensor([2.5, 1.0]))  # one dropped at each end
    assert torch.equal(trimmed_mean(values, 0.0), values.mean(dim=0))


def test_one_scaled_update_cannot_move_a_median_or_a_clipped_mean():
    reference = {"w": torch.zeros(3)}
    honest = [
        {"w": torch.tensor([1.0, 1.0, 1.0])},
        {"w": torch.tensor([1.2, 0.8, 1.0])},
        {"w": torch.tensor([0.8, 1.2, 1.0])},
    ]
    attacker = {"w": torch.full((3,), 1000.0)}  # model replacement: K * w_x - (K - 1) * w_g (DS-FL eq. 19)
    states = [*honest, attacker]
    assert robust_average(states, [1, 1, 1, 1], reference)["w"][0] > 200  # FedAvg's mean is owned by the attacker
    assert torch.allclose(
        robust_average(states, [1, 1, 1, 1], reference, rule="median")["w"], torch.tensor([1.1, 1.1, 1.0])
    )
    # Clipped to 1 x the median update norm (sqrt 3 .. 1.64): the attacker's update shrinks to length ~1.68.
    clipped = robust_average(states, [1, 1, 1, 1], reference, clip_factor=1.0)["w"]
    norms = sorted(update_norm(s, reference) for s in states)
    bound = (norms[1] + norms[2]) / 2
    expected = (honest[0]["w"] + honest[1]["w"] + honest[2]["w"] + torch.full((3,), bound / math.sqrt(3))) / 4
    assert torch.allclose(clipped, expected, atol=1e-6)


def test_a_mean_without_clipping_is_fedavg():
    reference = {"w": torch.zeros(2)}
    states = [{"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 6.0])}]
    assert torch.allclose(robust_average(states, [3, 1], reference)["w"], torch.tensor([1.5, 3.0]))


def test_robust_soft_label_rows_stay_probability_vectors():
    honest = torch.tensor([[0.7, 0.2, 0.1]])
    rows = [honest, honest, torch.tensor([[0.6, 0.3, 0.1]]), torch.tensor([[0.0, 0.0, 1.0]])]  # one poisoned client
    median = robust_rows(rows, rule="median")
    # Per class, the mean of the middle two of the four clients: (0.6+0.7)/2, (0.2+0.2)/2, (0.1+0.1)/2; then / 0.95.
    assert torch.allclose(median, torch.tensor([[0.65, 0.2, 0.1]]) / 0.95, atol=1e-6)
    assert torch.allclose(median.sum(dim=1), torch.ones(1))
    with pytest.raises(ConfigError, match="trim_ratio"):
        robust_rows(rows, rule="trimmed_mean", trim_ratio=0.5)


def test_trimmed_mean_drops_one_value_at_each_end_of_a_small_round():
    values = torch.tensor([[1.0], [2.0], [1000.0]])  # 3 replies: 20% of 3 rounds to 0, yet one attacker must go
    assert torch.equal(trimmed_mean(values, 0.2), torch.tensor([2.0]))
    assert torch.equal(trimmed_mean(values, 0.0), values.mean(dim=0))


def test_the_norm_reference_follows_the_majority_and_ignores_one_client():
    history = UpdateNormHistory(window=2)
    assert history.reference(1, fallback=14.5) == 14.5  # no round over yet: the initial model's norm
    for client, norm in zip("abcde", (1.0, 1.2, 0.9, 1.1, 9000.0), strict=True):  # e: one huge update of five
        history.observe(1, client, norm)
    for _ in range(5):
        history.observe(1, "e", 9000.0)  # more messages of the same client: still one vote
    assert history.reference(2, fallback=14.5) == 1.1  # round 1's median: the attacker did not move it
    for client, norm in zip("abc", (30.0, 31.0, 29.0), strict=True):  # the model moved, the majority's updates grew
        history.observe(2, client, norm)
    history.observe(3, "e", 5000.0)  # a round one client answered alone never enters the history
    assert history.reference(4, fallback=14.5) == 30.0  # the bound follows the majority
    assert history.medians == [1.1, 30.0]
    for client in "abc":
        history.observe(4, client, 2.0)
    assert history.reference(5, fallback=14.5) == 30.0 and history.medians == [30.0, 2.0]  # the last 2 rounds


def test_clipping_also_caps_a_claimed_data_size_at_the_median_weight():
    reference = {"w": torch.zeros(1)}
    states = [{"w": torch.tensor([1.0])}, {"w": torch.tensor([1.0])}, {"w": torch.tensor([-1.0])}]  # last: attacker
    # 2^40 claimed samples would make the attacker the whole mean; capped at the median weight (10) it is one of three.
    assert torch.allclose(robust_average(states, [10, 10, 2**40], reference)["w"], torch.tensor([-1.0]), atol=1e-6)
    assert torch.allclose(
        robust_average(states, [10, 10, 2**40], reference, clip_factor=1.0)["w"], torch.tensor([1 / 3])
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_update_norm_is_the_float64_formula_and_leaves_its_inputs_alone(dtype):
    g = torch.Generator().manual_seed(0)
    reference = {"w": torch.randn(300, 7, generator=g).to(dtype), "b": torch.randn(7, generator=g).to(dtype)}
    state = {k: v + torch.randn(v.shape, generator=g).to(dtype) for k, v in reference.items()}
    kept = {k: v.clone() for k, v in state.items()}
    expected = math.sqrt(sum(float((state[k].double() - reference[k].double()).pow(2).sum()) for k in reference))
    assert update_norm(state, reference) == expected  # the same float64 sums, bit for bit
    assert all(torch.equal(state[k], kept[k]) for k in state)  # a float64 state is not subtracted from in place
    assert (
        update_norm({"w": torch.tensor([3.0]), "b": torch.tensor([4.0])}, {"w": torch.zeros(1), "b": torch.zeros(1)})
        == 5.0
    )
