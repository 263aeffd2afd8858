"""Aggregation of weights and outputs in fedge.aggregation.average, on tiny hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedge.aggregation.average import aggregate_era, aggregate_sa, fd_global_logits, fd_leave_one_out, weighted_average
from fedge.errors import ConfigError
from fedge.learning.metrics import mean_entropy

# --- FedAvg (FedNTD eq. 2, DS-FL eq. 3) ---------------------------------------------------------------------------


def test_weighted_average_hand_case():
    # n = (1, 3): 0.25 * client 0 + 0.75 * client 1.
    #   w: 0.25 * [1, 2] + 0.75 * [3, 6] = [2.5, 5.0];  b: 0.75 * 4 = 3.0
    #   steps (int64): 0.25 * 2 + 0.75 * 7 = 5.75 -> rounded to 6
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0]), "steps": torch.tensor(2)}
    b = {"w": torch.tensor([3.0, 6.0]), "b": torch.tensor([4.0]), "steps": torch.tensor(7)}
    out = weighted_average([a, b], [1, 3])
    assert list(out) == ["w", "b", "steps"]
    assert torch.equal(out["w"], torch.tensor([2.5, 5.0]))
    assert torch.equal(out["b"], torch.tensor([3.0]))
    assert torch.equal(out["steps"], torch.tensor(6))
    assert out["w"].dtype == torch.float32 and out["steps"].dtype == torch.int64


def test_weighted_average_equal_weights_is_mean_and_deterministic():
    gen = torch.Generator().manual_seed(0)
    states = [{"conv": torch.randn(4, 3, 3, generator=gen), "fc": torch.randn(10, generator=gen)} for _ in range(5)]
    out = weighted_average(states, [7] * 5)
    for key in ("conv", "fc"):
        torch.testing.assert_close(out[key], torch.stack([s[key] for s in states]).mean(0))
    again = weighted_average(states, [7] * 5)
    assert all(torch.equal(out[k], again[k]) for k in out)


def test_weighted_average_keeps_low_precision_dtype():
    states = [{"w": torch.tensor([1.0], dtype=torch.float16)}, {"w": torch.tensor([2.0], dtype=torch.float16)}]
    out = weighted_average(states, [1.0, 1.0])
    assert out["w"].dtype == torch.float16
    assert out["w"].item() == 1.5


def test_weighted_average_rejects_mismatches():
    a = {"w": torch.zeros(2), "b": torch.zeros(1)}
    with pytest.raises(ValueError, match="'b'"):
        weighted_average([a, {"w": torch.zeros(2)}], [1, 1])
    with pytest.raises(ValueError, match="'w'"):
        weighted_average([a, {"w": torch.zeros(3), "b": torch.zeros(1)}], [1, 1])
    with pytest.raises(ValueError, match="weights"):
        weighted_average([a, a], [1])
    with pytest.raises(ValueError, match="all be zero"):
        weighted_average([a, a], [0, 0])
    with pytest.raises(ValueError, match=">= 0"):
        weighted_average([a, a], [1, -1])
    with pytest.raises(ValueError, match="at least one"):
        weighted_average([], [])


# --- FD (DS-FL eq. 5-6) -------------------------------------------------------------------------------------------

# Three clients, three classes; row n of t_k is client k's average softmax output on its samples of class n (eq. 4),
# zero for classes it does not hold. Class 0 is held by all three, class 1 by client B only, class 2 by nobody.
T_A = torch.tensor([[0.5, 0.25, 0.25], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
T_B = torch.tensor([[0.75, 0.25, 0.0], [0.25, 0.5, 0.25], [0.0, 0.0, 0.0]], dtype=torch.float64)
T_C = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
N_A = torch.tensor([4, 0, 0])
N_B = torch.tensor([2, 3, 0])
N_C = torch.tensor([1, 0, 0])


def test_fd_global_logits_hand_case():
    # Class 0: K_0 = {A, B, C}, unweighted by sample counts (eq. 5):
    #   ([0.5, 0.25, 0.25] + [0.75, 0.25, 0] + [1, 0, 0]) / 3 = [0.75, 1/6, 1/12]
    # Class 1: K_1 = {B}: B's row. Class 2: K_2 = {}: zero row.
    global_t, contributors = fd_global_logits([T_A, T_B, T_C], [N_A, N_B, N_C])
    expected = torch.tensor([[0.75, 1 / 6, 1 / 12], [0.25, 0.5, 0.25], [0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(global_t, expected, rtol=0.0, atol=1e-15)
    assert torch.equal(contributors, torch.tensor([3, 1, 0]))
    assert contributors.dtype == torch.int64


def test_fd_global_logits_ignores_rows_of_classes_a_client_does_not_hold():
    noisy_a = T_A.clone()
    noisy_a[1] = torch.tensor([0.9, 0.05, 0.05], dtype=torch.float64)
    global_t, _ = fd_global_logits([noisy_a, T_B, T_C], [N_A, N_B, N_C])
    torch.testing.assert_close(global_t[1], T_B[1], rtol=0.0, atol=0.0)


def test_fd_leave_one_out_hand_case():
    global_t, contributors = fd_global_logits([T_A, T_B, T_C], [N_A, N_B, N_C])

    # Client A, class 0: (3 * [0.75, 1/6, 1/12] - [0.5, 0.25, 0.25]) / 2 = [0.875, 0.125, 0] = mean of B and C.
    # Class 1: A holds none, so the global row (B's) is already others-only. Class 2: nobody, zero row.
    targets, has_target = fd_leave_one_out(global_t, contributors, T_A, N_A)
    expected = torch.tensor([[0.875, 0.125, 0.0], [0.25, 0.5, 0.25], [0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(targets, expected, rtol=0.0, atol=1e-15)
    assert has_target.tolist() == [True, True, False]

    # Client B, class 0: mean of A and C = [0.75, 0.125, 0.125].
    # Class 1: B is the only holder (|K_1| = 1): eq. 6 is undefined; fall back to the global row (B's own), no target.
    targets, has_target = fd_leave_one_out(global_t, contributors, T_B, N_B)
    expected = torch.tensor([[0.75, 0.125, 0.125], [0.25, 0.5, 0.25], [0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(targets, expected, rtol=0.0, atol=1e-15)
    assert has_target.tolist() == [True, False, False]
    assert not torch.isnan(targets).any()


def test_fd_leave_one_out_for_a_client_outside_the_average():
    # A client that did not report this round: the global rows are others-only already.
    global_t, contributors = fd_global_logits([T_A, T_B], [N_A, N_B])
    own = torch.tensor([[0.2, 0.8, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    targets, has_target = fd_leave_one_out(global_t, contributors, own, torch.tensor([5, 5, 0]), own_included=False)
    assert torch.equal(targets, global_t)
    assert has_target.tolist() == [True, True, False]


def test_fd_leave_one_out_rejects_inconsistent_input():
    global_t, contributors = fd_global_logits([T_A, T_B, T_C], [N_A, N_B, N_C])
    # The client claims samples of class 2 but nobody contributed to class 2: its outputs were not aggregated.
    with pytest.raises(ValueError, match="own_included=False"):
        fd_leave_one_out(global_t, contributors, T_A, torch.tensor([4, 0, 1]))
    with pytest.raises(ValueError, match="own_logits"):
        fd_leave_one_out(global_t, contributors, T_A[:2], N_A)
    with pytest.raises(ValueError, match="own_counts"):
        fd_leave_one_out(global_t, contributors, T_A, N_A[:2])


def test_fd_global_logits_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        fd_global_logits([], [])
    with pytest.raises(ValueError, match="counts"):
        fd_global_logits([T_A, T_B], [N_A])
    with pytest.raises(ValueError, match=r"\(C, C\)"):
        fd_global_logits([T_A[:2], T_B[:2]], [N_A, N_B])
    with pytest.raises(ValueError, match=">= 0"):
        fd_global_logits([T_A], [torch.tensor([1, -1, 0])])


# --- SA and ERA (DS-FL eq. 13-16) ---------------------------------------------------------------------------------


def test_sa_is_the_mean():
    a = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    b = torch.tensor([[0.25, 0.75], [0.0, 1.0]])
    assert torch.equal(aggregate_sa([a, b]), torch.tensor([[0.375, 0.625], [0.5, 0.5]]))


def test_era_hand_case():
    # mean = [0.6, 0.4]; softmax([0.6, 0.4] / 0.1) = softmax([6, 4]) = [1, e^-2] / (1 + e^-2).
    a = torch.tensor([[0.8, 0.2]], dtype=torch.float64)
    b = torch.tensor([[0.4, 0.6]], dtype=torch.float64)
    e = np.exp(-2.0)
    expected = torch.tensor([[1 / (1 + e), e / (1 + e)]], dtype=torch.float64)
    torch.testing.assert_close(aggregate_era([a, b], temperature=0.1), expected)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_era_lowers_entropy_of_non_iid_predictions(seed):
    # Ten clients, each trained on two classes (non-IID). On an open sample of class y, the two clients holding y
    # predict y confidently and the other eight confidently predict their own classes. The average (SA) peaks on y but
    # is spread out (DS-FL Fig. 3); ERA's softmax at T = 0.1 sharpens the peak (DS-FL 3.2).
    # Not a property of every input: with C = 10 and T = 0.1 = 1/C, softmax(p / T) is close to p near the uniform
    # vector, so an average without a clear peak is left nearly as is, and an almost one-hot one gets softer.
    rng = np.random.default_rng(seed)
    num_clients, num_samples, num_classes = 10, 200, 10
    held = [[k, (k + 1) % num_classes] for k in range(num_clients)]
    true_class = rng.integers(0, num_classes, size=num_samples)
    client_probs = []
    for classes in held:
        rows = []
        for y in true_class:
            concentration = np.full(num_classes, 0.1)
            concentration[[y] if y in classes else classes] = 10.0
            rows.append(rng.dirichlet(concentration))
        client_probs.append(torch.from_numpy(np.stack(rows)))
    sa = aggregate_sa(client_probs)
    era = aggregate_era(client_probs, temperature=0.1)
    assert era.shape == (num_samples, num_classes)
    torch.testing.assert_close(era.sum(dim=1), torch.ones(num_samples, dtype=era.dtype))
    assert mean_entropy(era) < mean_entropy(sa)


def test_aggregation_of_outputs_rejects_bad_input():
    with pytest.raises(ValueError, match="empty"):
        aggregate_sa([])
    with pytest.raises(ValueError, match="shape"):
        aggregate_sa([torch.zeros(2, 3), torch.zeros(3, 3)])
    with pytest.raises(ConfigError, match="temperature"):
        aggregate_era([torch.zeros(2, 3)], temperature=0.0)
