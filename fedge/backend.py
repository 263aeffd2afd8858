"""What a client needs from a compute runtime, and the PyTorch implementation.

Algorithms talk to a :class:`Backend`, never to a framework, so the same client logic runs on PyTorch (CPU or CUDA,
the Jetson path) and on exported programs (ExecuTorch, ONNX Runtime; see ``edge_client``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from fedge.models import build_model, exchanged_state, load_exchanged_state
from fedge.training import TrainRequest, TrainStats, predict_logits, train
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
    """PyTorch eager execution on a CPU or CUDA device."""

    runtime = "torch"

    def __init__(self, model: str, input_shape: tuple[int, ...], num_classes: int, device: str = "cpu") -> None:
        self.model_name = model
        self.input_shape = tuple(input_shape)
        self.num_classes = num_classes
        self.device = resolve_device(device)
        self.model = build_model(model, input_shape=self.input_shape, num_classes=num_classes, seed=0).to(self.device)

    def set_weights(self, state: StateDict) -> None:
        load_exchanged_state(self.model, state)

    def get_weights(self) -> StateDict:
        return {k: v.cpu() for k, v in exchanged_state(self.model).items()}

    def init_weights(self, seed: int) -> StateDict:
        fresh = build_model(self.model_name, input_shape=self.input_shape, num_classes=self.num_classes, seed=seed)
        return exchanged_state(fresh)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return predict_logits(self.model, x)

    def train(self, request: TrainRequest) -> TrainStats:
        return train(self.model, request)
