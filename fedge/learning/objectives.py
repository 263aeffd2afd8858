"""Local objectives: one registry of losses that eager training and the exported training programs both use.

An objective is a frozen dataclass of hyperparameters (fixed for a round, or baked into an exported program) with a
``loss(logits, y, inputs)`` method. ``inputs`` holds what the loss needs besides the labels, by name, as declared in
:attr:`Objective.inputs`: per-sample tensors such as the teacher's logits (indexed with each mini-batch) and
per-round constants such as FedCAD's class weights. Each algorithm module defines and registers the objectives it
trains with (``@register_objective``); :mod:`export` builds programs from the same classes, so the loss a device
runs is the loss the simulator runs. What an algorithm adds to an objective (a proximal term, a contrastive term) is a
local term (:mod:`fedge.learning.terms`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal, TypeVar

import torch
from torch import Tensor

from fedge.errors import CodecError, ConfigError
from fedge.registry import load_all
from fedge.wire import fields as wire


@dataclass(frozen=True)
class ObjectiveInput:
    """One extra input of a loss: ``per_sample`` tensors have one row per sample, the others are per-round constants.

    ``shape`` is the shape of one row (per-sample) or of the constant, with ``"C"`` for the number of classes.
    """

    name: str
    per_sample: bool
    shape: tuple[int | Literal["C"], ...]
    dtype: torch.dtype = torch.float32

    def concrete_shape(self, num_classes: int, batch: int | None = None) -> tuple[int, ...]:
        dims = tuple(num_classes if d == "C" else int(d) for d in self.shape)
        return ((batch,) if self.per_sample and batch is not None else ()) + dims


@dataclass(frozen=True)
class Objective(ABC):
    """A local loss with its hyperparameters (the dataclass fields: floats only, so they key exported programs)."""

    kind: ClassVar[str]
    inputs: ClassVar[tuple[ObjectiveInput, ...]] = ()

    @abstractmethod
    def loss(self, logits: Tensor, y: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
        """Batch-mean loss of ``logits`` (B, C) for labels ``y`` (B,), with this batch's rows of the inputs."""

    @property
    def params(self) -> dict[str, str]:
        """The hyperparameters as strings (what an exported program records)."""
        return wire.to_params(self)

    @property
    def tag(self) -> str:
        """A file-name-safe label, e.g. ``ntd-tau1-beta1``."""
        return wire.tag(self.kind, self)


OBJECTIVES: dict[str, type[Objective]] = {}
"""Every registered objective by kind; filled as the algorithm modules load (:func:`fedge.registry.load_all`)."""

ObjectiveClass = TypeVar("ObjectiveClass", bound=type[Objective])


def register_objective(cls: ObjectiveClass) -> ObjectiveClass:
    """Class decorator: make ``cls`` available by its ``kind`` to training and export."""
    if cls.kind in OBJECTIVES and OBJECTIVES[cls.kind] is not cls:
        raise ConfigError(f"objective kind {cls.kind!r} is registered twice")
    OBJECTIVES[cls.kind] = cls
    return cls


def objective_kinds() -> tuple[str, ...]:
    """Registered objective kinds, sorted."""
    load_all()  # objectives live in the algorithm modules and register themselves on import
    return tuple(sorted(OBJECTIVES))


def make_objective(kind: str, params: Mapping[str, str] | None = None) -> Objective:
    """The objective ``kind`` with hyperparameters parsed from strings (defaults for absent ones)."""
    load_all()  # objectives live in the algorithm modules and register themselves on import
    try:
        cls = OBJECTIVES[kind]
    except KeyError:
        raise ConfigError(f"unknown objective {kind!r}; choose one of {', '.join(sorted(OBJECTIVES))}") from None
    try:
        return wire.from_params(cls, params or {})
    except CodecError as exc:
        raise ConfigError(f"objective {kind!r}: {exc}") from None
