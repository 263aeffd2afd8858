"""Tests for fedge.data.partition: disjointness, coverage, determinism, scheme-specific shapes and argument
validation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedge.data.partition import (
    PARTITION_SCHEMES,
    class_counts,
    dirichlet,
    iid,
    open_private_split,
    partition,
    shards,
)
from fedge.errors import ConfigError


def balanced_labels(per_class: int, num_classes: int = 10, seed: int = 0) -> np.ndarray:
    """Shuffled labels with exactly ``per_class`` samples of each class."""
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))


def split(labels: np.ndarray, scheme: str, seed: int, num_clients: int = 10) -> list[np.ndarray]:
    return partition(labels, num_clients, scheme=scheme, rng=np.random.default_rng(seed), alpha=0.5, min_size=5)


def assert_well_formed(parts: list[np.ndarray], num_samples: int) -> np.ndarray:
    """Each part is sorted, unique int64 in range and the parts are pairwise disjoint; returns their union."""
    for part in parts:
        assert part.dtype == np.int64 and part.ndim == 1
        assert np.all(np.diff(part) > 0)  # sorted and unique
        assert part.size == 0 or (part[0] >= 0 and part[-1] < num_samples)
    union = np.concatenate(parts)
    assert len(np.unique(union)) == len(union), "parts overlap"
    return np.sort(union)


# ------------------------------------------------------------------------------------------------- all schemes


@pytest.mark.parametrize("scheme", PARTITION_SCHEMES)
def test_deterministic_for_seed_and_different_across_seeds(scheme: str) -> None:
    labels = balanced_labels(100)
    a, b, c = split(labels, scheme, 1), split(labels, scheme, 1), split(labels, scheme, 2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, z) for x, z in zip(a, c, strict=True))


@pytest.mark.parametrize("scheme", PARTITION_SCHEMES)
def test_leaves_global_rng_alone(scheme: str) -> None:
    before = np.random.get_state()[1].copy()  # type: ignore[index]
    split(balanced_labels(50), scheme, 0)
    np.testing.assert_array_equal(np.random.get_state()[1], before)  # type: ignore[index]


@settings(max_examples=60, deadline=None)
@given(
    num_samples=st.integers(24, 400),  # 24 = the most shards asked for (12 clients x 2)
    num_classes=st.integers(1, 12),
    num_clients=st.integers(1, 12),
    scheme=st.sampled_from(PARTITION_SCHEMES),
    seed=st.integers(0, 2**32 - 1),
)
def test_parts_are_disjoint_and_cover(
    num_samples: int, num_classes: int, num_clients: int, scheme: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, num_samples)
    parts = partition(labels, num_clients, scheme=scheme, rng=rng, shards_per_client=2, alpha=1.0, min_size=1)
    assert len(parts) == num_clients
    union = assert_well_formed(parts, num_samples)
    if scheme == "shards":
        num_shards = 2 * num_clients
        assert len(union) == num_samples - num_samples % num_shards
    else:
        np.testing.assert_array_equal(union, np.arange(num_samples))


def test_dispatcher_matches_direct_calls() -> None:
    labels = balanced_labels(30)
    for scheme, direct in [
        ("iid", lambda rng: iid(labels, 6, rng)),
        ("shards", lambda rng: shards(labels, 6, 3, rng)),
        ("dirichlet", lambda rng: dirichlet(labels, 6, 0.3, rng, min_size=4)),
    ]:
        via = partition(
            labels, 6, scheme=scheme, rng=np.random.default_rng(5), shards_per_client=3, alpha=0.3, min_size=4
        )
        expected = direct(np.random.default_rng(5))
        assert all(np.array_equal(x, y) for x, y in zip(via, expected, strict=True)), scheme


def test_unknown_scheme_lists_known_schemes() -> None:
    with pytest.raises(ConfigError) as info:
        partition(balanced_labels(10), 2, scheme="pathological", rng=np.random.default_rng(0))
    assert all(name in str(info.value) for name in PARTITION_SCHEMES)


# ------------------------------------------------------------------------------------------------------------- iid


def test_iid_sizes_differ_by_at_most_one() -> None:
    parts = iid(np.zeros(103, dtype=np.int64), 10, np.random.default_rng(0))
    sizes = [len(p) for p in parts]
    assert sum(sizes) == 103 and max(sizes) - min(sizes) <= 1


# ---------------------------------------------------------------------------------------------------------- shards


def test_shards_class_pure_gives_equal_sizes_and_at_most_s_classes() -> None:
    labels = balanced_labels(100)  # 10 classes x 100; 10 clients x 2 shards -> 50-sample class-pure shards
    parts = shards(labels, 10, 2, np.random.default_rng(0))
    assert all(len(p) == 2 * 50 for p in parts)
    counts = class_counts(labels, parts, 10)
    assert np.all((counts > 0).sum(axis=1) <= 2)
    assert np.all(np.isin(counts, [0, 50, 100]))  # whole shards of a single class
    np.testing.assert_array_equal(assert_well_formed(parts, len(labels)), np.arange(len(labels)))


def test_shards_drop_the_remainder_at_the_end_of_the_label_order() -> None:
    # 1003 samples: 7 clients x 3 shards = 21 shards of 47, so 16 are left over.
    labels = np.concatenate([balanced_labels(100, seed=3), [9, 9, 2]])
    parts = shards(labels, 7, 3, np.random.default_rng(0))
    assert all(len(p) == 3 * 47 for p in parts)
    union = assert_well_formed(parts, len(labels))
    dropped = np.setdiff1d(np.arange(len(labels)), union)
    np.testing.assert_array_equal(dropped, np.sort(np.argsort(labels, kind="stable")[-16:]))
    assert np.all(labels[dropped] == 9)


def test_shards_that_do_not_fit() -> None:
    with pytest.raises(ConfigError, match="do not fit in 30 samples"):
        shards(np.zeros(30, dtype=np.int64), 10, 4, np.random.default_rng(0))
    with pytest.raises(ConfigError, match="shards_per_client"):
        shards(np.zeros(30, dtype=np.int64), 3, 0, np.random.default_rng(0))


# ------------------------------------------------------------------------------------------------------- dirichlet


@pytest.mark.parametrize("balance", [True, False])
def test_dirichlet_respects_min_size_and_covers(balance: bool) -> None:
    labels = balanced_labels(200)
    # With this seed the first draw leaves a client short (both variants), so this also exercises resampling.
    with pytest.raises(ConfigError, match="below min_size=30 in 1 tries"):
        dirichlet(labels, 20, 0.2, np.random.default_rng(0), min_size=30, max_tries=1, balance=balance)
    parts = dirichlet(labels, 20, 0.2, np.random.default_rng(0), min_size=30, balance=balance)
    assert min(len(p) for p in parts) >= 30
    np.testing.assert_array_equal(assert_well_formed(parts, len(labels)), np.arange(len(labels)))


def test_dirichlet_smaller_alpha_means_more_label_skew() -> None:
    labels = balanced_labels(300)

    def mean_classes_per_client(alpha: float) -> float:
        parts = dirichlet(labels, 20, alpha, np.random.default_rng(0), min_size=5)
        return float((class_counts(labels, parts, 10) > 0).sum(axis=1).mean())

    skewed, mild, near_iid = mean_classes_per_client(0.05), mean_classes_per_client(0.5), mean_classes_per_client(100.0)
    assert skewed < mild < near_iid
    assert near_iid == 10.0 and skewed < 4.0


def test_dirichlet_impossible_min_size() -> None:
    with pytest.raises(ConfigError, match="needs 110 samples but there are only 100"):
        dirichlet(balanced_labels(10), 11, 0.5, np.random.default_rng(0), min_size=10)


def test_dirichlet_gives_up_after_max_tries() -> None:
    labels = balanced_labels(60)  # 600 samples, 50 clients x 10 fit on paper, but alpha=0.01 is far too skewed
    with pytest.raises(ConfigError, match="in 3 tries; raise alpha"):
        dirichlet(labels, 50, 0.01, np.random.default_rng(0), min_size=10, max_tries=3)


@pytest.mark.parametrize(
    ("alpha", "min_size", "max_tries", "named"),
    [(0.0, 1, 5, "alpha"), (-1.0, 1, 5, "alpha"), (0.5, -1, 5, "min_size"), (0.5, 1, 0, "max_tries")],
)
def test_dirichlet_rejects_bad_arguments(alpha: float, min_size: int, max_tries: int, named: str) -> None:
    with pytest.raises(ConfigError, match=f"^{named} must be"):
        dirichlet(balanced_labels(10), 5, alpha, np.random.default_rng(0), min_size=min_size, max_tries=max_tries)


# ------------------------------------------------------------------------------------------------ open / private


def test_open_private_split_is_disjoint_with_exact_sizes() -> None:
    open_set, private_set = open_private_split(1000, 300, 500, np.random.default_rng(0))
    assert (len(open_set), len(private_set)) == (300, 500)
    assert_well_formed([open_set, private_set], 1000)
    again = open_private_split(1000, 300, 500, np.random.default_rng(0))
    np.testing.assert_array_equal(again[0], open_set)
    np.testing.assert_array_equal(again[1], private_set)


def test_open_private_split_can_use_every_sample() -> None:
    open_set, private_set = open_private_split(10, 4, 6, np.random.default_rng(1))
    np.testing.assert_array_equal(np.sort(np.concatenate([open_set, private_set])), np.arange(10))


@pytest.mark.parametrize(
    ("open_size", "private_size", "says"),
    [(6, 5, "exceeds the 10 available samples"), (-1, 3, "must be >= 0, got -1 and 3"), (3, -1, "got 3 and -1")],
)
def test_open_private_split_rejects_bad_sizes(open_size: int, private_size: int, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        open_private_split(10, open_size, private_size, np.random.default_rng(0))


# -------------------------------------------------------------------------------------------------- class counts


def test_class_counts_hand_computed() -> None:
    labels = np.array([0, 1, 1, 2, 2, 2])
    counts = class_counts(labels, [np.array([0, 3]), np.array([1, 2, 4, 5]), np.array([], dtype=np.int64)], 4)
    np.testing.assert_array_equal(counts, [[1, 0, 1, 0], [0, 2, 2, 0], [0, 0, 0, 0]])
    assert counts.dtype == np.int64


def test_class_counts_sum_to_part_sizes_and_class_totals() -> None:
    labels = balanced_labels(40, num_classes=5)
    parts = iid(labels, 7, np.random.default_rng(0))
    counts = class_counts(labels, parts, 5)
    assert counts.shape == (7, 5)
    np.testing.assert_array_equal(counts.sum(axis=1), [len(p) for p in parts])
    np.testing.assert_array_equal(counts.sum(axis=0), np.bincount(labels, minlength=5))


def test_class_counts_rejects_labels_beyond_num_classes() -> None:
    with pytest.raises(ConfigError, match="num_classes=2"):
        class_counts(np.array([0, 1, 2]), [np.array([0])], 2)


# ------------------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize("scheme", PARTITION_SCHEMES)
def test_rejects_bad_client_counts(scheme: str) -> None:
    with pytest.raises(ConfigError, match="num_clients must be >= 1"):
        partition(balanced_labels(10), 0, scheme=scheme, rng=np.random.default_rng(0))
    with pytest.raises(ConfigError, match="5 samples"):
        partition(np.zeros(5, dtype=np.int64), 6, scheme=scheme, rng=np.random.default_rng(0), min_size=0)


@pytest.mark.parametrize(
    ("labels", "match"),
    [
        (np.zeros((4, 2), dtype=np.int64), "1-D integer array"),
        (np.zeros(8, dtype=np.float32), "1-D integer array"),
        (np.array([0, -1, 1, 2]), "non-negative"),
    ],
)
def test_rejects_bad_labels(labels: np.ndarray, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        iid(labels, 2, np.random.default_rng(0))
