"""Tensor helpers every layer shares: named tensors read back from saved state (a server optimizer's moments in
:mod:`fedge.aggregation.server_step`, a strategy's state in :mod:`fedge.algorithms`), and the L2 norm that the clips
of DP-FedAvg and secure aggregation compare with their bound."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt
import torch

from fedge.errors import ConfigError
from fedge.types import StateDict

NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)
"""The dtypes whose ``Tensor.numpy()`` is a view (bfloat16 and the integers need torch to cast them)."""


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


def l2_norm(x: npt.NDArray[np.float64]) -> float:
    """``||x||_2`` summed in numpy's own single-threaded loop (``einsum``), never BLAS: ``np.linalg.norm``'s BLAS
    ``dot`` sums in an order that depends on the BLAS thread count (its last bits differ between 1 and 2 threads),
    so a clip decided by it, and every released bit after it, would change with the machine's thread settings; it
    also waits on its threads when the cores are busy (8 ms against 0.02 ms a call on a loaded 2-core machine)."""
    return float(np.sqrt(np.einsum("i,i->", x, x)))
