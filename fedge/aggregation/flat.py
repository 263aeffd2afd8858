"""A model's exchanged tensors as one flat float64 vector, and back: what secure aggregation encodes and masks and
DP-FedAvg clips and noises, as one vector per client."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt
import torch

from fedge.tensors import NUMPY_FLOATS

Spec = tuple[tuple[int, ...], torch.dtype]  # a tensor's shape and dtype (fedge.algorithms.base.TensorSpec)


class FlatLayout:
    """The order and shapes of the tensors in ``specs``: :meth:`flatten` concatenates them in that order,
    :meth:`unflatten` cuts a vector of :attr:`dim` values back into them (each cast to its dtype)."""

    def __init__(self, specs: Mapping[str, Spec]) -> None:
        self.specs: dict[str, Spec] = dict(specs)
        self.dim = sum(math.prod(shape) for shape, _ in self.specs.values())

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> npt.NDArray[np.float64]:
        out = np.empty(self.dim)  # (dim,)
        self.flatten_into(tensors, out)
        return out

    def flatten_into(
        self,
        tensors: Mapping[str, torch.Tensor],
        out: npt.NDArray[np.float64],
        minus: npt.NDArray[np.float64] | None = None,
    ) -> None:
        """Write :meth:`flatten` of ``tensors`` into ``out`` (dim,), less ``minus`` (dim,) when given: the values of
        ``flatten(tensors) - minus`` bit for bit (float64 holds every float32 exactly), in one pass per tensor and
        no temporary of the vector's size (the server flattens every reply: 1.66M values each for fedavg_cnn)."""
        start = 0
        for k, (shape, _) in self.specs.items():
            stop = start + math.prod(shape)
            source = tensors[k].detach().cpu().reshape(-1)
            piece = out[start:stop]  # (size,) a view
            if source.dtype not in NUMPY_FLOATS:  # bfloat16, integers: torch casts, then as float64
                torch.from_numpy(piece).copy_(source)
                source = torch.from_numpy(piece)
            # numpy, one pass (the float32 -> float64 cast within): one thread, no wait for torch's workers on a busy
            # machine
            if minus is None:
                np.copyto(piece, source.numpy())
            else:
                np.subtract(source.numpy(), minus[start:stop], out=piece)
            start = stop

    def unflatten(self, flat: npt.NDArray[np.float64]) -> dict[str, torch.Tensor]:
        out, start = {}, 0
        for k, (shape, dtype) in self.specs.items():
            size = math.prod(shape)
            # one copy, cast as it is made (a float64 tensor is copied too: the result never shares ``flat``)
            out[k] = torch.from_numpy(flat[start : start + size]).reshape(shape).to(dtype, copy=True)
            start += size
        return out
