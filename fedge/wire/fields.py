"""Typed fields on the wire: frozen dataclasses to and from message metadata strings, written once.

Every setting a task carries and every number an update reports is a field of a frozen dataclass. This module turns
such a dataclass into the ``str -> str`` table a safetensors message holds, and back, for every type fedge sends:
``int``, ``float``, ``bool``, ``str`` and ``tuple[int, ...]``. Parsing is where a peer's text first meets fedge, so
it is bounded: integers lie in their field's range (see :func:`bounded`), floats are finite, strings and lists are
length-capped, and anything else raises :class:`fedge.errors.CodecError` naming the field. The dataclass's own
``__post_init__`` validation then runs; its ConfigError also becomes a CodecError here.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
from collections.abc import Mapping
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from fedge.errors import CodecError, ConfigError

MAX_STRING = 256
"""Longest string field a peer may send (characters)."""

MAX_LIST = 4096
"""Most items of a ``tuple[int, ...]`` field."""

INT_RANGE = (-(2**53), 2**53)
"""Default bounds of an integer field: what a float64 or JSON number holds exactly."""

T = TypeVar("T")

# ASCII only: Python's int() and float() also read other scripts' digits, "_" separators and surrounding spaces,
# none of which fedge ever writes, so a peer's text that needs them is refused rather than reinterpreted.
_INT_TEXT = re.compile(r"-?[0-9]{1,19}")
_FLOAT_TEXT = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def bounded(lo: float | None = None, hi: float | None = None, *, wire: bool = True, help: str = "") -> dict[str, Any]:
    """Field metadata: the closed range ``[lo, hi]`` a received value must lie in; ``wire=False`` keeps the field
    off the wire (a server-only setting, e.g. how to aggregate); ``help`` is the CLI flag's help text."""
    return {"lo": lo, "hi": hi, "wire": wire, "help": help}


def server_only(help: str = "") -> dict[str, Any]:
    """Field metadata of a setting that never leaves the coordinator."""
    return {"wire": False, "help": help}


def tag(kind: str, obj: Any) -> str:
    """A file-name-safe label of dataclass ``obj``'s numeric fields, e.g. ``prox-mu0.1``: each value short (``:g``)
    where that reads back as the same number, else exact (``repr``), so two different hyperparameters never share a
    program file name (``:g`` alone would print a mu of 0.1000001 as 0.1)."""
    parts = [kind]
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        short = f"{value:g}"
        parts.append(f.name + (short if float(short) == value else repr(value)))
    return "-".join(parts)


def wire_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of dataclass ``cls`` that travel."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("wire", True)]


def to_params(obj: Any, *, prefix: str = "") -> dict[str, str]:
    """The wire fields of dataclass instance ``obj`` as strings, keys prefixed with ``prefix``."""
    out: dict[str, str] = {}
    for f in wire_fields(type(obj)):
        value = getattr(obj, f.name)
        if value is not None:
            out[prefix + f.name] = format_value(value)
    return out


def from_params(cls: type[T], params: Mapping[str, str], *, prefix: str = "", defaults: bool = True) -> T:
    """An instance of dataclass ``cls`` from the strings in ``params``; CodecError for anything out of bounds.

    A wire field that is absent takes its default (``defaults=True``) or is an error; server-only fields always take
    their defaults.
    """
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in wire_fields(cls):
        key = prefix + f.name
        if key not in params:
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            if defaults and has_default:
                continue
            raise CodecError(f"missing field {key!r}")
        values[f.name] = parse_value(key, params[key], hints[f.name], f.metadata)
    try:
        return cls(**values)
    except (ConfigError, ValueError, TypeError) as exc:
        raise CodecError(f"invalid {cls.__name__}: {exc}") from None


def format_value(value: Any) -> str:
    """One value as the string :func:`parse_value` reads back exactly."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CodecError(f"cannot send the non-finite number {value}")
        return repr(value)
    if isinstance(value, str):
        return value
    if isinstance(value, tuple):
        return ",".join(str(int(v)) for v in value)
    raise CodecError(f"cannot send a {type(value).__name__} field")


def parse_value(name: str, raw: str, hint: Any, meta: Mapping[str, Any] | None = None) -> Any:
    """Parse ``raw`` as ``hint`` within the bounds in ``meta``; CodecError naming ``name`` otherwise."""
    meta = meta or {}
    if not isinstance(raw, str):
        raise CodecError(f"field {name!r} is not a string")
    if get_origin(hint) in (Union, types.UnionType):  # Optional[X]: absent means None, present means X
        hint = next(a for a in get_args(hint) if a is not type(None))
    if hint is bool:
        if raw not in ("0", "1"):
            raise CodecError(f"field {name!r} must be 0 or 1, got {_show(raw)}")
        return raw == "1"
    if hint is int:
        return _bounded_int(name, raw, meta)
    if hint is float:
        return _bounded_float(name, raw, meta)
    if hint is str:
        if len(raw) > MAX_STRING:
            raise CodecError(f"field {name!r} is {len(raw)} characters long, at most {MAX_STRING} allowed")
        return raw
    if get_origin(hint) is tuple:
        if raw == "":
            return ()
        items = raw.split(",", MAX_LIST)
        if len(items) > MAX_LIST:
            raise CodecError(f"field {name!r} has more than {MAX_LIST} items")
        return tuple(_bounded_int(name, v, meta) for v in items)
    raise CodecError(f"field {name!r} has an unsupported type {hint}")


def _bounded_int(name: str, raw: str, meta: Mapping[str, Any]) -> int:
    # 19 digits hold every 64-bit integer; longer text is refused before int() spends time on it.
    if not _INT_TEXT.fullmatch(raw):
        raise CodecError(f"field {name!r} is not an integer: {_show(raw)}")
    value = int(raw)
    lo, hi = meta.get("lo"), meta.get("hi")
    lo = INT_RANGE[0] if lo is None else lo
    hi = INT_RANGE[1] if hi is None else hi
    if not lo <= value <= hi:
        raise CodecError(f"field {name!r} = {value} is outside [{lo:g}, {hi:g}]")
    return value


def _bounded_float(name: str, raw: str, meta: Mapping[str, Any]) -> float:
    if len(raw) > 40 or not _FLOAT_TEXT.fullmatch(raw):
        raise CodecError(f"field {name!r} is not a finite number: {_show(raw)}")
    value = float(raw)
    if not math.isfinite(value):  # 1e999 matches the pattern and overflows to inf
        raise CodecError(f"field {name!r} is not finite: {_show(raw)}")
    lo, hi = meta.get("lo"), meta.get("hi")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise CodecError(f"field {name!r} = {value:g} is outside [{lo}, {hi}]")
    return value


def _show(raw: str) -> str:
    """A peer's text, shortened and with control characters escaped, for an error message."""
    return repr(raw[:40] + ("..." if len(raw) > 40 else ""))


def printable(text: str, limit: int = 200) -> str:
    """A peer's text made safe for a log line, metrics or a summary: control characters escaped, at most ``limit``
    characters (a newline in a peer's string must never forge a line in the coordinator's log)."""
    cleaned = "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text[: limit * 4]
    )
    return cleaned if len(cleaned) <= limit else cleaned[: limit - 3] + "..."
