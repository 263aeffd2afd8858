"""Shared by the secure-aggregation tests: a seeded stand-in for os.urandom, so every run draws the same keys."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

RandBytesFactory = Callable[[int], Callable[[int], bytes]]


def _seeded_bytes(seed: int) -> Callable[[int], bytes]:
    gen = np.random.default_rng(seed)
    return lambda n: gen.bytes(n)


@pytest.fixture
def seeded() -> RandBytesFactory:
    """``seeded(seed)``: a deterministic ``rand_bytes`` (tests only; real rounds use os.urandom)."""
    return _seeded_bytes
