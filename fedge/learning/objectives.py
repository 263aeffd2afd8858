"""Local objectives: the losses that eager training and the exported training programs both use.

An objective is a frozen dataclass of hyperparameters (fixed for a round, or baked into an exported program) with a
``loss(logits, y, inputs)`` method. ``inputs`` holds what the loss needs besides the labels, by name, as declared in
:attr:`Objective.inputs`: per-sample tensors such as the teacher's logits (indexed with each mini-batch) and
per-round constants such as FedCAD's class weights. Each algorithm module defines the objectives it trains with and
declares them in its ``ALGORITHM``; :mod:`fedge.algorithms.catalog` finds them by kind, and :mod:`export` builds
programs from the same classes, so the loss a device runs is the loss the simulator runs. What an algorithm adds to
an objective (a proximal term, a contrastive term) is a local term (:mod:`fedge.learning.terms`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal, TypeVar

import torch
from torch import Tensor

from fedge.errors import CodecError, ConfigError
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


ObjectiveT = TypeVar("ObjectiveT", bound=Objective)


def objective_from_params(cls: type[ObjectiveT], params: Mapping[str, str]) -> ObjectiveT:
    """``cls`` with hyperparameters parsed from strings (defaults for absent ones); ConfigError naming what is wrong.
    By kind: :func:`fedge.algorithms.catalog.make_objective`."""
    try:
        return wire.from_params(cls, params)
    except CodecError as exc:
        raise ConfigError(f"objective {cls.kind!r}: {exc}") from None
