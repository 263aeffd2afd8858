"""Real vectors to and from the ring Z_{2^ring_bits} in which secure aggregation adds.

Masking (Bonawitz et al. 2017, Section 3; Bell et al. 2020, Section 3) needs inputs in a finite group where a
uniform mask hides the value exactly: here the integers modulo 2^ring_bits, ring_bits <= 32, held as uint32 so that
a masked upload is as large as a float32 one. Encoding a client's vector x:

1. clip each coordinate to [-bound, bound] (the clip is the ring's overflow guard and, for deltas, the norm bound
   that replaces server-side clipping, which would need the plaintext);
2. scale by 2^frac_bits and round *stochastically* to an integer q (floor plus a Bernoulli draw of the fractional
   part), so E[q] = x 2^frac_bits: the rounding error of a sum of many clients averages out instead of adding up a
   bias;
3. reduce q modulo 2^ring_bits (two's complement for negative values).

:func:`ring_plan` picks frac_bits so that the sum of ``cohort_size`` encoded values never leaves the signed range
[-2^(ring_bits-1), 2^(ring_bits-1)): it reserves ceil(log2(cohort_size)) + 1 bits of head-room (the sum's growth and
the sign). :func:`decode` reads a ring sum back in two's complement and divides by 2^frac_bits.

Weighted averages: secure aggregation only sums. A caller who wants sum_i w_i x_i / sum_i w_i encodes w_i x_i
(with ``bound`` covering max w_i |x_i|, e.g. normalised weights w_i <= 1) and either sends the weights in the clear
or appends w_i as one more coordinate, then divides the decoded sum by the decoded weight total.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fedge.secagg.errors import EncodingError, SecAggConfigError

MIN_FRAC_BITS = 4
"""Fewest fractional bits :func:`ring_plan` accepts: below 1/16 resolution the rounding noise swamps an update."""

MAX_RING_BITS = 32
"""The ring lives in uint32: ring_bits <= 32."""

RingVector = npt.NDArray[np.uint32]
"""A vector of ring elements, each in [0, 2^ring_bits)."""


@dataclass(frozen=True)
class RingPlan:
    """How real values map into the ring: clip to ``bound``, scale by 2^``frac_bits``, work mod 2^``ring_bits``;
    sized so that ``cohort_size`` clipped values add up without overflow."""

    bound: float
    ring_bits: int
    frac_bits: int
    cohort_size: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bound) and self.bound > 0):
            raise SecAggConfigError(f"the clipping bound must be a positive finite number, got {self.bound}")
        if not 2 <= self.ring_bits <= MAX_RING_BITS:
            raise SecAggConfigError(f"ring_bits must lie in [2, {MAX_RING_BITS}], got {self.ring_bits}")
        if self.cohort_size < 1:
            raise SecAggConfigError(f"the cohort size must be >= 1, got {self.cohort_size}")
        if not isinstance(self.frac_bits, int) or abs(self.frac_bits) > 1100:
            raise SecAggConfigError(f"frac_bits must be an integer in [-1100, 1100], got {self.frac_bits!r}")
        try:
            max_code = self.max_code
        except OverflowError:
            max_code = 2**self.ring_bits
        if self.cohort_size * max_code >= 2 ** (self.ring_bits - 1):
            raise SecAggConfigError(
                f"{self.cohort_size} values up to {self.bound} with {self.frac_bits} fractional bits can overflow a "
                f"{self.ring_bits}-bit ring; use ring_plan() to choose frac_bits"
            )

    @property
    def modulus(self) -> int:
        """2^ring_bits."""
        return 1 << self.ring_bits

    @property
    def mask(self) -> int:
        """2^ring_bits - 1: AND with it reduces a uint32 modulo the ring."""
        return self.modulus - 1

    @property
    def max_code(self) -> int:
        """The largest |q| an encoded coordinate can take: ceil(bound 2^frac_bits)."""
        return math.ceil(math.ldexp(self.bound, self.frac_bits))

    @property
    def resolution(self) -> float:
        """2^-frac_bits: the largest error of one encoded coordinate (stochastic rounding)."""
        return math.ldexp(1.0, -self.frac_bits)


def head_room_bits(cohort_size: int) -> int:
    """Bits reserved above one value for the sum of ``cohort_size`` of them: ceil(log2(cohort_size)) + 1 (sign)."""
    if cohort_size < 1:
        raise SecAggConfigError(f"the cohort size must be >= 1, got {cohort_size}")
    return math.ceil(math.log2(cohort_size)) + 1


def ring_plan(bound: float, cohort_size: int, ring_bits: int = 32, *, min_frac_bits: int = MIN_FRAC_BITS) -> RingPlan:
    """The plan with the most fractional bits such that the sum of ``cohort_size`` values in [-bound, bound] cannot
    overflow a ``ring_bits``-bit ring; SecAggConfigError when fewer than ``min_frac_bits`` bits would be left."""
    if not (isinstance(bound, (int, float)) and math.isfinite(bound) and bound > 0):
        raise SecAggConfigError(f"the clipping bound must be a positive finite number, got {bound}")
    if not 2 <= ring_bits <= MAX_RING_BITS:
        raise SecAggConfigError(f"ring_bits must lie in [2, {MAX_RING_BITS}], got {ring_bits}")
    value_bits = ring_bits - head_room_bits(cohort_size)
    # One code may reach 2^value_bits - 1, so the sum of cohort_size <= 2^(h-1) codes stays below 2^(ring_bits-1).
    limit = (1 << value_bits) - 1 if value_bits > 0 else 0
    if limit < 1:
        raise SecAggConfigError(
            f"a {ring_bits}-bit ring has no room for a cohort of {cohort_size}: use a larger ring or a smaller cohort"
        )
    frac = math.floor(math.log2(limit / bound))
    # log2 in floating point can be off by one at the edges: settle on exact integer checks.
    while math.ceil(math.ldexp(bound, frac)) > limit:
        frac -= 1
    while math.ceil(math.ldexp(bound, frac + 1)) <= limit:
        frac += 1
    if frac < min_frac_bits:
        raise SecAggConfigError(
            f"bound {bound} with a cohort of {cohort_size} in a {ring_bits}-bit ring leaves {frac} fractional bits, "
            f"fewer than {min_frac_bits}: lower the bound, shrink the cohort or use a larger ring"
        )
    return RingPlan(bound=float(bound), ring_bits=ring_bits, frac_bits=frac, cohort_size=cohort_size)


def encode(vector: npt.ArrayLike, plan: RingPlan, *, rng: np.random.Generator | None = None) -> RingVector:
    """``vector`` (1-D, finite) clipped, scaled and stochastically rounded into the ring, as uint32.

    ``rng`` draws the rounding (a per-client seeded generator in simulations); by default one seeded from
    os.urandom.
    """
    x = np.asarray(vector, dtype=np.float64)  # (d,)
    if x.ndim != 1:
        raise EncodingError(f"secure aggregation encodes a flat vector, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise EncodingError("the vector holds non-finite values (NaN or infinity); refusing to encode it")
    if rng is None:
        rng = np.random.default_rng(int.from_bytes(os.urandom(32), "big"))
    scaled = np.ldexp(np.clip(x, -plan.bound, plan.bound), plan.frac_bits)  # exact: a power-of-two scale
    low = np.floor(scaled)
    codes = (low + (rng.random(x.shape) < scaled - low)).astype(np.int64)  # E[codes] = scaled
    return (codes & plan.mask).astype(np.uint32)  # two's complement modulo 2^ring_bits


def decode(values: npt.ArrayLike, plan: RingPlan) -> npt.NDArray[np.float64]:
    """Ring elements (one encoded vector, or a sum of them) read as signed fixed point, as float64."""
    v = np.asarray(values)
    if v.ndim != 1 or v.dtype != np.uint32:
        raise EncodingError(f"ring values are a 1-D uint32 array, got {v.dtype} of shape {v.shape}")
    if v.size and int(v.max()) > plan.mask:
        raise EncodingError(f"ring values must lie below 2^{plan.ring_bits}")
    signed = v.astype(np.int64)
    signed[signed >= plan.modulus >> 1] -= plan.modulus
    return np.ldexp(signed.astype(np.float64), -plan.frac_bits)


def ring_sum(vectors: Iterable[RingVector], ring_bits: int, dim: int) -> RingVector:
    """The sum modulo 2^ring_bits of uint32 ring vectors of length ``dim``."""
    total = np.zeros(dim, dtype=np.uint32)
    for v in vectors:
        np.add(total, v, out=total)  # uint32 wraps modulo 2^32, and 2^ring_bits divides 2^32
    return total & np.uint32((1 << ring_bits) - 1)
