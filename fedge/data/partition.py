"""Split a labelled dataset across clients: IID, label shards and Dirichlet label skew, plus DS-FL's open/private split.

- ``iid``: a uniform random split into near-equal parts.
- ``shards``: the pathological non-IID split of McMahan et al. 2017 (FedAvg, Sec. 3), also FedNTD (Lee et al. 2022)
  App. B.5 "Sharding" and DS-FL (Itahara et al. 2021) Sec. 4.1: sort by label, cut into ``K * s`` equal shards, deal
  ``s`` shards to each client.
- ``dirichlet``: FedNTD App. B.5 "Latent Dirichlet Allocation (LDA)": for each class ``c`` draw ``p_c ~ Dir_K(alpha)``
  and give client ``k`` a ``p_c[k]`` fraction of class ``c``; smaller ``alpha`` means more skew.
- ``open_private_split``: DS-FL Sec. 4.1: a disjoint unlabeled open set ``I^o`` shared by all clients and a labeled
  private set ``I^p`` that is then partitioned across clients.

Every function is deterministic given the ``numpy.random.Generator`` passed in and returns sorted int64 index arrays.
"""

from __future__ import annotations

import numpy as np

from fedge.errors import ConfigError
from fedge.types import IndexArray

__all__ = [
    "PARTITION_SCHEMES",
    "class_counts",
    "dirichlet",
    "iid",
    "open_private_split",
    "partition",
    "shards",
]

PARTITION_SCHEMES: tuple[str, ...] = ("iid", "shards", "dirichlet")
"""Scheme names :func:`partition` accepts."""


def _check_labels(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not (labels.dtype.kind in "iu" or labels.size == 0):
        raise ConfigError(f"labels must be a 1-D integer array, got dtype {labels.dtype} and shape {labels.shape}")
    if labels.size and labels.min() < 0:
        raise ConfigError(f"labels must be non-negative, found {labels.min()}")
    return labels.astype(np.int64, copy=False)


def _check_clients(num_clients: int, num_samples: int) -> None:
    if num_clients < 1:
        raise ConfigError(f"num_clients must be >= 1, got {num_clients}")
    if num_samples < num_clients:
        raise ConfigError(
            f"cannot split {num_samples} samples across {num_clients} clients; use at most {num_samples} clients"
        )


def _sorted_parts(parts: list[np.ndarray]) -> list[IndexArray]:
    return [np.sort(p).astype(np.int64, copy=False) for p in parts]


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[IndexArray]:
    """A uniformly random split of all samples into ``num_clients`` parts whose sizes differ by at most one."""
    labels = _check_labels(labels)
    _check_clients(num_clients, len(labels))
    return _sorted_parts(np.array_split(rng.permutation(len(labels)), num_clients))


def shards(labels: np.ndarray, num_clients: int, shards_per_client: int, rng: np.random.Generator) -> list[IndexArray]:
    """Label-sorted shards, ``shards_per_client`` per client, dealt at random without overlap.

    The samples are sorted by label (stable) and cut into ``num_clients * shards_per_client`` equal shards; the
    ``len(labels) % (num_clients * shards_per_client)`` samples at the end of that order are dropped so every client
    gets the same number of samples.
    """
    labels = _check_labels(labels)
    if num_clients < 1:
        raise ConfigError(f"num_clients must be >= 1, got {num_clients}")
    if shards_per_client < 1:
        raise ConfigError(f"shards_per_client must be >= 1, got {shards_per_client}")
    num_shards = num_clients * shards_per_client
    shard_size = len(labels) // num_shards
    if shard_size == 0:
        raise ConfigError(
            f"{num_clients} clients x {shards_per_client} shards = {num_shards} shards do not fit in {len(labels)} "
            f"samples; lower num_clients or shards_per_client"
        )
    order = np.argsort(labels, kind="stable")[: num_shards * shard_size]
    shard_of = order.reshape(num_shards, shard_size)  # (num_shards, shard_size), each row one shard
    dealt = rng.permutation(num_shards).reshape(num_clients, shards_per_client)  # (K, s) shard ids per client
    return _sorted_parts([shard_of[ids].ravel() for ids in dealt])


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    *,
    min_size: int = 10,
    max_tries: int = 100,
    balance: bool = True,
) -> list[IndexArray]:
    """A label-skewed split: each class is divided among clients by proportions drawn from ``Dir_K(alpha)``.

    With ``balance`` (as in FedNTD's and NIID-Bench's reference code), a client that already holds ``N / K`` samples
    gets no share of later classes. Draws are repeated until every client holds at least ``min_size`` samples;
    :class:`ConfigError` if that cannot happen or has not happened within ``max_tries`` draws.
    """
    labels = _check_labels(labels)
    _check_clients(num_clients, len(labels))
    if not alpha > 0:
        raise ConfigError(f"alpha must be > 0, got {alpha}")
    if min_size < 0:
        raise ConfigError(f"min_size must be >= 0, got {min_size}")
    if max_tries < 1:
        raise ConfigError(f"max_tries must be >= 1, got {max_tries}")
    if min_size * num_clients > len(labels):
        raise ConfigError(
            f"min_size={min_size} per client x {num_clients} clients needs {min_size * num_clients} samples but "
            f"there are only {len(labels)}; lower min_size or num_clients"
        )
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    fair_share = len(labels) / num_clients
    for _ in range(max_tries):
        chunks: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)  # (K,) samples dealt so far
        for members in by_class:
            members = rng.permutation(members)
            proportions = rng.dirichlet(np.full(num_clients, alpha))  # (K,)
            if balance:
                capped = proportions * (sizes < fair_share)
                # With tiny alpha every open client's draw can underflow to 0; then keep the uncapped draw.
                if capped.sum() > 0:
                    proportions = capped / capped.sum()
            # Cut points from the cumulative proportions, so the class is split exactly with no sample lost.
            cuts = (np.cumsum(proportions)[:-1] * len(members)).astype(np.int64)
            for k, part in enumerate(np.split(members, cuts)):
                chunks[k].append(part)
                sizes[k] += len(part)
        parts = [np.concatenate(c) for c in chunks]
        if min(len(p) for p in parts) >= min_size:
            return _sorted_parts(parts)
    raise ConfigError(
        f"dirichlet split with alpha={alpha} left some of the {num_clients} clients below min_size={min_size} "
        f"in {max_tries} tries; raise alpha, lower min_size or num_clients, or raise max_tries"
    )


def open_private_split(
    num_samples: int, open_size: int, private_size: int, rng: np.random.Generator
) -> tuple[IndexArray, IndexArray]:
    """Disjoint random index sets ``(open, private)`` of exactly ``open_size`` and ``private_size`` samples."""
    if open_size < 0 or private_size < 0:
        raise ConfigError(f"open_size and private_size must be >= 0, got {open_size} and {private_size}")
    if open_size + private_size > num_samples:
        raise ConfigError(
            f"open_size={open_size} + private_size={private_size} exceeds the {num_samples} available samples; "
            f"shrink one of them"
        )
    order = rng.permutation(num_samples)
    open_set, private_set = _sorted_parts([order[:open_size], order[open_size : open_size + private_size]])
    return open_set, private_set


def class_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """Per-client label histogram, shape ``(len(parts), num_classes)`` int64."""
    labels = _check_labels(labels)
    if labels.size and labels.max() >= num_classes:
        raise ConfigError(f"labels go up to {labels.max()} but num_classes={num_classes}")
    counts = np.zeros((len(parts), num_classes), dtype=np.int64)  # (K, C)
    for k, part in enumerate(parts):
        counts[k] = np.bincount(labels[np.asarray(part, dtype=np.int64)], minlength=num_classes)
    return counts


def partition(
    labels: np.ndarray,
    num_clients: int,
    *,
    scheme: str,
    rng: np.random.Generator,
    shards_per_client: int = 2,
    alpha: float = 0.1,
    min_size: int = 10,
) -> list[IndexArray]:
    """Client index sets from the scheme named ``scheme`` (one of :data:`PARTITION_SCHEMES`)."""
    if scheme == "iid":
        return iid(labels, num_clients, rng)
    if scheme == "shards":
        return shards(labels, num_clients, shards_per_client, rng)
    if scheme == "dirichlet":
        return dirichlet(labels, num_clients, alpha, rng, min_size=min_size)
    raise ConfigError(f"unknown partition scheme {scheme!r}; known schemes: {', '.join(PARTITION_SCHEMES)}")
