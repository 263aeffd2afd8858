"""What an exported program is: the model it was made from, its inputs, and how its names map to the state dict.

Every export carries this description inside the file (ONNX ``metadata_props``; an ExecuTorch constant method
``fedge_meta``), so a file alone says which eager model it must match and how to feed it.

Name mapping. ONNX initializers carry the state-dict names unchanged (the exporter runs without graph optimization, so
no initializer is folded or renamed). ExecuTorch training programs wrap the model as the attribute ``model`` of a loss
module, so their parameter names are the state-dict names with the prefix ``model.``; :func:`state_name` strips it.
Batch-norm running statistics are inputs and outputs of training programs (see :mod:`export.executorch`), listed
under ``stats`` in state-dict order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fedge.errors import ConfigError, ExportError
from fedge.models import build_model, example_input
from fedge.training import OBJECTIVES

FORMAT_VERSION = 1
WRAPPER_PREFIX = "model."
"""Prefix of parameter names inside a training program: the wrapper holds the model as ``self.model``."""

META_METHOD = "fedge_meta"
"""Name of the ExecuTorch constant method that returns the JSON description of a ``.pte``."""

TRAIN_METHOD = "forward_backward"
"""Method of a training program that returns (loss, logits, new BN stats) plus gradients and parameters."""

EVAL_METHOD = "forward"
"""Method of a ``.pte`` that returns logits in eval mode (in training programs it takes the weights as inputs)."""


@dataclass(frozen=True)
class ModelSpec:
    """A registry model: name, per-sample input shape and number of classes."""

    name: str
    input_shape: tuple[int, ...]
    num_classes: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_shape", tuple(int(d) for d in self.input_shape))
        if self.num_classes < 1:
            raise ConfigError(f"num_classes must be at least 1, got {self.num_classes}")

    def build(self, seed: int | None = 0) -> nn.Module:
        """A fresh eager model of this spec (initialized from ``seed``)."""
        return build_model(self.name, input_shape=self.input_shape, num_classes=self.num_classes, seed=seed)

    def example(self, batch: int, *, seed: int = 0) -> torch.Tensor:
        """A deterministic example input batch (token ids for the LSTM, standard normal otherwise)."""
        return example_input(self.name, batch=batch, input_shape=self.input_shape, seed=seed)

    @property
    def input_dtype(self) -> torch.dtype:
        return torch.int64 if self.name == "imdb_lstm" else torch.float32


@dataclass(frozen=True)
class TrainingObjective:
    """The loss baked into a training program: an objective kind with its hyperparameters fixed at export.

    Hyperparameters a kind does not use are normalized away, so equal losses share one program. Per-client data of a
    loss (FedLSD/FedCAD class weights, the FD mask) are inputs of the program, not part of the key.
    """

    kind: str = "ce"
    tau: float = 1.0
    beta: float = 1.0
    gamma: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in OBJECTIVES:
            raise ConfigError(f"unknown objective {self.kind!r}; choose one of {OBJECTIVES}")
        used = {"ntd": ("tau", "beta"), "kd": ("tau", "beta"), "lsd": ("tau",), "cad": ("tau",), "fd": ("gamma",)}
        defaults = {"tau": 1.0, "beta": 1.0, "gamma": 1.0}
        for name, default in defaults.items():
            value = default if name not in used.get(self.kind, ()) else float(getattr(self, name))
            object.__setattr__(self, name, value)

    @property
    def inputs(self) -> tuple[str, ...]:
        """Names of the per-step inputs of the training method, before the BN statistics."""
        names = ["x", "y"]
        if self.kind != "ce":
            names.append("aux")  # teacher logits (ntd, kd, lsd, cad) or target probabilities (soft, fd)
        if self.kind in ("lsd", "cad"):
            names.append("class_weights")  # (C,) per-class distillation weight a_y
        if self.kind == "fd":
            names.append("aux_mask")  # (B,) bool: rows without a leave-one-out target get CE only
        return tuple(names)

    @property
    def tag(self) -> str:
        """A file-name-safe label, e.g. ``ntd-tau1-beta1``."""
        parts = [self.kind]
        if self.kind in ("ntd", "kd", "lsd", "cad"):
            parts.append(f"tau{self.tau:g}")
        if self.kind in ("ntd", "kd"):
            parts.append(f"beta{self.beta:g}")
        if self.kind == "fd":
            parts.append(f"gamma{self.gamma:g}")
        return "-".join(parts)


@dataclass(frozen=True)
class ProgramMeta:
    """The description embedded in every export."""

    format: str  # "onnx", "pte" (inference) or "pte-train"
    model: ModelSpec
    objective: TrainingObjective | None = None  # training programs only
    weights: tuple[str, ...] = ()  # the exchanged state's names, in state-dict order
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # shape of each of ``weights``
    params: tuple[str, ...] = ()  # state-dict names of the trainable parameters, in program order
    stats: tuple[str, ...] = ()  # state-dict names of the BN running statistics, in program order
    max_batch: int = 0  # upper bound of the dynamic batch dimension (0: unbounded)
    extra: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        raw: dict[str, Any] = {
            "fedge_format_version": FORMAT_VERSION,
            "format": self.format,
            "model": self.model.name,
            "input_shape": list(self.model.input_shape),
            "num_classes": self.model.num_classes,
            "weights": list(self.weights),
            "shapes": {k: list(v) for k, v in self.shapes.items()},
            "params": list(self.params),
            "stats": list(self.stats),
            "max_batch": self.max_batch,
            "extra": dict(self.extra),
        }
        if self.objective is not None:
            o = self.objective
            raw["objective"] = {"kind": o.kind, "tau": o.tau, "beta": o.beta, "gamma": o.gamma}
        return json.dumps(raw, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, source: str = "export") -> ProgramMeta:
        try:
            raw = json.loads(text)
            if raw.get("fedge_format_version") != FORMAT_VERSION:
                raise ExportError(
                    f"{source} has fedge format version {raw.get('fedge_format_version')!r}, this fedge reads "
                    f"{FORMAT_VERSION}; re-export it with this version"
                )
            objective = TrainingObjective(**raw["objective"]) if "objective" in raw else None
            return cls(
                format=str(raw["format"]),
                model=ModelSpec(str(raw["model"]), tuple(raw["input_shape"]), int(raw["num_classes"])),
                objective=objective,
                weights=tuple(raw.get("weights", ())),
                shapes={str(k): tuple(int(d) for d in v) for k, v in raw.get("shapes", {}).items()},
                params=tuple(raw.get("params", ())),
                stats=tuple(raw.get("stats", ())),
                max_batch=int(raw.get("max_batch", 0)),
                extra={str(k): str(v) for k, v in raw.get("extra", {}).items()},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ExportError(f"{source} does not carry a valid fedge description: {exc}") from exc


def describe_weights(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the model's exchanged state (see :func:`fedge.models.exchanged_state`), in state-dict order."""
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if v.is_floating_point()}


def state_name(program_name: str) -> str:
    """The state-dict name of a training program's parameter (``model.features.0.weight`` -> ``features.0.weight``)."""
    if not program_name.startswith(WRAPPER_PREFIX):
        raise ExportError(f"parameter {program_name!r} of a training program lacks the {WRAPPER_PREFIX!r} prefix")
    return program_name[len(WRAPPER_PREFIX) :]


def stat_names(model: nn.Module) -> tuple[str, ...]:
    """State-dict names of the floating-point buffers (BN running mean and variance), in state-dict order."""
    buffers = dict(model.named_buffers())
    return tuple(k for k in model.state_dict() if k in buffers and buffers[k].is_floating_point())


def example_training_inputs(spec: ModelSpec, objective: TrainingObjective, batch: int = 2) -> tuple[torch.Tensor, ...]:
    """Deterministic inputs of a training method for ``batch`` samples, in :attr:`TrainingObjective.inputs` order."""
    c = spec.num_classes
    values = {
        "x": spec.example(batch),
        "y": torch.arange(batch, dtype=torch.long) % c,
        "aux": torch.softmax(torch.arange(batch * c, dtype=torch.float32).reshape(batch, c) / c, dim=1),
        "class_weights": torch.full((c,), 0.5),
        "aux_mask": torch.ones(batch, dtype=torch.bool),
    }
    return tuple(values[k] for k in objective.inputs)
