"""What a client needs from a compute runtime, and the PyTorch implementation.

Algorithms talk to a :class:`Backend`, never to a framework, so the same client logic runs on PyTorch (CPU or CUDA,
the Jetson path) and on exported programs (ExecuTorch, ONNX Runtime; see ``edge_client``).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from fedge.learning.models import build_model, exchanged_state, load_exchanged_state
from fedge.learning.training import TrainRequest, TrainStats, predict_logits, train
from fedge.types import StateDict


class Backend(Protocol):
    """A model held by a runtime: weights in and out, inference, and local training."""

    runtime: str

    def set_weights(self, state: StateDict) -> None: ...

    def get_weights(self) -> StateDict: ...

    def init_weights(self, seed: int) -> StateDict:
        """Freshly initialized weights for ``seed`` (the same on every runtime)."""
        ...

    def logits(self, x: torch.Tensor) -> torch.Tensor: ...

    def train(self, request: TrainRequest) -> TrainStats:
        """Run the request on the current weights, in place; ConfigError if this runtime cannot."""
        ...


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when present (the Jetson path), else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class TorchBackend:
    """PyTorch eager execution on a CPU or CUDA device.

    Convolutional models run channels-last (NHWC) on the CPU: oneDNN's convolutions are faster in that layout
    (1.09-1.37x per client step on fedavg_cnn and dsfl_mnist_cnn at one thread, ``benchmarks/executors.py``). The
    weights are the same; float summation order differs, so results move at round-off level (about 1e-6 after one
    local epoch) against the default layout. ``channels_last=False`` keeps the default layout.
    """

    runtime = "torch"

    def __init__(
        self,
        model: str,
        input_shape: tuple[int, ...],
        num_classes: int,
        device: str = "cpu",
        *,
        channels_last: bool | None = None,
    ) -> None:
        self.model_name = model
        self.input_shape = tuple(input_shape)
        self.num_classes = num_classes
        self.device = resolve_device(device)
        self.model = build_model(model, input_shape=self.input_shape, num_classes=num_classes, seed=0).to(self.device)
        has_conv = any(isinstance(m, torch.nn.Conv2d) for m in self.model.modules())
        if channels_last is None:
            channels_last = has_conv and self.device.type == "cpu"
        self.memory_format = torch.channels_last if channels_last and has_conv else torch.contiguous_format
        self.model = self.model.to(memory_format=self.memory_format)  # type: ignore[call-overload]

    def set_weights(self, state: StateDict) -> None:
        load_exchanged_state(self.model, state)

    def get_weights(self) -> StateDict:
        return {k: v.cpu() for k, v in exchanged_state(self.model).items()}

    def init_weights(self, seed: int) -> StateDict:
        fresh = build_model(self.model_name, input_shape=self.input_shape, num_classes=self.num_classes, seed=seed)
        return exchanged_state(fresh)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return predict_logits(self.model, self._layout(x))

    def train(self, request: TrainRequest) -> TrainStats:
        return train(self.model, dataclasses.replace(request, x=self._layout(request.x)))

    def _layout(self, x: torch.Tensor) -> torch.Tensor:
        if self.memory_format is torch.contiguous_format or x.dim() != 4:
            return x
        return x.contiguous(memory_format=self.memory_format)
