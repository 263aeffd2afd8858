"""A client runtime on ONNX Runtime: inference only.

ONNX Runtime (the ``onnxruntime`` package) has no backward pass, and every algorithm's client half trains locally
(FedAvg/FedNTD/FedLSD/FedCAD on weights, FD and DS-FL on their own models), so an ONNX Runtime client cannot be a full
participant. What it can do:

- evaluate: logits (and so accuracy) of whatever weights it is given, e.g. the global model of a FedAvg-family round,
  with the session rebuilt from those weights (:meth:`set_weights`);
- with ``train_policy="skip"``, take part in **FD and DS-FL as a predict-only client**: local steps are skipped, its
  model is the one it was deployed with (the ONNX file's weights, also what :meth:`init_weights` returns), and it
  uploads that model's per-class outputs (FD, eq. 4) or predictions on the round's open samples (DS-FL, eq. 9).
  Its uploads are valid but its model never learns; do not enrol it in FedAvg-family runs, where it would upload the
  global weights unchanged.

With the default ``train_policy="refuse"`` a training task raises :class:`ConfigError`, which makes the client drop
out of that round with the reason logged (as a client that cannot compute its task does).

On-device training with ONNX is the ``onnxruntime-training`` runtime (:mod:`edge_client.backends.ort_training`), in a
separate environment with its own client process: that package ships the same ``onnxruntime`` Python package (never
install both in one environment) and needs ``onnx==1.17.0`` (docs/on_device.md).
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

from edge_client.backends.runners import OnnxRunner
from fedge.errors import ConfigError
from fedge.learning.models import exchanged_state
from fedge.learning.training import TrainRequest, TrainStats
from fedge.programs.spec import ModelSpec
from fedge.types import StateDict

log = logging.getLogger(__name__)

TrainPolicy = Literal["refuse", "skip"]


class OnnxRuntimeBackend:
    """The :class:`fedge.learning.backend.Backend` protocol on an ONNX Runtime session; see the module docstring for
    limits."""

    runtime = "onnxruntime"

    def __init__(
        self,
        model: str,
        input_shape: tuple[int, ...],
        num_classes: int,
        *,
        onnx_model: bytes,
        source: str = "ONNX model",
        train_policy: TrainPolicy = "refuse",
        threads: int = 0,
    ) -> None:
        """``onnx_model``: the deployed ``.onnx`` file's bytes (checked by whoever loaded it)."""
        if train_policy not in ("refuse", "skip"):
            raise ConfigError(f"train_policy must be 'refuse' or 'skip', got {train_policy!r}")
        self.spec = ModelSpec(model, tuple(input_shape), num_classes)
        self.train_policy = train_policy
        self._runner = OnnxRunner(onnx_model, source=source, threads=threads)
        if self._runner.meta.model != self.spec:
            raise ConfigError(f"{source} holds {self._runner.meta.model}, but this client's data is for {self.spec}")
        self._deployed = self._runner.get_weights()

    def set_weights(self, state: StateDict) -> None:
        self._runner.set_weights(state)

    def get_weights(self) -> StateDict:
        return self._runner.get_weights()

    def init_weights(self, seed: int) -> StateDict:
        """Seeded initial weights, as on every runtime; a predict-only client's model is its deployed one instead."""
        if self.train_policy == "skip":
            return {k: v.clone() for k, v in self._deployed.items()}
        return exchanged_state(self.spec.build(seed=seed))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self._runner.logits(x)

    def train(self, request: TrainRequest) -> TrainStats:
        kind = request.objective.kind
        if self.train_policy == "skip":
            log.info("onnxruntime client: skipping %d epochs of %s training (predict-only)", request.epochs, kind)
            return TrainStats(steps=0, samples=0, mean_loss=0.0)
        raise ConfigError(
            f"an onnxruntime client cannot train (task asks for {request.epochs} epochs of {kind!r}): ONNX Runtime "
            "has no backward pass. Use --runtime executorch or torch for training clients; an onnxruntime client can "
            "serve FD and DS-FL as a predict-only client (--predict-only)"
        )
