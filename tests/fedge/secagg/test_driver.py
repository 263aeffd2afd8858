"""Whole rounds in one process through packed messages: the unmasked sum equals the plaintext fixed-point sum bit
for bit at N = 10, 100 and 1000 with 30% of the cohort vanishing after sharing keys and 10% more while unmasking."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from fedge.secagg import RoundAbandoned, encode, recovery_risk, ring_plan, ring_sum, run_round
from fedge.secagg.protocol import Stage

Seeded = Callable[[int], Callable[[int], bytes]]


def _cohort(
    n: int, dim: int, bound: float, seed: int, ring_bits: int = 32
) -> tuple[dict[str, np.ndarray], dict[str, Stage]]:
    """Vectors on the round's fixed-point grid (so the rounding is exact and the expected sum is known bit for bit),
    30% of the cohort dropping after key sharing, 10% more during unmasking."""
    ids = [f"c{i:04d}" for i in range(n)]
    frac_bits = ring_plan(bound, n, ring_bits).frac_bits
    gen = np.random.default_rng(seed)
    scale = 2.0**frac_bits
    vectors = {c: gen.integers(-int(bound * scale), int(bound * scale) + 1, dim) / scale for c in ids}
    order = gen.permutation(ids)
    drops: dict[str, Stage] = {str(c): "upload" for c in order[: 3 * n // 10]}
    drops |= {str(c): "unmask" for c in order[3 * n // 10 : 4 * n // 10]}
    return vectors, drops


@pytest.mark.parametrize(
    ("n", "dim", "degree", "threshold"),
    [
        (10, 256, None, None),  # complete graph, k = 9, t = 5 (SecAgg+'s defaults)
        (100, 128, 99, None),  # complete graph, t = 50 > k/2: SecAgg (Bonawitz et al.) at 40% dropout
        (1000, 64, None, 4),  # SecAgg+'s k = 21, with a threshold 40% dropouts allow (see below)
    ],
)
def test_exact_sum_with_dropouts(seeded: Seeded, n: int, dim: int, degree: int | None, threshold: int | None) -> None:
    bound = 2.0
    vectors, drops = _cohort(n, dim, bound, seed=n)
    result = run_round(
        vectors,
        bound=bound,
        round_seed=bytes([n % 256]) * 32,
        run="run",
        session="s",
        round=1,
        drop_at=drops,
        degree=degree,
        threshold=threshold,
        rng=np.random.default_rng(0),
        rand_bytes=seeded(n),
    )
    survivors = sorted(c for c in vectors if drops.get(c) != "upload")
    assert result.survivors == tuple(survivors) and len(survivors) == n - 3 * n // 10
    expected = ring_sum((encode(vectors[c], result.plan) for c in survivors), 32, dim)
    np.testing.assert_array_equal(result.sum_ring, expected)
    np.testing.assert_array_equal(result.decoded_sum, sum(vectors[c] for c in survivors))
    # A masked upload is a float32 upload's size plus a header: 1.0x, not SecAgg's int64 2x.
    assert result.bytes_per_stage_up["upload"] <= len(survivors) * (4 * dim + 200)
    if n == 1000:
        # t > k/2 (here 11 of 21) would need more than half of each client's neighbours to survive: with 40% gone,
        # about 85 of 1000 secrets would lack shares. t = 4 is what this dropout rate allows at k = 21.
        k = result.config.degree
        assert k == 21 and recovery_risk(n, k, k // 2 + 1, 0.4) == 1.0 and recovery_risk(n, k, 4, 0.4) < 0.05


def test_real_vectors_sum_within_the_rounding(seeded: Seeded) -> None:
    gen = np.random.default_rng(1)
    vectors = {f"c{i}": gen.normal(size=300) for i in range(10)}
    result = run_round(
        vectors,
        bound=1.5,
        round_seed=b"\x01" * 32,
        run="run",
        session="s",
        round=2,
        drop_at={"c3": "upload", "c7": "unmask"},
        rng=np.random.default_rng(2),
        rand_bytes=seeded(3),
    )
    clipped = sum(np.clip(vectors[c], -1.5, 1.5) for c in result.survivors)
    assert np.abs(result.decoded_sum - clipped).max() < len(result.survivors) * result.plan.resolution
    assert result.dropped == ("c3",)


def test_a_smaller_ring(seeded: Seeded) -> None:
    vectors, drops = _cohort(12, 100, 1.0, seed=4, ring_bits=16)
    result = run_round(
        vectors, bound=1.0, ring_bits=16, round_seed=b"\x02" * 32, run="r", session="s", round=0, drop_at=drops,
        rand_bytes=seeded(5),
    )  # fmt: skip
    assert result.plan.ring_bits == 16 and int(result.sum_ring.max()) < 2**16
    np.testing.assert_array_equal(result.decoded_sum, sum(vectors[c] for c in result.survivors))


def test_below_threshold_is_abandoned_and_the_next_round_completes(seeded: Seeded) -> None:
    vectors, _ = _cohort(10, 16, 1.0, seed=6)
    ids = sorted(vectors)
    with pytest.raises(RoundAbandoned) as info:  # k = 9, t = 5: six vanish after sharing, four remain
        run_round(
            vectors, bound=1.0, round_seed=b"\x03" * 32, run="r", session="s", round=5,
            drop_at=dict.fromkeys(ids[:6], "upload"), rand_bytes=seeded(7),
        )  # fmt: skip
    assert info.value.stage == "upload"
    result = run_round(
        vectors, bound=1.0, round_seed=b"\x04" * 32, run="r", session="s", round=6,
        drop_at=dict.fromkeys(ids[:2], "unmask"), rand_bytes=seeded(8),
    )  # fmt: skip
    assert result.survivors == tuple(ids)
    np.testing.assert_array_equal(result.decoded_sum, sum(vectors.values()))


def test_accounting_covers_every_stage(seeded: Seeded) -> None:
    vectors, drops = _cohort(10, 32, 1.0, seed=9)
    result = run_round(
        vectors, bound=1.0, round_seed=b"\x05" * 32, run="r", session="s", round=1, drop_at=drops,
        rand_bytes=seeded(10),
    )  # fmt: skip
    assert all(result.bytes_per_stage_up[s] > 0 for s in ("advertise", "share", "upload", "unmask"))
    assert result.bytes_per_stage_down["advertise"] == 0  # the config rides with the task
    assert all(result.bytes_per_stage_down[s] > 0 for s in ("share", "upload", "unmask"))
    assert result.timings["unmask.server"] > 0
