"""Local terms: what an algorithm adds to a client's local loss, each written once and run by every runtime.

A term is a frozen dataclass of hyperparameters (floats: fixed for a run, baked into an exported program and part of
its name) whose :meth:`LocalTerm.__call__` gives one scalar added to the batch loss. It sees a :class:`TermBatch`:

- the trainable parameters, by state-dict name;
- its round tensors (:attr:`LocalTerm.tensors`): one tensor per trainable parameter each, sent with the task or made
  by the client (FedProx's anchor, SCAFFOLD's correction, FedCurv's Fisher weights);
- when :attr:`LocalTerm.representation` is set, the trained model's representation of the batch (its penultimate
  layer, :mod:`fedge.learning.models`), and the representation of the same batch by each frozen reference model it
  names in :attr:`LocalTerm.references` (MOON's global and previous models), in eval mode, without gradient;
- the batch's logits and labels.

:func:`batch_loss` is the one place the objective's loss and the terms are added up. Eager training
(:func:`fedge.learning.training.train`), the batched executor (``sim/executors/stacked.py``, vmapped over clients) and
the exporters (``export/executorch.py``, ``export/ort_training/graph.py``, which trace it into the program, the round
tensors and reference weights being program inputs) all call it, so a client computes the same expression on every
runtime. A :class:`fedge.learning.training.TrainRequest` carries :class:`TermCall` s: a term with its round tensors.

Each algorithm module defines the terms it trains with and declares them in its ``ALGORITHM``, as objectives are
(:mod:`fedge.algorithms.catalog` finds them by kind).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import torch
from torch import Tensor

from fedge.errors import CodecError, ConfigError
from fedge.learning.objectives import Objective
from fedge.types import StateDict
from fedge.wire import fields as wire


@dataclass(frozen=True)
class TermBatch:
    """What a term sees of one batch (see the module docstring)."""

    params: Mapping[str, Tensor]  # trainable parameters by state-dict name
    tensors: Mapping[str, Mapping[str, Tensor]]  # the term's round tensors: name -> parameter name -> tensor
    logits: Tensor  # (B, C)
    y: Tensor  # (B,)
    z: Tensor | None = None  # (B, D) the trained model's representation, for a term with ``representation``
    reference_z: Mapping[str, Tensor] = field(default_factory=dict)  # (B, D) each reference model's


@dataclass(frozen=True)
class LocalTerm(ABC):
    """One additive term of a local loss with its hyperparameters (the dataclass fields: floats only)."""

    kind: ClassVar[str]
    tensors: ClassVar[tuple[str, ...]] = ()
    """Names of the round tensors, each one tensor per trainable parameter of the parameter's shape."""
    references: ClassVar[tuple[str, ...]] = ()
    """Frozen models (their whole exchanged weights arrive each round) whose representation of the batch it reads."""
    representation: ClassVar[bool] = False
    """Whether it reads representations (:attr:`TermBatch.z`); required by :attr:`references`."""

    @abstractmethod
    def __call__(self, b: TermBatch) -> Tensor:
        """The term's value on this batch, a scalar added to the batch loss."""

    def example_tensor(self, name: str, param: Tensor, gen: torch.Generator) -> Tensor:
        """A value of round tensor ``name`` for the parity gate's requests, given ``param`` of another model than the
        one trained: that parameter (what an anchor is); a term whose tensor has a sign or a scale overrides this,
        drawing from ``gen``."""
        return param.detach().clone()

    @property
    def params(self) -> dict[str, str]:
        """The hyperparameters as strings (what an exported program records)."""
        return wire.to_params(self)

    @property
    def tag(self) -> str:
        """A file-name-safe label, e.g. ``prox-mu0.1``."""
        return wire.tag(self.kind, self)


@dataclass(frozen=True)
class TermCall:
    """A term with this round's tensors, as a training request carries it."""

    term: LocalTerm
    tensors: Mapping[str, StateDict] = field(default_factory=dict)  # name -> trainable parameter name -> tensor
    references: Mapping[str, StateDict] = field(default_factory=dict)  # reference name -> exchanged weights

    def __post_init__(self) -> None:
        t = self.term
        if set(self.tensors) != set(t.tensors):
            raise ConfigError(
                f"term {t.kind!r} takes the round tensors {sorted(t.tensors)}, got {sorted(self.tensors)}"
            )
        if set(self.references) != set(t.references):
            raise ConfigError(
                f"term {t.kind!r} compares with the reference models {sorted(t.references)}, got "
                f"{sorted(self.references)}"
            )
        if t.references and not t.representation:
            raise ConfigError(f"term {t.kind!r} names reference models but reads no representations")

    def on(self, device: torch.device | str) -> dict[str, dict[str, Tensor]]:
        """The round tensors on ``device``."""
        return {n: {k: v.to(device) for k, v in per.items()} for n, per in self.tensors.items()}


def batch_loss(
    objective: Objective,
    terms: Sequence[LocalTerm],
    logits: Tensor,
    y: Tensor,
    inputs: Mapping[str, Tensor],
    *,
    params: Mapping[str, Tensor],
    tensors: Sequence[Mapping[str, Mapping[str, Tensor]]],
    z: Tensor | None = None,
    reference_z: Sequence[Mapping[str, Tensor]] = (),
) -> Tensor:
    """The objective's loss of one batch plus each term, added in order: what every runtime computes.

    ``tensors[i]`` and ``reference_z[i]`` belong to ``terms[i]`` (``reference_z`` may be empty when no term has
    references)."""
    loss = objective.loss(logits, y, inputs)
    for i, term in enumerate(terms):
        refs = reference_z[i] if reference_z else {}
        loss = loss + term(TermBatch(params, tensors[i], logits, y, z if term.representation else None, refs))
    return loss


def needs_representation(terms: Sequence[LocalTerm]) -> bool:
    """Whether any of ``terms`` reads representations (the model then runs as ``head(representation(x))``)."""
    return any(t.representation for t in terms)


TermT = TypeVar("TermT", bound=LocalTerm)


def term_from_params(cls: type[TermT], params: Mapping[str, str]) -> TermT:
    """``cls`` with hyperparameters parsed from strings (defaults for absent ones); ConfigError naming what is wrong.
    By kind: :func:`fedge.algorithms.catalog.make_term`."""
    try:
        return wire.from_params(cls, params)
    except CodecError as exc:
        raise ConfigError(f"local term {cls.kind!r}: {exc}") from None


def term_flag(term: LocalTerm) -> str:
    """The spelling :func:`fedge.algorithms.catalog.parse_term` reads back (every hyperparameter, by ``repr``, so
    nothing is rounded)."""
    values = ",".join(f"{f.name}={getattr(term, f.name)!r}" for f in dataclasses.fields(term))
    return f"{term.kind}:{values}" if values else term.kind
