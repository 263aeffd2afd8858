"""Fixed-point ring encoding: the plan's arithmetic by hand, round-trip error, clipping, no overflow at the cohort
size, two's complement, unbiased stochastic rounding."""

from __future__ import annotations

import numpy as np
import pytest

from fedge.secagg.encoding import RingPlan, decode, encode, head_room_bits, ring_plan, ring_sum
from fedge.secagg.errors import EncodingError, SecAggConfigError


def test_plan_by_hand() -> None:
    # 10 clients: head-room ceil(log2 10) + 1 = 5 bits; a 16-bit ring leaves 11, so a code is at most 2047:
    # 1.0 * 2^10 = 1024 fits, 1.0 * 2^11 = 2048 does not.
    assert head_room_bits(10) == 5
    plan = ring_plan(1.0, 10, 16)
    assert (plan.frac_bits, plan.max_code, plan.resolution) == (10, 1024, 2.0**-10)
    # 1000 clients in 32 bits: head-room 11, codes up to 2^21 - 1; bound 3 -> 3 * 2^19 = 1572864 fits, 2^20 not.
    assert ring_plan(3.0, 1000).frac_bits == 19
    assert ring_plan(1.0, 1).frac_bits == 30  # one client: one sign bit only


def test_plan_refuses_a_ring_too_small() -> None:
    with pytest.raises(SecAggConfigError, match="fewer than 4"):
        ring_plan(100.0, 1000, 16)
    with pytest.raises(SecAggConfigError, match="no room"):
        ring_plan(1.0, 2**20, 16)
    with pytest.raises(SecAggConfigError, match="positive"):
        ring_plan(float("nan"), 10)
    with pytest.raises(SecAggConfigError, match="overflow"):
        RingPlan(bound=1.0, ring_bits=16, frac_bits=12, cohort_size=10)  # 10 * 4096 >= 2^15


@pytest.mark.parametrize(("bound", "cohort", "bits"), [(1.0, 10, 32), (0.7, 1000, 32), (2.5, 100, 16)])
def test_round_trip_within_one_step(bound: float, cohort: int, bits: int) -> None:
    plan = ring_plan(bound, cohort, bits)
    x = np.random.default_rng(0).uniform(-bound, bound, size=5000)
    back = decode(encode(x, plan, rng=np.random.default_rng(1)), plan)
    assert np.abs(back - x).max() < plan.resolution


def test_clipping() -> None:
    plan = ring_plan(1.0, 10)
    back = decode(encode([-5.0, -1.0, 0.25, 1.0, 7.0], plan, rng=np.random.default_rng(0)), plan)
    np.testing.assert_array_equal(back, [-1.0, -1.0, 0.25, 1.0, 1.0])  # all on the fixed-point grid: exact


def test_twos_complement_by_hand() -> None:
    plan = RingPlan(bound=1.0, ring_bits=8, frac_bits=2, cohort_size=1)
    codes = encode([-0.5, 0.75, -1.0], plan)
    np.testing.assert_array_equal(codes, [256 - 2, 3, 256 - 4])
    np.testing.assert_array_equal(decode(codes, plan), [-0.5, 0.75, -1.0])


@pytest.mark.parametrize("bits", [32, 16])
def test_no_overflow_at_the_cohort_size(bits: int) -> None:
    # The worst case: every client at +bound (every code rounded up to the largest), then every one at -bound.
    cohort, bound = 1000, 0.7
    plan = ring_plan(bound, cohort, bits, min_frac_bits=1)
    assert cohort * plan.max_code < 2 ** (bits - 1)
    top = np.full(1, plan.max_code, dtype=np.int64)
    for sign in (1, -1):
        codes = [((sign * top) & plan.mask).astype(np.uint32)] * cohort
        total = decode(ring_sum(codes, bits, 1), plan)
        assert total[0] == sign * cohort * plan.max_code * plan.resolution
    # Encoded values at the bound add up to about cohort * bound with the right sign.
    x = np.full(3, bound)
    rng = np.random.default_rng(0)
    total = decode(ring_sum((encode(x, plan, rng=rng) for _ in range(cohort)), bits, 3), plan)
    np.testing.assert_allclose(total, cohort * bound, atol=cohort * plan.resolution)


def test_stochastic_rounding_is_unbiased() -> None:
    plan = RingPlan(bound=1.0, ring_bits=32, frac_bits=2, cohort_size=1)
    x = np.full(200_000, 0.3)  # 1.2 steps: rounds to 1 (p = 0.8) or 2 (p = 0.2); to-nearest would give 1 always
    codes = decode(encode(x, plan, rng=np.random.default_rng(7)), plan) * 4
    assert set(np.unique(codes)) == {1.0, 2.0}
    assert abs(codes.mean() - 1.2) < 0.01  # the standard error is 0.0009
    negative = decode(encode(-x, plan, rng=np.random.default_rng(8)), plan) * 4
    assert abs(negative.mean() + 1.2) < 0.01


def test_rounding_follows_the_generator() -> None:
    plan = ring_plan(1.0, 10)
    x = np.random.default_rng(0).uniform(-1, 1, 100)
    a, b = (encode(x, plan, rng=np.random.default_rng(s)) for s in (1, 1))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, encode(x, plan, rng=np.random.default_rng(2)))
    assert encode(x, plan).dtype == np.uint32  # default generator: os.urandom


def test_refuses_what_it_cannot_encode() -> None:
    plan = ring_plan(1.0, 10)
    with pytest.raises(EncodingError, match="non-finite"):
        encode([0.0, float("nan")], plan)
    with pytest.raises(EncodingError, match="non-finite"):
        encode([float("inf")], plan)
    with pytest.raises(EncodingError, match="flat"):
        encode(np.zeros((2, 2)), plan)
    with pytest.raises(EncodingError, match="uint32"):
        decode(np.zeros(3, dtype=np.int64), plan)
    with pytest.raises(EncodingError, match="below"):
        decode(np.array([2**16], dtype=np.uint32), RingPlan(1.0, 16, 4, 1))
