"""Shamir t-of-n secret sharing over the prime field GF(2^521 - 1).

Bonawitz et al. 2017 (CCS, "Practical Secure Aggregation for Privacy-Preserving Machine Learning", Section 3.1)
and Bell et al. 2020 (CCS, "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", Section 3) share each
client's self-mask seed b and masking key s_sk this way: a random polynomial f of degree t - 1 with f(0) = secret,
share i is (x_i, f(x_i)), and any t shares give f(0) back by Lagrange interpolation; t - 1 shares reveal nothing.

Why this field: the secrets are 32 bytes (256 bits), so the field must exceed 2^256. The Mersenne prime
p = 2^521 - 1 holds a whole secret in one element (no chunking, one polynomial per secret), its shares are
66 bytes, and Python's integers do the arithmetic. It also catches garbled shares for free: a secret lies below
2^256, while a share replaced by random bytes interpolates to an essentially uniform field element, below 2^256
with probability 2^-265, which :func:`combine` refuses. A holder who shifts its share on purpose moves f(0) by a
known multiple of the shift, so that it may still fit: :func:`combine` therefore checks every share beyond the
threshold against the rebuilt polynomial (one more honest share than the threshold exposes it), and the protocol
checks a rebuilt masking key against its advertised public key (:mod:`fedge.secagg.protocol`).

Shares are evaluated at x = 1..n (the holder's index in the round's sorted client list, plus one); x = 0 would be
the secret itself and is never a share.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fedge.secagg.errors import ShareError

PRIME = 2**521 - 1
"""The field's modulus, a Mersenne prime."""

SHARE_BYTES = (PRIME.bit_length() + 7) // 8  # 66
"""Bytes of one share's value on the wire (big-endian)."""

SECRET_BYTES = 32
"""Bytes of every secret the protocol shares (a self-mask seed, an X25519 private key)."""

RandBytes = Callable[[int], bytes]
"""A source of random bytes: ``os.urandom`` in use, a seeded stream in tests."""


@dataclass(frozen=True)
class Share:
    """One point (x, f(x)) of a sharing polynomial; ``x`` in [1, p), ``y`` in [0, p)."""

    x: int
    y: int

    def __post_init__(self) -> None:
        if not 0 < self.x < PRIME:
            raise ShareError(f"share x = {self.x} is outside [1, 2^521 - 1)")
        if not 0 <= self.y < PRIME:
            raise ShareError(f"share value of x = {self.x} is outside the field [0, 2^521 - 1)")

    def __repr__(self) -> str:  # never print a share's value into a log
        return f"Share(x={self.x}, y=<{SHARE_BYTES} bytes>)"


def split(secret: bytes, threshold: int, xs: int | Sequence[int], *, rand_bytes: RandBytes = os.urandom) -> list[Share]:
    """Shares of ``secret`` at ``xs`` (or at 1..xs when an int), any ``threshold`` of which give it back."""
    points = list(range(1, xs + 1)) if isinstance(xs, int) else list(xs)
    if len(set(points)) != len(points):
        raise ShareError("the share points x must be distinct")
    if not 1 <= threshold <= len(points):
        raise ShareError(f"threshold {threshold} must lie in [1, {len(points)}] (the number of shares)")
    if len(secret) > SECRET_BYTES * 2:  # 64 bytes = 512 bits < 521: always inside the field
        raise ShareError(f"a secret is at most {SECRET_BYTES * 2} bytes, got {len(secret)}")
    # f(x) = secret + a_1 x + ... + a_{t-1} x^{t-1}, with uniform coefficients.
    coeffs = [int.from_bytes(secret, "big")] + [_uniform(rand_bytes) for _ in range(threshold - 1)]
    return [Share(x, _evaluate(coeffs, x)) for x in _checked_points(points)]


def combine(shares: Sequence[Share], threshold: int, *, secret_len: int = SECRET_BYTES) -> bytes:
    """The secret of ``secret_len`` bytes from at least ``threshold`` shares.

    The first ``threshold`` shares give the polynomial; every further share must lie on it. Refuses fewer than
    ``threshold`` shares, a repeated x, a further share off the polynomial, and a result that does not fit in
    ``secret_len`` bytes (the signs of a tampered share, see the module docstring). The check of the further shares is
    what stops a holder who shifts its share on purpose: shifting it by the inverse of its Lagrange weight moves the
    secret by exactly 1, which still fits, so with exactly ``threshold`` shares such a shift goes unseen (a self-mask
    seed has no public key to check it against), and with one more it is refused.
    """
    if threshold < 1:
        raise ShareError(f"threshold must be >= 1, got {threshold}")
    if len(shares) < threshold:
        raise ShareError(f"{len(shares)} shares cannot reconstruct a secret shared with threshold {threshold}")
    _check_distinct(shares)
    polynomial = _Interpolant(shares[:threshold])
    value = polynomial.at(0)
    for extra in shares[threshold:]:
        if polynomial.at(extra.x) != extra.y:
            raise ShareError(
                f"the share at x = {extra.x} is off the polynomial the first {threshold} shares give: "
                "a share is corrupt"
            )
    if value.bit_length() > 8 * secret_len:
        raise ShareError(f"the shares interpolate to a value wider than {secret_len} bytes: a share is corrupt")
    return value.to_bytes(secret_len, "big")


def interpolate_at_zero(shares: Sequence[Share]) -> int:
    """f(0) of the unique polynomial of degree < len(shares) through ``shares`` (Lagrange interpolation)."""
    return interpolate_at(shares, 0)


def interpolate_at(shares: Sequence[Share], at: int) -> int:
    """f(``at``) of the unique polynomial of degree < len(shares) through ``shares``."""
    if not shares:
        raise ShareError("no shares to interpolate")
    _check_distinct(shares)
    return _Interpolant(shares).at(at)


class _Interpolant:
    """The polynomial through distinct ``shares`` in barycentric form: f(x) = l(x) sum_i w_i y_i / (x - x_i), with
    l(x) = prod_i (x - x_i) and w_i = 1 / prod_{j != i} (x_i - x_j). The weights cost O(t^2) multiplications once;
    each evaluation O(t) and one modular inverse (an inverse costs some 40 multiplications in this field), so checking
    the shares beyond the threshold stays cheap when t is large (t = 53 for 1,000 clients at 30% dropouts)."""

    def __init__(self, shares: Sequence[Share]) -> None:
        self.xs = [s.x for s in shares]
        self.ys = [s.y for s in shares]
        denominators = []
        for i, xi in enumerate(self.xs):
            den = 1
            for j, xj in enumerate(self.xs):
                if i != j:
                    den = den * (xi - xj) % PRIME
            denominators.append(den)
        self.weighted = [w * y % PRIME for w, y in zip(_inverses(denominators), self.ys, strict=True)]

    def at(self, x: int) -> int:
        diffs = [(x - xi) % PRIME for xi in self.xs]
        if 0 in diffs:  # x is one of the points: its own value
            return self.ys[diffs.index(0)]
        total, whole = 0, 1
        for wy, inverse, diff in zip(self.weighted, _inverses(diffs), diffs, strict=True):
            total = (total + wy * inverse) % PRIME
            whole = whole * diff % PRIME
        return whole * total % PRIME


def _inverses(values: Sequence[int]) -> list[int]:
    """1 / v mod p for each of ``values`` (none 0) with one modular inverse (Montgomery's batch inversion)."""
    prefix = [1]  # prefix[i]: the product of the first i values
    for v in values:
        prefix.append(prefix[-1] * v % PRIME)
    inverse = pow(prefix[-1], -1, PRIME)  # 1 / (all of them): then peel them off one at a time
    out = [0] * len(values)
    for i in range(len(values) - 1, -1, -1):
        out[i] = inverse * prefix[i] % PRIME
        inverse = inverse * values[i] % PRIME
    return out


def _check_distinct(shares: Sequence[Share]) -> None:
    xs = [s.x for s in shares]
    if len(set(xs)) != len(xs):
        raise ShareError(f"repeated share points among x = {sorted(xs)}")


def share_value_to_bytes(share: Share) -> bytes:
    """The share's value y as :data:`SHARE_BYTES` big-endian bytes (x travels implicitly: the holder's index)."""
    return share.y.to_bytes(SHARE_BYTES, "big")


def share_from_bytes(x: int, data: bytes) -> Share:
    """The share (x, y) with y read from :data:`SHARE_BYTES` big-endian bytes; refuses a value outside the field."""
    if len(data) != SHARE_BYTES:
        raise ShareError(f"a share value is {SHARE_BYTES} bytes, got {len(data)}")
    return Share(x, int.from_bytes(data, "big"))


def _checked_points(points: list[int]) -> list[int]:
    for x in points:
        if not 0 < x < PRIME:
            raise ShareError(f"share point x = {x} is outside [1, 2^521 - 1)")
    return points


def _evaluate(coeffs: list[int], x: int) -> int:
    acc = 0
    for c in reversed(coeffs):  # Horner
        acc = (acc * x + c) % PRIME
    return acc


def _uniform(rand_bytes: RandBytes) -> int:
    # 521 random bits, rejecting the one value (2^521 - 1 = p) that is not below p: exactly uniform on [0, p).
    while True:
        value = int.from_bytes(rand_bytes(SHARE_BYTES), "big") & PRIME
        if value < PRIME:
            return value
