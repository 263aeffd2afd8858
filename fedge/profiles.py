"""Client profiles for simulated time: each client's compute speed, network link and availability, from a SPEC.

A client's compute is seconds per sample-step (one sample through one local epoch: forward, backward and optimizer
step, amortized over a batch). Links and profile SPECs are parsed here, with one-line errors; the per-round clock
that uses them is :mod:`fedge.accounting.sim_clock`; docs/simulated_time.md states where each figure comes from.

SPEC of ``--client-profiles`` (``--link`` gives every client's default link):
- ``uniform``: every client the reference compute (the default when only ``--link`` is given); ``measure``: the same;
- ``tail:fraction=0.1,slowdown=10``: ``round(fraction * N)`` clients, chosen by the run's seed, ``slowdown`` x slower;
- ``lognormal:sigma=1``: slowdown factors ``exp(sigma * z)``, z standard normal (median 1), by the run's seed;
- a ``.csv`` or ``.json`` file, one row per client (columns in :data:`FILE_COLUMNS`).
Every generator also takes ``compute=SECONDS`` (seconds per sample-step of a factor-1 client; default ``measure``: the
simulator times a local step of the run's model on this machine) and ``period=SECONDS,duty=F`` (each client is on
for ``duty * period`` seconds of every ``period``, from a phase drawn by the run's seed; default: always on).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedge.errors import ConfigError
from fedge.types import ClientId

MEASURE = "measure"
"""``compute=measure``: the reference compute is timed on this machine for the run's model (by the simulator)."""


@dataclass(frozen=True)
class Link:
    """A client's network link: uplink and downlink bandwidth (bit/s) and one-way latency per message (s)."""

    up_bps: float
    down_bps: float
    latency_s: float

    def __post_init__(self) -> None:
        for name in ("up_bps", "down_bps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"link {name.removesuffix('_bps')} bandwidth must be > 0 bit/s, got {value}")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ConfigError(f"link latency must be >= 0 s, got {self.latency_s}")

    def describe(self) -> str:
        return f"up {_rate(self.up_bps)}, down {_rate(self.down_bps)}, latency {1000 * self.latency_s:g} ms"


# Nominal round figures, assumed, not measured: what a link of the kind typically offers one device, to compare runs
# under one assumption. docs/simulated_time.md says so; pass explicit figures for a measured link.
LINK_PRESETS: dict[str, Link] = {
    "ethernet": Link(up_bps=1e9, down_bps=1e9, latency_s=0.0005),  # gigabit LAN, switch hop
    "wifi": Link(up_bps=50e6, down_bps=100e6, latency_s=0.005),  # a good 802.11ac/ax link to a local access point
    "lte": Link(up_bps=10e6, down_bps=30e6, latency_s=0.05),  # an LTE user in fair coverage
    "cellular-edge": Link(up_bps=1e6, down_bps=5e6, latency_s=0.12),  # at the cell edge: the 1 Mbit/s uplink of #53
}
DEFAULT_LINK = "wifi"
"""The link of every client when ``--client-profiles`` is given without ``--link`` (and a file row names none)."""

_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}


def _rate(bps: float) -> str:
    for scale, unit in ((1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


def _number(text: str, units: Mapping[str, float], what: str, default_unit: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-z]*)(?:/s)?\s*", text.lower())
    if m is None or (m.group(2) and m.group(2) not in units):
        raise ConfigError(f"{what}: cannot read {text!r}; give a number with a unit ({', '.join(units)})")
    return float(m.group(1)) * units[m.group(2) or default_unit]


def parse_rate(text: str) -> float:
    """Bit/s of ``"10Mbit"``, ``"500 kbit/s"``, ``"1e6"`` (a bare number is bit/s)."""
    return _number(text, _RATE_UNITS, "bandwidth", "bit")


def parse_seconds(text: str) -> float:
    """Seconds of ``"80ms"``, ``"0.5 ms"``, ``"2s"``, ``"10min"`` (a bare number is seconds)."""
    return _number(text, _TIME_UNITS, "time", "s")


def _options(text: str, what: str, allowed: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in allowed:
            raise ConfigError(f"{what}: {item!r} is not KEY=VALUE with KEY one of {', '.join(allowed)}")
        out[key.strip()] = value.strip()
    return out


def parse_link(spec: str) -> Link:
    """A preset (``lte``, ``wifi``, ``ethernet``, ``cellular-edge``), optionally with overrides (``lte:latency=80ms``),
    or ``up=1Mbit,down=10Mbit,latency=80ms``."""
    name, colon, rest = spec.partition(":")
    if name.strip() in LINK_PRESETS:
        base, text = LINK_PRESETS[name.strip()], rest
    elif colon or "=" not in spec:
        raise ConfigError(
            f"--link {spec!r}: not a preset ({', '.join(LINK_PRESETS)}) nor up=RATE,down=RATE,latency=TIME"
        )
    else:
        base, text = None, spec
    given = _options(text, f"--link {spec!r}", ("up", "down", "latency"))
    if base is None and set(given) != {"up", "down", "latency"}:
        raise ConfigError(f"--link {spec!r}: give all of up=RATE,down=RATE,latency=TIME (e.g. up=1Mbit,down=10Mbit,"
                          "latency=80ms), or a preset")  # fmt: skip
    return Link(
        up_bps=parse_rate(given["up"]) if "up" in given else base.up_bps,  # type: ignore[union-attr]
        down_bps=parse_rate(given["down"]) if "down" in given else base.down_bps,  # type: ignore[union-attr]
        latency_s=parse_seconds(given["latency"]) if "latency" in given else base.latency_s,  # type: ignore[union-attr]
    )


@dataclass(frozen=True)
class Availability:
    """When a client is on: ``on`` periods ``[start, end)`` in simulated seconds, repeating every ``period`` seconds
    when it is > 0; no periods: always on."""

    on: tuple[tuple[float, float], ...] = ()
    period: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.period) and self.period >= 0):
            raise ConfigError(f"availability period must be >= 0 s, got {self.period}")
        for start, end in self.on:
            if not (0 <= start < end) or (self.period and end > self.period):
                raise ConfigError(
                    f"availability period {start:g}-{end:g} s: need 0 <= start < end"
                    + (f" <= period {self.period:g}" if self.period else "")
                )

    def next_on(self, t: float) -> float:
        """The earliest simulated time >= ``t`` at which the client is on (``inf``: never again)."""
        if not self.on:
            return t
        if not self.period:
            return min((max(t, s) for s, e in self.on if e > t), default=math.inf)
        cycle = math.floor(t / self.period) * self.period
        local = t - cycle
        inside = [max(local, s) for s, e in self.on if e > local]
        return cycle + (min(inside) if inside else self.period + min(s for s, _ in self.on))

    def available(self, t: float) -> bool:
        return self.next_on(t) == t

    @classmethod
    def parse(cls, text: str, period: str = "") -> Availability:
        """``"0-600;900-1200"`` (seconds, or with units: ``"0-10min"``), repeating every ``period`` if given."""
        spans = []
        for item in filter(None, (s.strip() for s in text.split(";"))):
            start, dash, end = item.partition("-")
            if not dash:
                raise ConfigError(f"availability {item!r}: write on-periods as START-END, separated by ';'")
            spans.append((parse_seconds(start), parse_seconds(end)))
        return cls(tuple(sorted(spans)), parse_seconds(period) if period.strip() else 0.0)


@dataclass(frozen=True)
class ClientProfile:
    """One client: seconds per sample-step, link, and availability."""

    compute_s: float
    link: Link
    availability: Availability = field(default_factory=Availability)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.compute_s) and self.compute_s >= 0):
            raise ConfigError(f"compute must be >= 0 seconds per sample-step, got {self.compute_s}")


GENERATORS = ("uniform", "tail", "lognormal")
_GENERATOR_OPTIONS = {
    "uniform": (),
    "tail": ("fraction", "slowdown"),
    "lognormal": ("sigma",),
}
_COMMON_OPTIONS = ("compute", "period", "duty")
FILE_COLUMNS = {
    "client": "the client's id as the run names it (c000, c001, ...); every client of the run needs one row",
    "compute_s": "seconds per sample-step (absolute); or",
    "slowdown": "a factor on the reference compute (compute= of the SPEC, else measured here); default 1",
    "up": "uplink, e.g. 1Mbit (default: --link's)",
    "down": "downlink, e.g. 10Mbit (default: --link's)",
    "latency": "per message, e.g. 80ms (default: --link's)",
    "availability": "on-periods START-END;START-END in simulated seconds (default: always on)",
    "period": "the on-periods repeat every this many seconds (default: they do not repeat)",
}


@dataclass(frozen=True)
class ProfileSpec:
    """A parsed ``--client-profiles`` SPEC: a generator with its options, or a file (``path``)."""

    kind: str  # uniform | tail | lognormal | file
    options: Mapping[str, str] = field(default_factory=dict)
    path: str = ""

    @property
    def compute(self) -> str:
        """The reference compute as given: seconds per sample-step, or ``measure``."""
        return self.options.get("compute", MEASURE)

    def reference_s(self) -> float | None:
        """Seconds per sample-step of a factor-1 client; None when it is to be measured."""
        return None if self.compute == MEASURE else parse_seconds(self.compute)


def parse_profiles(spec: str) -> ProfileSpec:
    """Parse a ``--client-profiles`` SPEC (checks the generators' options; a file is read by the simulator)."""
    head, _, rest = spec.strip().partition(":")
    what = f"--client-profiles {spec!r}"
    if head == MEASURE and not rest:  # every client at the speed measured here
        return ProfileSpec("uniform", {"compute": MEASURE})
    if head.lower().endswith((".csv", ".json")):
        opts = _options(rest, what, ("compute",))
        out = ProfileSpec("file", opts, head)
    elif head in GENERATORS:
        opts = _options(rest, what, (*_GENERATOR_OPTIONS[head], *_COMMON_OPTIONS))
        out = ProfileSpec(head, opts)
    else:
        raise ConfigError(f"{what}: not one of {', '.join(GENERATORS)}, {MEASURE} nor a .csv or .json file")
    ref = out.reference_s()
    if ref is not None and ref <= 0:
        raise ConfigError(f"{what}: compute must be > 0 seconds per sample-step, or measure")
    num = {k: _float(v, f"{what}: {k}") for k, v in opts.items() if k in ("fraction", "slowdown", "sigma", "duty")}
    if not 0 <= num.get("fraction", 0.1) <= 1:
        raise ConfigError(f"{what}: fraction must be in [0, 1]")
    if num.get("slowdown", 10.0) <= 0 or num.get("sigma", 1.0) < 0:
        raise ConfigError(f"{what}: slowdown must be > 0 and sigma >= 0")
    if ("period" in opts) != ("duty" in opts) or not 0 < num.get("duty", 1.0) <= 1:
        raise ConfigError(f"{what}: give period=SECONDS with duty=F in (0, 1] (the share of each period on)")
    if "period" in opts and parse_seconds(opts["period"]) <= 0:
        raise ConfigError(f"{what}: period must be > 0 s")
    return out


def _float(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{what} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise ConfigError(f"{what} must be finite, got {text!r}")
    return value


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, zlib.crc32(b"client-profiles")]))


def generate_profiles(
    spec: ProfileSpec, clients: Sequence[ClientId], link: Link, reference_s: float, seed: int
) -> dict[ClientId, ClientProfile]:
    """Every client's profile from a generator SPEC, deterministic in ``seed``; ``reference_s``: seconds per
    sample-step of a factor-1 client."""
    ordered = sorted(clients)
    n = len(ordered)
    rng = _rng(seed)
    factors = np.ones(n)  # (N,)
    if spec.kind == "tail":
        slow = round(float(spec.options.get("fraction", 0.1)) * n)
        chosen = rng.choice(n, size=slow, replace=False)  # (slow,)
        factors[chosen] = float(spec.options.get("slowdown", 10.0))
    elif spec.kind == "lognormal":
        factors = np.exp(float(spec.options.get("sigma", 1.0)) * rng.standard_normal(n))  # (N,)
    elif spec.kind != "uniform":
        raise ConfigError(f"{spec.kind!r} is not a generator; read a profiles file with read_profiles")
    availability = [Availability()] * n
    if "period" in spec.options:
        period = parse_seconds(spec.options["period"])
        on = float(spec.options["duty"]) * period
        phases = rng.uniform(0.0, period, size=n)  # (N,)
        availability = [_periodic(float(p), on, period) for p in phases]
    return {
        c: ClientProfile(reference_s * float(f), link, a)
        for c, f, a in zip(ordered, factors, availability, strict=True)
    }


def _periodic(start: float, length: float, period: float) -> Availability:
    """On from ``start`` for ``length`` seconds of every ``period``, wrapped into one period."""
    if length >= period:
        return Availability()
    end = start + length
    spans = ((start, end),) if end <= period else ((0.0, end - period), (start, period))
    return Availability(spans, period)


def read_profiles(
    text: str, fmt: str, clients: Sequence[ClientId], link: Link, reference_s: float | None
) -> dict[ClientId, ClientProfile]:
    """Profiles from a file's ``text`` (``fmt``: ``csv`` or ``json``), one row per client (:data:`FILE_COLUMNS`).

    ``reference_s``: what ``slowdown`` multiplies (None: no row may use ``slowdown``, every row gives ``compute_s``).
    """
    rows: list[dict[str, Any]]
    try:
        rows = list(csv.DictReader(io.StringIO(text))) if fmt == "csv" else json.loads(text)
    except (json.JSONDecodeError, csv.Error) as exc:
        raise ConfigError(f"client profiles: not valid {fmt}: {exc}") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ConfigError("client profiles: a JSON file holds a list of objects, one per client")
    out: dict[ClientId, ClientProfile] = {}
    for i, raw in enumerate(rows, start=1):
        if None in raw:  # csv.DictReader's key for the fields beyond the header's
            raise ConfigError(f"client profiles, row {i}: more fields than the header has columns")
        row = {str(k).strip(): "" if v is None else str(v).strip() for k, v in raw.items()}
        where = f"client profiles, row {i}"
        unknown = set(row) - set(FILE_COLUMNS)
        if unknown:
            raise ConfigError(
                f"{where}: unknown column(s) {', '.join(sorted(unknown))}; known: {', '.join(FILE_COLUMNS)}"
            )
        client = row.get("client", "")
        if client not in clients or client in out:
            raise ConfigError(
                f"{where}: client {client!r} is " + ("named twice" if client in out else "not in the run")
            )
        if row.get("compute_s") and row.get("slowdown"):
            raise ConfigError(f"{where}: give compute_s or slowdown, not both")
        if row.get("compute_s"):
            compute = parse_seconds(row["compute_s"])
        elif reference_s is None:
            raise ConfigError(f"{where}: no compute_s, and no reference compute to apply a slowdown to")
        else:
            compute = reference_s * _float(row.get("slowdown") or "1", f"{where}: slowdown")
        own = Link(
            parse_rate(row["up"]) if row.get("up") else link.up_bps,
            parse_rate(row["down"]) if row.get("down") else link.down_bps,
            parse_seconds(row["latency"]) if row.get("latency") else link.latency_s,
        )
        out[client] = ClientProfile(
            compute, own, Availability.parse(row.get("availability", ""), row.get("period", ""))
        )
    missing = sorted(set(clients) - set(out))
    if missing:
        raise ConfigError(f"client profiles: no row for {len(missing)} client(s) of the run, e.g. {missing[0]}")
    return out


def file_needs_reference(text: str, fmt: str) -> bool:
    """Whether a profiles file has a row without ``compute_s`` (so the reference compute must be known)."""
    try:
        rows = list(csv.DictReader(io.StringIO(text))) if fmt == "csv" else json.loads(text)
    except (json.JSONDecodeError, csv.Error):
        return False  # read_profiles says what is wrong
    return isinstance(rows, list) and any(isinstance(r, dict) and not str(r.get("compute_s") or "") for r in rows)
