"""Shared by the secure-aggregation tests: a seeded stand-in for os.urandom, so every run draws the same keys."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from secagg_support import seeded_bytes

RandBytesFactory = Callable[[int], Callable[[int], bytes]]


@pytest.fixture
def seeded() -> RandBytesFactory:
    """``seeded(seed)``: a deterministic ``rand_bytes`` (tests only; real rounds use os.urandom)."""
    return seeded_bytes
