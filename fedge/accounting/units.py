"""Byte counts as people read them, with nothing heavier than the standard library (``fedge status`` starts without
torch)."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

from fedge.errors import ConfigError

__all__ = ["format_bytes"]

_UNITS = ("kB", "MB", "GB", "TB")


def format_bytes(n: int, decimals: int = 1) -> str:
    """A byte count in decimal units as the paper writes it: ``"176 B"``, ``"40.4 kB"``, ``"236.1 MB"``, ``"1.1 GB"``.

    Counts under 1 kB are exact; larger ones are rounded to ``decimals`` places (the paper writes "93 kB" and
    "88 kB" in Table II, i.e. ``decimals=0``). Not ``humanize.naturalsize``: it writes "176 Bytes", rounds the float
    half to even and prints "1000.0 kB" for 999,960 B, so the tables would no longer read as the paper's.
    """
    if n < 0:
        raise ConfigError(f"byte count must not be negative, got {n}")
    if decimals < 0:
        raise ConfigError(f"decimals must not be negative, got {decimals}")
    if n < 1000:
        return f"{n} B"
    # Decimal arithmetic rounds half up exactly as printed figures do (6,250,000 B is "6.3 MB"); float formatting
    # would round the binary value half to even ("6.2 MB").
    quantum = Decimal(1).scaleb(-decimals)
    value = Decimal(n)
    for unit in _UNITS:
        value /= 1000
        shown = value.quantize(quantum, rounding=ROUND_HALF_UP)
        # Move up a unit rather than print 1000.0 (999,960 B is "1.0 MB", not "1000.0 kB").
        if shown < 1000 or unit == _UNITS[-1]:
            return f"{shown} {unit}"
    raise AssertionError("unreachable")
