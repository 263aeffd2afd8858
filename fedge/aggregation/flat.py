"""A model's exchanged tensors as one flat float64 vector, and back: what secure aggregation encodes and masks and
DP-FedAvg clips and noises, as one vector per client."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt
import torch

Spec = tuple[tuple[int, ...], torch.dtype]  # a tensor's shape and dtype (fedge.algorithms.base.TensorSpec)


class FlatLayout:
    """The order and shapes of the tensors in ``specs``: :meth:`flatten` concatenates them in that order,
    :meth:`unflatten` cuts a vector of :attr:`dim` values back into them (each cast to its dtype)."""

    def __init__(self, specs: Mapping[str, Spec]) -> None:
        self.specs: dict[str, Spec] = dict(specs)
        self.dim = sum(math.prod(shape) for shape, _ in self.specs.values())

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> npt.NDArray[np.float64]:
        parts = [tensors[k].detach().cpu().reshape(-1).to(torch.float64).numpy() for k in self.specs]
        return np.concatenate(parts) if parts else np.zeros(0)  # (dim,)

    def unflatten(self, flat: npt.NDArray[np.float64]) -> dict[str, torch.Tensor]:
        out, start = {}, 0
        for k, (shape, dtype) in self.specs.items():
            size = math.prod(shape)
            out[k] = torch.from_numpy(flat[start : start + size].copy()).reshape(shape).to(dtype)
            start += size
        return out
