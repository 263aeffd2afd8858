"""What one client's masked input is made of: one or more *parts*, each a run of the reply's tensors, concatenated
into the one vector the protocol masks and sums (one protocol run, one ring, one clip bound).

An algorithm names its parts (``secure_parts()`` on its server half; by default one: the model's weighted move).
With ``w`` the broadcast weights, ``y_k`` a reply's tensors, ``C`` the clip bound and ``s_k`` the client's share
(``secure_shares()``; by default ``a_k / A``, its averaging weight over the round's total), a part is

- *relative* (``y_k - w`` of the named tensors: a model's move) or not (the tensors as sent: a delta already, e.g.
  SCAFFOLD's control-variate delta, or outputs, DS-FL's soft labels);
- *weighted* (``s_k`` times it: the server divides the survivors' sum by ``sum_{U3} s_k`` and gets their weighted
  mean, plus ``w`` where relative: FedAvg, FedProx, FedNTD, FedAdam...) or not (once: the server gets the survivors'
  plain sum, e.g. FedDyn's drift sum);
- clipped to L2 norm ``C`` on its own (a move or a delta: the clip is the norm bound that replaces the server's
  plaintext checks), or, for values with a known range (``value_bound``: DS-FL's probabilities, in [0, 1]), only
  per value to ``[-C, C]`` by the encoder, with ``C`` at least that range.

Every coordinate of ``s_k`` (<= 1) or 1 times a part so lies in ``[-C, C]``: the ring's bound, which the ring plan
sizes for the cohort's sum. The server hands the inner strategy one reply standing for the survivors
(:meth:`PartLayout.stand_in`): each part's mean (weighted) or sum (plain) under the part's ``into`` prefix, the
reply's own tensor names by default.

Over MQTT the first part's names ride in the broadcast's ``secagg.layout`` and, unless the parts are the default
one, every part in :data:`PARTS_PARAM` (:func:`parts_param`, :func:`parse_parts`), so a device builds the same
vector; it learns ``s_k`` with the share delivery.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from fedge.aggregation.flat import FlatLayout, Spec
from fedge.secagg.errors import MessageError, SecAggConfigError
from fedge.secagg.messages import PREFIX
from fedge.tensors import l2_norm

PARTS_PARAM = PREFIX + "parts"
"""Broadcast param: every part, ``;``-separated, each ``<r|a><w|u><n|v>:name,name,...`` (relative or as sent;
weighted or unweighted; clipped in L2 norm or per value). Absent: one relative, weighted, norm-clipped part of the
layout's tensors."""

_MAX_PARTS = 8
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,200}")
_PART = re.compile(r"([ra])([wu])([nv]):(.+)")


@dataclass(frozen=True)
class SecurePart:
    """A run of the reply's tensors in the masked vector: ``relative`` (minus the broadcast's tensor of the same
    name) or as sent; ``weighted`` (times the client's share: the server gets the survivors' mean) or not (the plain
    sum); ``value_bound``: None to clip the part to L2 norm C, or the largest |value| an honest client sends (the
    part is then clipped per value only, and C must cover it); ``into``: the prefix the stand-in reply's tensors of
    this part get ("" keeps the reply's names)."""

    tensors: tuple[str, ...]
    relative: bool = True
    weighted: bool = True
    value_bound: float | None = None
    into: str = ""

    def __post_init__(self) -> None:
        if not self.tensors or len(set(self.tensors)) != len(self.tensors):
            raise SecAggConfigError("a secure-aggregation part names one or more distinct tensors")
        bad = [n for n in self.tensors if not _NAME.fullmatch(n)]
        if bad:
            raise SecAggConfigError(f"tensor names of a secure-aggregation part are [A-Za-z0-9_.-]: {bad[:3]}")
        if self.value_bound is not None and not (math.isfinite(self.value_bound) and self.value_bound > 0):
            raise SecAggConfigError(f"a part's value bound is a positive number, got {self.value_bound}")

    @property
    def code(self) -> str:
        """The part in :data:`PARTS_PARAM`'s notation (the value bound is the server's check, not the device's)."""
        flags = ("r" if self.relative else "a") + ("w" if self.weighted else "u")
        return flags + ("n" if self.value_bound is None else "v") + ":" + ",".join(self.tensors)


def parts_param(parts: Sequence[SecurePart]) -> dict[str, str]:
    """The broadcast params that tell a device the parts (none for the default one)."""
    if tuple(parts) == default_parts(parts[0].tensors):
        return {}
    return {PARTS_PARAM: ";".join(p.code for p in parts)}


def parse_parts(first: Sequence[str], params: Mapping[str, str]) -> tuple[SecurePart, ...]:
    """The parts a broadcast announces: those of :data:`PARTS_PARAM`, whose first must name ``first`` (the layout's
    tensors), or the default part of ``first``; MessageError for anything malformed."""
    raw = params.get(PARTS_PARAM)
    try:
        if raw is None:
            return default_parts(first)
        if not isinstance(raw, str) or len(raw) > 1 << 20 or raw.count(";") >= _MAX_PARTS:
            raise MessageError(f"param {PARTS_PARAM} is longer than {_MAX_PARTS} parts or 1 MiB")
        parts = []
        for code in raw.split(";"):
            m = _PART.fullmatch(code)
            if m is None:
                raise MessageError(f"param {PARTS_PARAM}: a part is '<r|a><w|u><n|v>:name,...', got {code[:60]!r}")
            names = tuple(m.group(4).split(","))
            bound = None if m.group(3) == "n" else 1.0  # a device clips nothing per value: the encoder does
            parts.append(SecurePart(names, relative=m.group(1) == "r", weighted=m.group(2) == "w", value_bound=bound))
    except SecAggConfigError as exc:
        raise MessageError(f"param {PARTS_PARAM}: {exc}") from None
    if parts[0].tensors != tuple(first):
        raise MessageError(f"param {PARTS_PARAM}'s first part names other tensors than the layout")
    return tuple(parts)


class PartLayout:
    """The parts' tensors as one flat vector of :attr:`dim` values, and back.

    ``specs``: each tensor's shape and dtype (the reply's)."""

    def __init__(self, parts: Sequence[SecurePart], specs: Mapping[str, Spec]) -> None:
        if not parts:
            raise SecAggConfigError("secure aggregation needs one part or more")
        missing = sorted({n for p in parts for n in p.tensors} - set(specs))
        if missing:
            raise SecAggConfigError(f"secure-aggregation parts name tensors the reply lacks: {missing[:3]}")
        self.parts = tuple(parts)
        self.layouts = tuple(FlatLayout({n: specs[n] for n in p.tensors}) for p in parts)
        self.dim = sum(layout.dim for layout in self.layouts)
        # the reply's values the parts cover, each once: a second part over the same tensors is extra upload
        self.covered = FlatLayout({n: specs[n] for p in parts for n in p.tensors}).dim
        # (dim,) True where a coordinate is multiplied by the client's share
        self.weighted = np.concatenate(
            [np.full(lay.dim, p.weighted) for p, lay in zip(parts, self.layouts, strict=True)]
        )

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> npt.NDArray[np.float64]:
        """(dim,): the parts' tensors as they are, concatenated."""
        out = np.empty(self.dim)  # (dim,)
        self.flatten_into(tensors, out)
        return out

    def flatten_into(
        self,
        tensors: Mapping[str, torch.Tensor],
        out: npt.NDArray[np.float64],
        minus: npt.NDArray[np.float64] | None = None,
    ) -> None:
        """Write :meth:`flatten` of ``tensors`` into ``out`` (dim,), less ``minus`` (dim,) when given, bit for bit
        and without a temporary of the vector's size (:meth:`FlatLayout.flatten_into`)."""
        start = 0
        for layout in self.layouts:
            part = slice(start, start + layout.dim)
            layout.flatten_into(tensors, out[part], None if minus is None else minus[part])
            start = part.stop

    def reference(self, reference: Mapping[str, torch.Tensor]) -> npt.NDArray[np.float64]:
        """(dim,): ``reference`` on the relative parts' coordinates, 0 on the others: what the vector is a move
        from."""
        flat = [
            layout.flatten(reference) if p.relative else np.zeros(layout.dim)
            for p, layout in zip(self.parts, self.layouts, strict=True)
        ]
        return np.concatenate(flat)

    def vector(
        self, update: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], bound: float
    ) -> tuple[npt.NDArray[np.float64], int]:
        """The client's unweighted vector (dim,): each part (minus ``reference`` where relative) clipped to L2 norm
        ``bound`` on its own (a part with a value bound is left to the encoder's per-value clip); and how many parts
        the clip shortened."""
        out, clipped = [], 0
        for p, layout in zip(self.parts, self.layouts, strict=True):
            x = layout.flatten(update)  # (d_p,)
            if p.relative:
                x = x - layout.flatten(reference)
            norm = l2_norm(x) if p.value_bound is None else 0.0
            if norm > bound:
                x, clipped = x * (bound / norm), clipped + 1
            out.append(x)
        return np.concatenate(out), clipped

    def coefficients(self, share: float) -> npt.NDArray[np.float64]:
        """(dim,): ``share`` on the weighted parts' coordinates, 1 on the others."""
        return np.where(self.weighted, share, 1.0)

    def stand_in(
        self,
        reference: Mapping[str, torch.Tensor],
        decoded: npt.NDArray[np.float64],
        weight: float,
        *,
        scale: float = 1.0,
    ) -> dict[str, torch.Tensor]:
        """The tensors of the one reply that stands for the survivors, from the decoded sum ``decoded`` (dim,) and
        ``weight`` = sum_{U3} s_k: a weighted part's mean ``decoded / weight`` (times ``scale``; plus the reference
        where relative: the mean model), a plain part's sum as decoded (the sum of moves, where relative)."""
        out: dict[str, torch.Tensor] = {}
        start = 0
        for p, layout in zip(self.parts, self.layouts, strict=True):
            s = decoded[start : start + layout.dim]  # (d_p,)
            start += layout.dim
            if p.weighted:
                s = s / weight if scale == 1.0 else s / weight * scale
                if p.relative:
                    s += layout.flatten(reference)  # s is a new array: w + s without another one
            out.update({p.into + k: v for k, v in layout.unflatten(s).items()})
        return out


def default_parts(model: Sequence[str]) -> tuple[SecurePart, ...]:
    """The FedAvg family's one part: the model's weighted move."""
    return (SecurePart(tuple(model)),)
