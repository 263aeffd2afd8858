"""Metrics of fedge.learning.metrics on tiny hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedge.learning.metrics import accuracy, comu_at, entropy, forgetting, mean_entropy, per_class_accuracy


def test_accuracy_numpy_and_torch():
    preds = np.array([0, 1, 2, 2])
    labels = np.array([0, 1, 1, 2])
    assert accuracy(preds, labels) == 0.75
    assert accuracy(torch.tensor([0, 1, 2, 2]), torch.tensor([0, 1, 1, 2])) == 0.75


def test_accuracy_rejects_bad_input():
    with pytest.raises(ValueError, match="empty"):
        accuracy(np.array([], dtype=int), np.array([], dtype=int))
    with pytest.raises(ValueError, match="length"):
        accuracy(np.array([0, 1]), np.array([0]))
    with pytest.raises(ValueError, match="argmax"):
        accuracy(np.zeros((2, 3), dtype=int), np.array([0, 1]))
    with pytest.raises(ValueError, match="integer"):
        accuracy(np.array([0.0, 1.0]), np.array([0, 1]))


def test_per_class_accuracy_with_absent_class():
    # Class 0: 1 of 2 right; class 1: 1 of 1; class 2: no sample -> NaN; class 3: 0 of 1.
    preds = np.array([0, 3, 1, 0])
    labels = np.array([0, 0, 1, 3])
    result = per_class_accuracy(preds, labels, 4)
    np.testing.assert_array_equal(result, [0.5, 1.0, np.nan, 0.0])
    with pytest.raises(ValueError, match="lie in"):
        per_class_accuracy(preds, labels, 3)


def test_forgetting_hand_case():
    # Rounds t = 1, 2, 3 (T = 3), classes 0 and 1:
    #   class 0: A = 0.5, 0.8, 0.6 -> max(0.5 - 0.6, 0.8 - 0.6) = 0.2
    #   class 1: A = 0.2, 0.1, 0.15 -> max(0.2 - 0.15, 0.1 - 0.15) = 0.05
    # F = (0.2 + 0.05) / 2 = 0.125
    history = [np.array([0.5, 0.2]), np.array([0.8, 0.1]), np.array([0.6, 0.15])]
    assert forgetting(history) == pytest.approx(0.125, abs=1e-12)


def test_forgetting_is_negative_when_the_last_round_is_best():
    # eq. 5 taken literally: class 0 improves to 0.9 at the end, max(0.5 - 0.9, 0.7 - 0.9) = -0.2.
    assert forgetting([np.array([0.5]), np.array([0.7]), np.array([0.9])]) == pytest.approx(-0.2, abs=1e-12)


def test_forgetting_edge_cases():
    assert forgetting([]) == 0.0
    assert forgetting([np.array([0.3, 0.4])]) == 0.0
    # Class 1 has no test sample (NaN): left out, C counts class 0 only.
    history: list[np.ndarray | torch.Tensor] = [
        np.array([0.9, np.nan]),
        torch.tensor([0.6, np.nan], dtype=torch.float64),
    ]
    assert forgetting(history) == pytest.approx(0.3, abs=1e-12)
    # NaN in one earlier round only: the other earlier rounds still count.
    assert forgetting([np.array([np.nan]), np.array([0.8]), np.array([0.5])]) == pytest.approx(0.3, abs=1e-12)
    assert forgetting([np.array([np.nan]), np.array([np.nan])]) == 0.0
    with pytest.raises(ValueError, match=r"same classes, got per-class shapes \[\(1,\), \(2,\)\]"):
        forgetting([np.array([0.1, 0.2]), np.array([0.1])])


def test_entropy_uniform_and_one_hot():
    for c in (2, 10, 100):
        assert entropy(np.full(c, 1.0 / c)) == pytest.approx(math.log(c), abs=1e-12)
    assert entropy(np.array([0.0, 1.0, 0.0])) == 0.0
    # 0 log 0 = 0: entropy of [1/2, 1/2, 0] is ln 2.
    assert entropy(torch.tensor([0.5, 0.5, 0.0])) == pytest.approx(math.log(2.0), abs=1e-7)


def test_entropy_rows_axis_and_mean():
    probs = np.array([[0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0]])
    np.testing.assert_allclose(entropy(probs), [math.log(4.0), 0.0], atol=1e-12)
    np.testing.assert_allclose(entropy(probs.T, axis=0), [math.log(4.0), 0.0], atol=1e-12)
    assert mean_entropy(probs) == pytest.approx(math.log(4.0) / 2, abs=1e-12)
    with pytest.raises(ValueError, match="non-negative"):
        entropy(np.array([1.5, -0.5]))


def test_comu_at():
    accs = [0.1, 0.5, 0.7, 0.6]
    sent = [100, 200, 300, 400]
    assert comu_at(accs, sent, 0.5) == 200  # reaching the threshold exactly counts
    assert comu_at(accs, sent, 0.05) == 100
    assert comu_at(accs, sent, 0.65) == 300  # the first round at or above, not the last
    assert comu_at(accs, sent, 0.8) is None  # never reached
    assert comu_at(accs, sent, 0.5, initial_bytes=1_000) == 1_200  # ComU@I added once
    assert comu_at([], [], 0.5) is None


def test_comu_at_rejects_bad_input():
    with pytest.raises(ValueError, match="accuracies"):
        comu_at([0.1, 0.2], [100], 0.5)
    with pytest.raises(ValueError, match="non-decreasing"):
        comu_at([0.1, 0.2], [100, 50], 0.5)
    with pytest.raises(ValueError, match="initial_bytes"):
        comu_at([0.1], [100], 0.5, initial_bytes=-1)
