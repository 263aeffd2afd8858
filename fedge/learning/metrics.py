"""Evaluation metrics: accuracy, per-class accuracy, forgetting, entropy and communication cost to reach an accuracy.

- Forgetting ``F``: FedNTD eq. 5, a backward-transfer measure on the global model's class-wise test accuracy.
- Entropy of a probability vector: DS-FL eq. 12, used to compare SA and ERA aggregation (DS-FL Fig. 3).
- ComU@x: DS-FL Table III, the cumulative communication needed to first reach an accuracy of x.

Inputs may be numpy arrays or torch tensors; results are Python floats or float64 numpy arrays.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["accuracy", "comu_at", "entropy", "forgetting", "mean_entropy", "per_class_accuracy"]

ArrayLike = np.ndarray | torch.Tensor | Sequence[float]


def accuracy(preds: ArrayLike, labels: ArrayLike) -> float:
    """Fraction of predicted class indices equal to the labels; both 1-D of the same length, not empty."""
    p, y = _labels_pair(preds, labels)
    if y.size == 0:
        raise ValueError("accuracy of an empty set is undefined")
    return float(np.mean(p == y))


def per_class_accuracy(preds: ArrayLike, labels: ArrayLike, num_classes: int) -> np.ndarray:
    """Accuracy on the samples of each class, shape (C,); NaN for a class with no sample in ``labels``."""
    p, y = _labels_pair(preds, labels)
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got [{y.min()}, {y.max()}]")
    totals = np.bincount(y, minlength=num_classes)  # (C,)
    correct = np.bincount(y[p == y], minlength=num_classes)  # (C,)
    result = np.full(num_classes, np.nan)
    np.divide(correct, totals, out=result, where=totals > 0)
    return result


def forgetting(per_class_history: Sequence[ArrayLike]) -> float:
    """Forgetting, FedNTD eq. 5: ``F = (1/C) sum_c max_{t in 1..T-1} (A_c^(t) - A_c^(T))``.

    ``per_class_history[t]`` is the per-class accuracy (C,) after round t+1; the last entry is round T. The formula is
    followed literally: a class whose last round is its best contributes a negative term, so F can be negative.
    Classes that are NaN in the last round, or in every earlier round, are left out and C counts the others.
    Returns 0.0 when there is nothing to compare (fewer than 2 rounds, or no class measured in both).
    """
    if len(per_class_history) < 2:
        return 0.0
    rows = [_as_float_array(a) for a in per_class_history]
    shapes = {r.shape for r in rows}
    if len(shapes) > 1:
        raise ValueError(f"every round needs the same classes, got per-class shapes {sorted(shapes)}")
    history = np.stack(rows)  # (T, C)
    if history.ndim != 2:
        raise ValueError(f"each entry must be a 1-D per-class accuracy vector, got stacked shape {history.shape}")
    final = history[-1]  # (C,)
    earlier = history[:-1]  # (T-1, C)
    measured = ~np.isnan(final) & ~np.all(np.isnan(earlier), axis=0)  # (C,)
    if not measured.any():
        return 0.0
    drops = np.nanmax(earlier[:, measured], axis=0) - final[measured]  # (C',)
    return float(np.mean(drops))


def entropy(probs: ArrayLike, axis: int = -1) -> np.ndarray:
    """Entropy ``-sum_n t_n log t_n`` along ``axis`` in nats, DS-FL eq. 12, with ``0 log 0 = 0``."""
    t = _as_float_array(probs)
    if np.any(t < 0) or np.any(np.isnan(t)):
        raise ValueError("probabilities must be non-negative and not NaN")
    log_t = np.zeros_like(t)
    np.log(t, out=log_t, where=t > 0)
    return -np.sum(t * log_t, axis=axis)


def mean_entropy(probs: ArrayLike) -> float:
    """Mean over samples of the entropy of each row of ``probs`` (N, C), as plotted in DS-FL Fig. 3."""
    return float(np.mean(entropy(probs, axis=-1)))


def comu_at(
    accuracies: Sequence[float], cumulative_bytes: Sequence[int], threshold: float, initial_bytes: int = 0
) -> int | None:
    """ComU@x, DS-FL Table III: bytes communicated until the accuracy first reaches ``threshold``; None if never.

    ``accuracies[r]`` and ``cumulative_bytes[r]`` are measured after round r+1, in the same unit as ``threshold``.
    ``initial_bytes`` is a one-time cost before training (ComU@I, DS-FL's open-data distribution) and is added.
    """
    if len(accuracies) != len(cumulative_bytes):
        raise ValueError(f"got {len(accuracies)} accuracies but {len(cumulative_bytes)} byte counts")
    if initial_bytes < 0:
        raise ValueError(f"initial_bytes must be >= 0, got {initial_bytes}")
    if any(b < 0 for b in cumulative_bytes) or any(b1 < b0 for b0, b1 in itertools.pairwise(cumulative_bytes)):
        raise ValueError("cumulative_bytes must be non-negative and non-decreasing (cumulative, not per round)")
    for acc, sent in zip(accuracies, cumulative_bytes, strict=True):
        if acc >= threshold:
            return int(initial_bytes) + int(sent)
    return None


def _as_numpy(values: ArrayLike) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy()
    return np.asarray(values)


def _as_float_array(values: ArrayLike) -> np.ndarray:
    return _as_numpy(values).astype(np.float64)


def _labels_pair(preds: ArrayLike, labels: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    p = _as_numpy(preds)
    y = _as_numpy(labels)
    if p.ndim != 1 or y.ndim != 1:
        raise ValueError(
            f"preds and labels must be 1-D class indices (take argmax of scores first), got {p.shape} and {y.shape}"
        )
    if p.shape != y.shape:
        raise ValueError(f"preds and labels differ in length: {p.shape[0]} vs {y.shape[0]}")
    for name, a in (("preds", p), ("labels", y)):
        # An empty list arrives as float64; only non-empty input has a meaningful dtype.
        if a.size and not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"{name} must be integer class indices, got dtype {a.dtype}")
    return p.astype(np.int64), y.astype(np.int64)
