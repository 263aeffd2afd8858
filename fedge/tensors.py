"""Named tensors read back from saved state: one helper for every layer that restores what it saved (a server
optimizer's moments in :mod:`fedge.aggregation.server_step`, a strategy's state in :mod:`fedge.algorithms`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedge.errors import ConfigError
from fedge.types import StateDict


def tensors_like(tensors: Mapping[str, torch.Tensor], prefix: str, like: Mapping[str, torch.Tensor]) -> StateDict:
    """``like``'s entries read back from ``tensors[prefix + name]``, in ``like``'s order (for :meth:`Strategy.
    load_state`); ConfigError naming the first one that is missing or has another shape or dtype."""
    out: StateDict = {}
    for name, ref in like.items():
        t = tensors.get(prefix + name)
        if t is None or t.shape != ref.shape or t.dtype != ref.dtype:
            found = "missing" if t is None else f"{t.dtype}{list(t.shape)}"
            raise ConfigError(f"saved state {prefix + name!r} is {found}, expected {ref.dtype}{list(ref.shape)}")
        out[name] = t
    return out
