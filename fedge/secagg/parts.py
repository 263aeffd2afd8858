"""What one client's masked input is made of: one or more *parts*, each a run of the reply's tensors, concatenated
into the one vector the protocol masks and sums (one protocol run, one ring, one clip bound).

An algorithm of the FedAvg family names its parts (``secure_parts()`` on its server half; by default the first
alone). With ``w`` the broadcast weights, ``y_k`` a reply's tensors, ``C`` the clip bound and ``s_k`` the client's
share (``secure_shares()``; by default ``a_k / A``, its averaging weight over the round's total):

- the first part is always the model's move, weighted: ``s_k clip_C(y_k - w)``. The server divides the survivors'
  sum by ``sum_{U3} s_k`` and adds it to ``w``: their weighted mean model (FedAvg, FedProx, FedNTD, FedAdam...).
- a further part is *relative* (``y_k - w`` of the named tensors: a model's move) or not (the tensors as sent: a
  delta already, e.g. SCAFFOLD's control-variate delta), and *weighted* (``s_k`` times it: the server gets the
  survivors' weighted mean) or not (once: the server gets the survivors' plain sum, e.g. FedDyn's drift sum).

Each part is clipped to L2 norm ``C`` on its own, so every coordinate of ``s_k`` (<= 1) or 1 times a part lies in
``[-C, C]``: the ring's bound, which the ring plan sizes for the cohort's sum. The server hands the inner strategy
one reply standing for the survivors (:meth:`PartLayout.stand_in`): each part's mean (weighted) or sum (plain)
under the part's ``into`` prefix, the reply's own tensor names by default.

Over MQTT the first part's names ride in the broadcast's ``secagg.layout``, the others in :data:`PARTS_PARAM`
(:func:`parts_param`, :func:`parse_parts`), so a device builds the same vector; it learns ``s_k`` with the share
delivery.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from fedge.aggregation.flat import FlatLayout, Spec
from fedge.secagg.errors import MessageError, SecAggConfigError
from fedge.secagg.messages import PREFIX

PARTS_PARAM = PREFIX + "parts"
"""Broadcast param: the parts after the first, ``;``-separated, each ``<r|a><w|u>:name,name,...`` (relative or as
sent; weighted or unweighted). Absent: the first part alone."""

_MAX_PARTS = 8
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,200}")
_PART = re.compile(r"([ra])([wu]):(.+)")


@dataclass(frozen=True)
class SecurePart:
    """A run of the reply's tensors in the masked vector: ``relative`` (minus the broadcast's tensor of the same
    name) or as sent; ``weighted`` (times the client's share: the server gets the survivors' mean) or not (the plain
    sum); ``into``: the prefix the stand-in reply's tensors of this part get ("" keeps the reply's names)."""

    tensors: tuple[str, ...]
    relative: bool = True
    weighted: bool = True
    into: str = ""

    def __post_init__(self) -> None:
        if not self.tensors or len(set(self.tensors)) != len(self.tensors):
            raise SecAggConfigError("a secure-aggregation part names one or more distinct tensors")
        bad = [n for n in self.tensors if not _NAME.fullmatch(n)]
        if bad:
            raise SecAggConfigError(f"tensor names of a secure-aggregation part are [A-Za-z0-9_.-]: {bad[:3]}")

    @property
    def code(self) -> str:
        """The part in :data:`PARTS_PARAM`'s notation."""
        return f"{'r' if self.relative else 'a'}{'w' if self.weighted else 'u'}:{','.join(self.tensors)}"


def parts_param(parts: Sequence[SecurePart]) -> dict[str, str]:
    """The broadcast params that tell a device the parts after the first (none when there is one part)."""
    rest = parts[1:]
    return {PARTS_PARAM: ";".join(p.code for p in rest)} if rest else {}


def parse_parts(first: Sequence[str], params: Mapping[str, str]) -> tuple[SecurePart, ...]:
    """The parts a broadcast announces: ``first`` (its layout: the model's weighted move) and those of
    :data:`PARTS_PARAM`; MessageError for anything malformed."""
    raw = params.get(PARTS_PARAM)
    try:
        parts = [SecurePart(tuple(first))]
        if raw is None:
            return tuple(parts)
        if not isinstance(raw, str) or len(raw) > 1 << 20 or raw.count(";") >= _MAX_PARTS:
            raise MessageError(f"param {PARTS_PARAM} is longer than {_MAX_PARTS} parts or 1 MiB")
        for code in raw.split(";"):
            m = _PART.fullmatch(code)
            if m is None:
                raise MessageError(f"param {PARTS_PARAM}: a part is '<r|a><w|u>:name,...', got {code[:60]!r}")
            names = tuple(m.group(3).split(","))
            parts.append(SecurePart(names, relative=m.group(1) == "r", weighted=m.group(2) == "w"))
    except SecAggConfigError as exc:
        raise MessageError(f"param {PARTS_PARAM}: {exc}") from None
    return tuple(parts)


class PartLayout:
    """The parts' tensors as one flat vector of :attr:`dim` values, and back.

    ``specs``: each tensor's shape and dtype (the reply's)."""

    def __init__(self, parts: Sequence[SecurePart], specs: Mapping[str, Spec]) -> None:
        if not parts or not (parts[0].relative and parts[0].weighted and not parts[0].into):
            raise SecAggConfigError("the first secure-aggregation part is the model's weighted move")
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

    @property
    def model(self) -> FlatLayout:
        """The first part's layout: the model's tensors."""
        return self.layouts[0]

    def vector(
        self, update: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], bound: float
    ) -> tuple[npt.NDArray[np.float64], int]:
        """The client's unweighted vector (dim,): each part (minus ``reference`` where relative) clipped to L2 norm
        ``bound`` on its own; and how many parts the clip shortened."""
        out, clipped = [], 0
        for p, layout in zip(self.parts, self.layouts, strict=True):
            x = layout.flatten(update)  # (d_p,)
            if p.relative:
                x = x - layout.flatten(reference)
            norm = float(np.linalg.norm(x))
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
                    s = layout.flatten(reference) + s
            out.update({p.into + k: v for k, v in layout.unflatten(s).items()})
        return out


def default_parts(model: Sequence[str]) -> tuple[SecurePart, ...]:
    """The FedAvg family's one part: the model's weighted move."""
    return (SecurePart(tuple(model)),)
