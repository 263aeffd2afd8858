"""Compressed tensors: what really travels instead of float32, the scheme that says how to read it, and back.

A :class:`Scheme` names one codec and its parameters; it travels as string metadata (``codec.name``, ``codec.k``,
...) next to the coded tensors, so a receiver decodes without guessing and refuses a scheme it did not ask for.
Only float32 tensors are compressed; every other dtype travels as it is. Decoded tensors are float32, and
aggregation works on them. Codecs and their error bounds (x the input, x^ the decoded value):

- ``float32``: identity (x^ = x), so that every message can declare a scheme.
- ``float16``: x^ = fp16(x); |x^ - x| <= 2^-11 |x| + 2^-25 (round to nearest; the 2^-25 covers subnormals).
  Values beyond fp16's range (|x| > 65504) are refused at encode time. The optional broadcast codec for weights.
- ``int8``: one scale per *granularity* unit (``tensor``; ``row`` = the last dimension, e.g. one soft-label row;
  ``block`` = ``block`` consecutive values of the flattened tensor). Symmetric codes q in [-127, 127] (int8,
  x^ = q s, s = max|x| / 127) or, with ``offset``, asymmetric codes q in [0, 255] (uint8, x^ = lo + q s,
  s = (max - min) / 255, lo = min: probabilities in [0, 1] use all 256 levels). |x^ - x| <= s / 2 with round to
  nearest, < s with ``stochastic`` rounding (unbiased: E[x^] = x; its randomness comes from a ``torch.Generator``
  passed in). Both bounds hold up to float32 rounding of the arithmetic. Scales and offsets travel as ``side``
  (float32 or float16); a float16 offset is rounded down and a float16 scale up, so the bound holds for the
  scale on the wire.
- ``topk``: per ``row`` (soft labels, logits) the k largest values of each row; per ``tensor`` (weight deltas) the
  k largest magnitudes of the flattened tensor. ``k`` is given directly or as ``density`` (k = max(1, ceil(density
  n))). Kept values travel as ``side`` (exact with float32) with their indices in the smallest integer dtype that
  holds them (uint8 up to 256 entries, then int16, int32). Per row, the dropped mass (the sum of the dropped
  entries, corrected for the rounding of the kept ones) travels too and is spread evenly over the dropped entries
  on decode: a decoded row keeps its sum (a probability row still sums to 1), each filled entry is the mean of the
  dropped ones, hence non-negative when they were and never above the smallest kept value, so the row stays a valid
  probability vector with the same top k. Renormalizing the kept values instead would change them and lose the
  mass. Per tensor, dropped entries decode to zero; :func:`encode_with_feedback` keeps them for later rounds.

``delta`` declares that the tensors are differences against a reference both sides hold (the round's broadcast):
:func:`encode` subtracts it and :func:`decode` adds it back. Error feedback (:class:`Residual`,
:func:`encode_with_feedback`; Seide et al., Interspeech 2014; Karimireddy et al., ICML 2019) adds what earlier rounds
did not send before compressing and keeps what this round does not send, so nothing is lost, only delayed.

Coded tensor names: a tensor ``w`` travels as ``w`` (codes or kept values) plus parts ``w:scale``, ``w:offset``,
``w:index``, ``w:mass``. Every coded shape follows from the receiver's own expectations (:class:`TensorSpec`) and
the scheme (:func:`coded_specs`); decoding checks names, dtypes and shapes against them before reading a value and
never allocates from a size a peer sent. This module is pure: torch only, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fedge.errors import CodecError, ConfigError
from fedge.wire import fields as wire

META_PREFIX = "codec."
"""Metadata keys of the scheme: ``codec.name``, ``codec.k``, ..."""

PART_SEP = ":"
"""Separates a tensor's name from the name of one of its coded parts (``w:scale``)."""

NAMES = ("float32", "float16", "int8", "topk")
GRANULARITIES = ("tensor", "row", "block")
SIDE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16}
MAX_BLOCK = 1 << 24
MAX_K = 1 << 24
FP16_MAX = 65504.0


@dataclass(frozen=True)
class Scheme:
    """One codec and its parameters; serializes to ``dict[str, str]`` metadata and validates itself."""

    name: str = "float32"  # float32 | float16 | int8 | topk
    granularity: str = "tensor"  # int8: one scale per tensor | row | block; topk: select per tensor | row
    block: int = field(default=0, metadata=wire.bounded(0, MAX_BLOCK))  # int8 with granularity "block"
    offset: bool = False  # int8: asymmetric codes in [0, 255] with a per-unit offset (the minimum)
    stochastic: bool = False  # int8: stochastic rounding (needs a torch.Generator at encode time)
    k: int = field(default=0, metadata=wire.bounded(0, MAX_K))  # topk: values kept per row / tensor
    density: float = field(default=0.0, metadata=wire.bounded(0.0, 1.0))  # topk: or this fraction of them
    side: str = "float32"  # dtype of scales, offsets, kept values and masses: float32 | float16
    delta: bool = False  # the tensors are differences against a reference both sides hold

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise ConfigError(f"unknown compression scheme {self.name!r}; known: {', '.join(NAMES)}")
        if self.granularity not in GRANULARITIES:
            raise ConfigError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.side not in SIDE_DTYPES:
            raise ConfigError(f"side dtype must be float32 or float16, got {self.side!r}")
        if not 0 <= self.block <= MAX_BLOCK or not 0 <= self.k <= MAX_K:
            raise ConfigError(f"block must be in 0..{MAX_BLOCK} and k in 0..{MAX_K}")
        if not (math.isfinite(self.density) and 0.0 <= self.density <= 1.0):
            raise ConfigError(f"density must be in [0, 1], got {self.density}")
        unused = [
            name
            for name, used, value, default in (
                ("granularity", self.name in ("int8", "topk"), self.granularity, "tensor"),
                ("block", self.name == "int8", self.block, 0),
                ("offset", self.name == "int8", self.offset, False),
                ("stochastic", self.name == "int8", self.stochastic, False),
                ("k", self.name == "topk", self.k, 0),
                ("density", self.name == "topk", self.density, 0.0),
                ("side", self.name in ("int8", "topk"), self.side, "float32"),
            )
            if not used and value != default
        ]
        if unused:
            raise ConfigError(f"scheme {self.name!r} takes no {', '.join(unused)}")
        if self.name == "int8" and (self.granularity == "block") != (self.block > 0):
            raise ConfigError("int8 needs block > 0 exactly when granularity is 'block'")
        if self.name == "topk":
            if self.granularity == "block":
                raise ConfigError("topk selects per tensor or per row, not per block")
            if (self.k > 0) == (self.density > 0):
                raise ConfigError("topk needs exactly one of k > 0 or density in (0, 1]")

    @property
    def label(self) -> str:
        """Short human-readable form for logs and reports, e.g. ``int8(granularity=row, offset)``."""
        default = Scheme()
        parts = []
        for name in ("granularity", "block", "offset", "stochastic", "k", "density", "side", "delta"):
            value = getattr(self, name)
            if value != getattr(default, name):
                parts.append(name if value is True else f"{name}={value}")
        return self.name + (f"({', '.join(parts)})" if parts else "")

    @classmethod
    def parse(cls, text: str, *, granularity: str = "tensor") -> Scheme:
        """A scheme from its command-line form ``NAME[:OPTION,...]``, options being ``tensor``/``row``/``block=N``,
        ``offset``, ``stochastic``, ``k=N``, ``density=F``, ``side=float16``; e.g. ``int8:row,offset``,
        ``topk:density=0.01``, ``float16``. ``granularity`` is the default when the text names none."""
        name, _, rest = text.strip().partition(":")
        values: dict[str, object] = {"name": name.strip()}
        if name.strip() in ("int8", "topk"):
            values["granularity"] = granularity
        for option in (o.strip() for o in rest.split(",") if o.strip()):
            key, eq, raw = option.partition("=")
            try:
                if option in GRANULARITIES:
                    values["granularity"] = option
                elif option in ("offset", "stochastic") and not eq:
                    values[option] = True
                elif key == "block" and eq:
                    values["granularity"], values["block"] = "block", int(raw)
                elif key == "k" and eq:
                    values["k"] = int(raw)
                elif key == "density" and eq:
                    values["density"] = float(raw)
                elif key == "side" and eq:
                    values["side"] = raw
                else:
                    raise ConfigError(f"unknown option {option!r}")
            except ConfigError as exc:  # (a ValueError too: caught first)
                raise ConfigError(
                    f"compression {text!r}: {exc}; options: tensor, row, block=N, offset, stochastic, k=N, "
                    "density=F, side=float16"
                ) from None
            except ValueError:
                raise ConfigError(f"compression {text!r}: option {option!r} needs a number") from None
        return cls(**values)  # type: ignore[arg-type]

    @property
    def text(self) -> str:
        """The command-line form :meth:`parse` reads back."""
        options = []
        if self.name in ("int8", "topk"):
            options.append(f"block={self.block}" if self.granularity == "block" else self.granularity)
        options += [flag for flag in ("offset", "stochastic") if getattr(self, flag)]
        options += [f"k={self.k}"] * (self.k > 0) + [f"density={self.density}"] * (self.density > 0)
        options += [f"side={self.side}"] * (self.side != "float32")
        return self.name + (":" + ",".join(options) if options else "")

    def to_meta(self, prefix: str = META_PREFIX) -> dict[str, str]:
        """The scheme as message metadata under ``prefix``: its name and every field that differs from the default
        (an absent field reads back as its default)."""
        default = wire.to_params(Scheme())
        return {prefix + k: v for k, v in wire.to_params(self).items() if k == "name" or v != default[k]}

    @classmethod
    def from_meta(cls, meta: Mapping[str, str], prefix: str = META_PREFIX) -> Scheme:
        """The scheme a peer declared; CodecError when none is declared, a key is unknown or a value is invalid."""
        if prefix + "name" not in meta:
            raise CodecError(f"the message declares no compression scheme ({prefix}name is absent)")
        known = {prefix + f.name for f in wire.wire_fields(cls)}
        unknown = sorted(k for k in meta if k.startswith(prefix) and k not in known)
        if unknown:
            raise CodecError(f"unknown compression fields {[wire.printable(k, 40) for k in unknown[:4]]}")
        return wire.from_params(cls, meta, prefix=prefix)


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a tensor: what a receiver expects, or what a coded part must be."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if len(self.shape) > 8 or any(not isinstance(d, int) or d < 0 for d in self.shape):
            raise ConfigError(f"a tensor shape has at most 8 non-negative dimensions, got {self.shape}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, tensor: Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype)


def specs(tensors: Mapping[str, Tensor]) -> dict[str, TensorSpec]:
    """The spec of every tensor, by name (e.g. of the broadcast a delta is against)."""
    return {name: TensorSpec.of(t) for name, t in tensors.items()}


@dataclass(frozen=True)
class Encoded:
    """Coded tensors ready for a message, the scheme's metadata, and the bytes before and after."""

    tensors: dict[str, Tensor]  # what travels, by name and part
    meta: dict[str, str]  # the scheme, to merge into the message metadata
    scheme: Scheme
    raw_bytes: int  # numel x itemsize of the uncompressed tensors (float32): the ledger's "uncompressed" column

    @property
    def tensor_bytes(self) -> int:
        """numel x itemsize of what travels."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class Residual:
    """Error-feedback state a client keeps across rounds: what it has not sent yet, by tensor name (float32)."""

    tensors: Mapping[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, t in self.tensors.items():
            if t.dtype != torch.float32:
                raise ConfigError(f"residual {name!r} must be float32, got {t.dtype}")


# --- layout: coded parts of one tensor ----------------------------------------------------------------------------


def _compressed(spec: TensorSpec) -> bool:
    return spec.dtype == torch.float32 and spec.numel > 0


def _row_length(shape: tuple[int, ...]) -> int:
    return shape[-1] if shape else 1


def _unit(spec: TensorSpec, scheme: Scheme) -> int:
    """Values per int8 scale / per top-k selection."""
    if scheme.granularity == "row":
        return _row_length(spec.shape)
    if scheme.granularity == "block":
        return min(scheme.block, spec.numel)
    return spec.numel


def _kept(scheme: Scheme, n: int) -> int:
    k = scheme.k if scheme.k > 0 else max(1, math.ceil(scheme.density * n))
    return min(k, n)


def _index_dtype(n: int) -> torch.dtype:
    """Smallest integer dtype holding indices 0..n-1."""
    if n <= 256:
        return torch.uint8
    if n <= 1 << 15:
        return torch.int16
    return torch.int32 if n <= 1 << 31 else torch.int64


def _parts(spec: TensorSpec, scheme: Scheme) -> dict[str, TensorSpec]:
    """Coded parts of one tensor by part name ("" = the main part, under the tensor's own name)."""
    if not _compressed(spec) or scheme.name == "float32":
        return {"": spec}
    if scheme.name == "float16":
        return {"": TensorSpec(spec.shape, torch.float16)}
    side = SIDE_DTYPES[scheme.side]
    unit = _unit(spec, scheme)
    units = -(-spec.numel // unit)  # ceil
    if scheme.name == "int8":
        parts = {"": TensorSpec(spec.shape, torch.uint8 if scheme.offset else torch.int8)}
        parts["scale"] = TensorSpec((units,), side)
        if scheme.offset:
            parts["offset"] = TensorSpec((units,), side)
        return parts
    k = _kept(scheme, unit)  # topk
    parts = {"": TensorSpec((units, k), side), "index": TensorSpec((units, k), _index_dtype(unit))}
    if scheme.granularity == "row":
        parts["mass"] = TensorSpec((units,), side)
    return parts


def _wire_name(name: str, part: str) -> str:
    return name + PART_SEP + part if part else name


def coded_specs(expect: Mapping[str, TensorSpec], scheme: Scheme) -> dict[str, TensorSpec]:
    """Every coded tensor (name and part) that tensors of these specs travel as under ``scheme``."""
    out: dict[str, TensorSpec] = {}
    for name, spec in expect.items():
        for part, pspec in _parts(spec, scheme).items():
            out[_wire_name(name, part)] = pspec
    return out


def coded_bytes(expect: Mapping[str, TensorSpec], scheme: Scheme) -> int:
    """Tensor bytes that tensors of these specs cost under ``scheme``, without encoding anything (for cost tables)."""
    return sum(s.nbytes for s in coded_specs(expect, scheme).values())


def raw_bytes(expect: Mapping[str, TensorSpec]) -> int:
    """Tensor bytes of the uncompressed tensors."""
    return sum(s.nbytes for s in expect.values())


# --- encode -------------------------------------------------------------------------------------------------------


def _cast_down(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype``, rounded towards -inf (the result is <= t)."""
    c = t.to(dtype)
    return torch.where(c.float() > t, torch.nextafter(c, torch.full_like(c, -math.inf)), c)


def _cast_up(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype``, rounded towards +inf (the result is >= t)."""
    c = t.to(dtype)
    return torch.where(c.float() < t, torch.nextafter(c, torch.full_like(c, math.inf)), c)


def _blocks(x: Tensor, unit: int) -> Tensor:
    """Flattened ``x`` as rows of ``unit`` values, the last one padded with its last value."""
    flat = x.reshape(-1)  # (n,)
    pad = -flat.numel() % unit
    if pad:
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    return flat.view(-1, unit)  # (units, unit)


def _round(v: Tensor, stochastic: bool, generator: torch.Generator | None) -> Tensor:
    if not stochastic:
        return torch.round(v)
    return torch.floor(v + torch.rand(v.shape, generator=generator))  # unbiased: E[floor(v + u)] = v


def _encode_int8(x: Tensor, scheme: Scheme, unit: int, generator: torch.Generator | None) -> dict[str, Tensor]:
    side = SIDE_DTYPES[scheme.side]
    xb = _blocks(x, unit)  # (units, unit)
    if scheme.offset:
        lo = _cast_down(xb.amin(1), side)  # (units,)
        span, levels, qmin, qmax, qdtype = xb.amax(1) - lo.float(), 255, 0, 255, torch.uint8
    else:
        lo = torch.zeros(xb.shape[0], dtype=side)
        span, levels, qmin, qmax, qdtype = xb.abs().amax(1), 127, -127, 127, torch.int8
    scale = _cast_up(span / levels, side)  # (units,)
    if not (bool(torch.isfinite(scale).all()) and bool(torch.isfinite(lo).all())):
        raise CodecError(f"int8 scales or offsets overflow side={scheme.side}; use side='float32'")
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = _round((xb - lo.float()[:, None]) / safe[:, None], scheme.stochastic, generator)  # (units, unit)
    q = q.clamp_(qmin, qmax).to(qdtype).reshape(-1)[: x.numel()].view(x.shape)
    out = {"": q, "scale": scale}
    if scheme.offset:
        out["offset"] = lo
    return out


def _encode_topk(x: Tensor, scheme: Scheme, unit: int) -> dict[str, Tensor]:
    side = SIDE_DTYPES[scheme.side]
    xr = x.reshape(-1, unit)  # (R, C)
    k = _kept(scheme, unit)
    by_row = scheme.granularity == "row"
    idx = torch.topk(xr if by_row else xr.abs(), k, dim=1).indices.sort(dim=1).values  # (R, k)
    exact = xr.gather(1, idx)  # (R, k)
    values = exact.to(side)  # (R, k)
    if not bool(torch.isfinite(values).all()):
        raise CodecError(f"top-k values overflow side={scheme.side}; use side='float32'")
    out = {"": values, "index": idx.to(_index_dtype(unit))}
    if by_row:
        if k == unit:
            mass = torch.zeros(xr.shape[0])  # (R,) nothing dropped
        else:
            dropped = xr.scatter(1, idx, 0.0)  # (R, C) kept entries zeroed
            mass = dropped.sum(1) + (exact - values.float()).sum(1)  # (R,) the kept values' rounding included
            mass = torch.where((dropped >= 0).all(1), mass.clamp(min=0.0), mass)  # non-negative rows stay so
        out["mass"] = mass.to(side)
        if not bool(torch.isfinite(out["mass"]).all()):
            raise CodecError(f"top-k dropped mass overflows side={scheme.side}; use side='float32'")
    return out


def _encode_one(x: Tensor, scheme: Scheme, generator: torch.Generator | None) -> dict[str, Tensor]:
    spec = TensorSpec.of(x)
    if not _compressed(spec) or scheme.name == "float32":
        return {"": x}
    if scheme.name == "float16":
        if bool((x.abs() > FP16_MAX).any()):
            raise CodecError(f"values beyond float16's range (|x| > {FP16_MAX:g}); use int8 or float32")
        return {"": x.to(torch.float16)}
    unit = _unit(spec, scheme)
    if scheme.name == "int8":
        return _encode_int8(x, scheme, unit, generator)
    return _encode_topk(x, scheme, unit)


def _check_names(tensors: Mapping[str, Tensor]) -> None:
    bad = [n for n in tensors if PART_SEP in n]
    if bad:
        raise CodecError(f"tensor names must not contain {PART_SEP!r}: {bad[:4]}")


def _prepare(
    tensors: Mapping[str, Tensor], scheme: Scheme, reference: Mapping[str, Tensor] | None
) -> dict[str, Tensor]:
    """Detached CPU tensors, minus the reference for a delta scheme; CodecError for non-finite float32 input."""
    _check_names(tensors)
    out = {}
    for name, t in tensors.items():
        x = t.detach().cpu()
        if x.dtype == torch.float32:
            if not bool(torch.isfinite(x).all()):
                raise CodecError(f"tensor {name!r} holds non-finite values; it cannot be compressed")
            if scheme.delta:
                if reference is None or name not in reference or reference[name].shape != x.shape:
                    raise ConfigError(f"a delta scheme needs a reference tensor {name!r} of shape {tuple(x.shape)}")
                x = x - reference[name].detach().cpu().float()  # (same shape)
        out[name] = x
    return out


def _encode_values(
    values: Mapping[str, Tensor], scheme: Scheme, generator: torch.Generator | None
) -> dict[str, Tensor]:
    if scheme.stochastic and generator is None:
        raise ConfigError("stochastic rounding needs a torch.Generator (randomness is passed in, never global)")
    coded: dict[str, Tensor] = {}
    for name, x in values.items():
        for part, t in _encode_one(x, scheme, generator).items():
            coded[_wire_name(name, part)] = t.contiguous()
    return coded


def encode(
    tensors: Mapping[str, Tensor],
    scheme: Scheme,
    *,
    reference: Mapping[str, Tensor] | None = None,
    generator: torch.Generator | None = None,
    prefix: str = META_PREFIX,
) -> Encoded:
    """Compress ``tensors`` under ``scheme``: the coded tensors, the scheme's metadata and both byte counts.

    With ``scheme.delta`` the float32 tensors are first reduced by ``reference`` (the broadcast they update);
    ``generator`` drives stochastic rounding.
    """
    values = _prepare(tensors, scheme, reference)
    coded = _encode_values(values, scheme, generator)
    return Encoded(coded, scheme.to_meta(prefix), scheme, raw_bytes(specs(values)))


def encode_with_feedback(
    tensors: Mapping[str, Tensor],
    scheme: Scheme,
    residual: Residual,
    *,
    reference: Mapping[str, Tensor] | None = None,
    generator: torch.Generator | None = None,
    prefix: str = META_PREFIX,
) -> tuple[Encoded, Residual]:
    """:func:`encode` with error feedback: ``residual`` is added before compressing, and the part of the result
    that did not travel is the new residual (sum of what was sent + residual = sum of the true values)."""
    values = _prepare(tensors, scheme, reference)
    for name, r in residual.tensors.items():
        if name not in values or values[name].dtype != torch.float32 or r.shape != values[name].shape:
            raise ConfigError(f"residual {name!r} does not fit the tensors (a new model? start from Residual())")
        values[name] = values[name] + r  # (same shape)
    coded = _encode_values(values, scheme, generator)
    expect = specs(values)
    sent = _decode_values(coded, expect, scheme)
    left = {n: values[n] - sent[n] for n, s in expect.items() if s.dtype == torch.float32}
    return Encoded(coded, scheme.to_meta(prefix), scheme, raw_bytes(expect)), Residual(left)


# --- decode -------------------------------------------------------------------------------------------------------


def _finite(t: Tensor, what: str) -> None:
    if not bool(torch.isfinite(t).all()):
        raise CodecError(f"{what} holds non-finite values")


def _decode_int8(name: str, p: Mapping[str, Tensor], spec: TensorSpec, scheme: Scheme) -> Tensor:
    scale = p["scale"].float()  # (units,)
    _finite(scale, f"{name}{PART_SEP}scale")
    if bool((scale < 0).any()):
        raise CodecError(f"{name}{PART_SEP}scale holds negative scales")
    lo = p["offset"].float() if scheme.offset else torch.zeros_like(scale)  # (units,)
    _finite(lo, f"{name}{PART_SEP}offset")
    unit = _unit(spec, scheme)
    q = _blocks(p[""].float(), unit)  # (units, unit)
    x = lo[:, None] + q * scale[:, None]  # (units, unit)
    return x.reshape(-1)[: spec.numel].view(spec.shape)


def _decode_topk(name: str, p: Mapping[str, Tensor], spec: TensorSpec, scheme: Scheme) -> Tensor:
    unit = _unit(spec, scheme)
    values = p[""].float()  # (R, k)
    _finite(values, name)
    idx = p["index"].long()  # (R, k)
    k = idx.shape[1]
    if bool(((idx < 0) | (idx >= unit)).any()):
        raise CodecError(f"{name}{PART_SEP}index holds indices outside 0..{unit - 1}")
    ordered = idx.sort(dim=1).values  # (R, k)
    if k > 1 and not bool((ordered[:, 1:] != ordered[:, :-1]).all()):
        raise CodecError(f"{name}{PART_SEP}index repeats an index within a row")
    out = torch.zeros(idx.shape[0], unit)  # (R, C), allocated from the receiver's own spec
    if scheme.granularity == "row":
        mass = p["mass"].float()  # (R,)
        _finite(mass, f"{name}{PART_SEP}mass")
        if k == unit:
            if bool((mass != 0).any()):
                raise CodecError(f"{name}{PART_SEP}mass is not zero although no entry was dropped")
        else:
            out += (mass / (unit - k))[:, None]  # the dropped entries share the dropped mass evenly
    out.scatter_(1, idx, values)
    return out.view(spec.shape)


def _decode_values(coded: Mapping[str, Tensor], expect: Mapping[str, TensorSpec], scheme: Scheme) -> dict[str, Tensor]:
    """Decoded tensors from coded tensors already checked against :func:`coded_specs`."""
    out = {}
    for name, spec in expect.items():
        parts = {part: coded[_wire_name(name, part)] for part in _parts(spec, scheme)}
        if not _compressed(spec) or scheme.name == "float32":
            x = parts[""]
        elif scheme.name == "float16":
            x = parts[""].float()
        elif scheme.name == "int8":
            x = _decode_int8(name, parts, spec, scheme)
        else:
            x = _decode_topk(name, parts, spec, scheme)
        if x.dtype == torch.float32:
            _finite(x, f"decoded tensor {name!r}")
        out[name] = x
    return out


def _names(names: list[str]) -> str:
    shown = [wire.printable(n, 60) for n in sorted(names)[:4]]
    return ", ".join(shown) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def decode(
    coded: Mapping[str, Tensor],
    meta: Mapping[str, str],
    expect: Mapping[str, TensorSpec] | None = None,
    *,
    scheme: Scheme | None = None,
    reference: Mapping[str, Tensor] | None = None,
    prefix: str = META_PREFIX,
) -> dict[str, Tensor]:
    """Tensors back from what travelled: float32 where float32 was sent, other dtypes as they came.

    ``meta`` holds the scheme the sender declared; ``scheme`` is the one the receiver asked for (a different
    declaration is refused); ``expect`` the names, shapes and dtypes the receiver expects (default: those of
    ``reference``, the tensors a delta is against). ``coded`` must hold exactly the coded tensors of ``expect``
    under the declared scheme. Any mismatch raises CodecError with the reason.
    """
    declared = Scheme.from_meta(meta, prefix)
    if scheme is not None and declared != scheme:
        raise CodecError(f"the message declares compression {declared.label}, expected {scheme.label}")
    if expect is None:
        if reference is None:
            raise ConfigError("decode needs the expected tensors' specs or the reference they are a delta against")
        expect = specs(reference)
    if declared.delta and reference is None:
        raise CodecError(f"the message declares a delta ({declared.label}) but there is no reference to add it to")
    layout = coded_specs(expect, declared)
    missing = [n for n in layout if n not in coded]
    extra = [n for n in coded if n not in layout]
    if missing or extra:
        raise CodecError(
            f"coded tensors do not match {declared.label}: missing [{_names(missing)}], unexpected [{_names(extra)}]"
        )
    for n, want in layout.items():
        got = coded[n]
        if got.dtype != want.dtype or tuple(got.shape) != want.shape:
            raise CodecError(
                f"coded tensor {wire.printable(n, 60)!r} under {declared.label} must be {want.dtype} {want.shape}, "
                f"got {got.dtype} {tuple(got.shape)}"
            )
    out = _decode_values(coded, expect, declared)
    if declared.delta:
        assert reference is not None  # checked above
        for name, spec in expect.items():
            if spec.dtype == torch.float32:
                ref = reference.get(name)
                if ref is None or ref.dtype != torch.float32 or tuple(ref.shape) != spec.shape:
                    raise ConfigError(f"the reference lacks a float32 tensor {name!r} of shape {spec.shape}")
                out[name] = ref.detach().cpu() + out[name]  # (same shape)
    return out
