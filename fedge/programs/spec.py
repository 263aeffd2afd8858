"""What an exported program is: the model it was made from, its inputs, and how its names map to the state dict.

Pure description shared by the exporters (:mod:`export`) and the device-side runners (:mod:`edge_client.backends`).

Every export carries this description inside the file (ONNX ``metadata_props``; an ExecuTorch constant method
``fedge_meta``), so a file alone says which eager model it must match and how to feed it.

Name mapping. ONNX initializers carry the state-dict names unchanged (the exporter runs without graph optimization, so
no initializer is folded or renamed). ExecuTorch training programs wrap the model as the attribute ``model`` of a loss
module, so their parameter names are the state-dict names with the prefix ``model.``; :func:`state_name` strips it.
Batch-norm running statistics are inputs and outputs of training programs (see :mod:`export.executorch`), listed
under ``stats`` in state-dict order.

A training program's loss is a registered :class:`fedge.learning.objectives.Objective` plus the local terms of
:mod:`fedge.learning.terms`, with their hyperparameters fixed at export (:class:`TrainingLoss`). Inputs of the training
method, in order: ``x``, ``y``, the objective's inputs (:attr:`Objective.inputs`), the terms' inputs
(:func:`term_input_names`: each term's round tensors, one per trainable parameter, then its reference models' exchanged
weights), the BN statistics.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fedge.algorithms.catalog import make_objective, make_term
from fedge.errors import ConfigError, ExportError
from fedge.learning.models import build_model, example_input
from fedge.learning.objectives import Objective
from fedge.learning.terms import LocalTerm, TermCall, term_flag

FORMAT_VERSION = 3  # 3: the loss's local terms replace FedProx's prox_mu
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
class TrainingLoss:
    """The loss baked into a training program: an objective and the local terms, with their hyperparameters.

    Per-client data of a loss (teacher logits, FedCAD class weights, FD masks, the terms' round tensors and reference
    weights) are inputs of the program, not part of this key, so one program serves every round.
    """

    objective: Objective
    terms: tuple[LocalTerm, ...] = ()

    def __post_init__(self) -> None:
        kinds = [t.kind for t in self.terms]
        if len(set(kinds)) != len(kinds):
            raise ConfigError(f"a training loss takes each local term once, got {kinds}")

    @classmethod
    def of(cls, objective: Objective, calls: Sequence[TermCall]) -> TrainingLoss:
        """The loss of a training request's objective and term calls."""
        return cls(objective, tuple(c.term for c in calls))

    @property
    def tag(self) -> str:
        """A file-name-safe label, e.g. ``ntd-tau1-beta1`` or ``ce-prox-mu0.1``."""
        return "-".join([self.objective.tag, *(t.tag for t in self.terms)])

    def to_dict(self) -> dict[str, Any]:
        terms = [{"kind": t.kind, "params": t.params} for t in self.terms]
        return {"kind": self.objective.kind, "params": self.objective.params, "terms": terms}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TrainingLoss:
        terms = tuple(make_term(str(t["kind"]), dict(t.get("params", {}))) for t in raw.get("terms", ()))
        return cls(make_objective(str(raw["kind"]), dict(raw.get("params", {}))), terms)


@dataclass(frozen=True)
class ProgramMeta:
    """The description embedded in every export."""

    format: str  # "onnx", "pte" (inference) or "pte-train"
    model: ModelSpec
    loss: TrainingLoss | None = None  # training programs only
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
        if self.loss is not None:
            raw["loss"] = self.loss.to_dict()
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
            loss = TrainingLoss.from_dict(raw["loss"]) if "loss" in raw else None
            return cls(
                format=str(raw["format"]),
                model=ModelSpec(str(raw["model"]), tuple(raw["input_shape"]), int(raw["num_classes"])),
                loss=loss,
                weights=tuple(raw.get("weights", ())),
                shapes={str(k): tuple(int(d) for d in v) for k, v in raw.get("shapes", {}).items()},
                params=tuple(raw.get("params", ())),
                stats=tuple(raw.get("stats", ())),
                max_batch=int(raw.get("max_batch", 0)),
                extra={str(k): str(v) for k, v in raw.get("extra", {}).items()},
            )
        except (AttributeError, KeyError, TypeError, ValueError, ConfigError) as exc:  # Attribute: a list for a dict
            raise ExportError(f"{source} does not carry a valid fedge description: {exc!r}") from exc


def describe_weights(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the model's exchanged state (see :func:`fedge.learning.models.exchanged_state`), in state-dict
    order."""
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


def term_input_names(loss: TrainingLoss, params: Sequence[str], weights: Sequence[str]) -> tuple[str, ...]:
    """Names of the terms' inputs of a training method: for each term in order, each round tensor for each trainable
    parameter (``prox.anchor.<param>``), then each reference model's exchanged weights (``moon.global.<weight>``)."""
    names: list[str] = []
    for term in loss.terms:
        names += [f"{term.kind}.{t}.{p}" for t in term.tensors for p in params]
        names += [f"{term.kind}.{r}.{w}" for r in term.references for w in weights]
    return tuple(names)


def training_input_names(loss: TrainingLoss, params: Sequence[str], weights: Sequence[str]) -> tuple[str, ...]:
    """Names of the training method's inputs before the BN statistics: x, y, the objective's, the terms'."""
    return ("x", "y", *(i.name for i in loss.objective.inputs), *term_input_names(loss, params, weights))


def term_inputs(
    loss: TrainingLoss, params: Sequence[str], weights: Sequence[str], calls: Sequence[TermCall]
) -> list[torch.Tensor]:
    """The values of :func:`term_input_names` from a request's term calls, float32 and contiguous."""
    by_kind = {c.term.kind: c for c in calls}
    if set(by_kind) != {t.kind for t in loss.terms}:
        raise ConfigError(f"the program's terms are {[t.kind for t in loss.terms]}, the request's {sorted(by_kind)}")
    out: list[torch.Tensor] = []
    for term in loss.terms:
        call = by_kind[term.kind]
        out += [call.tensors[t][p] for t in term.tensors for p in params]
        out += [call.references[r][w] for r in term.references for w in weights]
    return [t.detach().to(torch.float32).cpu().contiguous() for t in out]


TermArgs = tuple[list[dict[str, dict[str, torch.Tensor]]], list[dict[str, dict[str, torch.Tensor]]]]


def split_term_inputs(
    loss: TrainingLoss, params: Sequence[str], weights: Sequence[str], args: Sequence[torch.Tensor]
) -> tuple[TermArgs, Sequence[torch.Tensor]]:
    """Inside a program: the terms' inputs at the head of ``args`` (laid out as :func:`term_input_names`), as each
    term's round tensors and each term's reference weights by name, and the rest of ``args``."""
    tensors: list[dict[str, dict[str, torch.Tensor]]] = []
    references: list[dict[str, dict[str, torch.Tensor]]] = []
    i = 0
    for term in loss.terms:
        tensors.append({})
        for t in term.tensors:
            tensors[-1][t] = dict(zip(params, args[i : i + len(params)], strict=True))
            i += len(params)
        references.append({})
        for r in term.references:
            references[-1][r] = dict(zip(weights, args[i : i + len(weights)], strict=True))
            i += len(weights)
    return (tensors, references), args[i:]


def example_training_inputs(
    spec: ModelSpec, loss: TrainingLoss, model: nn.Module | None = None, batch: int = 2
) -> tuple[torch.Tensor, ...]:
    """Deterministic inputs of a training method for ``batch`` samples, before the BN statistics; the terms' inputs
    are ``model``'s parameters and weights (zeros without a model)."""
    c = spec.num_classes
    out = [spec.example(batch), torch.arange(batch, dtype=torch.long) % c]
    for i in loss.objective.inputs:
        shape = i.concrete_shape(c, batch)
        if i.dtype == torch.bool:
            out.append(torch.ones(shape, dtype=torch.bool))
        elif i.per_sample:
            out.append(torch.softmax(torch.arange(batch * c, dtype=torch.float32).reshape(shape) / c, dim=-1))
        else:
            out.append(torch.full(shape, 0.5))
    reference = model if model is not None else spec.build(seed=0)
    params = {k: p.detach().clone() for k, p in reference.named_parameters()}
    weights = {k: v.detach().clone() for k, v in reference.state_dict().items() if v.is_floating_point()}
    if model is None:
        params = {k: torch.zeros_like(v) for k, v in params.items()}
        weights = {k: torch.zeros_like(v) for k, v in weights.items()}
    for term in loss.terms:
        out += [params[p].clone() for _ in term.tensors for p in params]
        out += [weights[w].clone() for _ in term.references for w in weights]
    return tuple(out)


def program_file_name(spec: ModelSpec, loss: TrainingLoss, max_batch: int) -> str:
    """The one file name of a training program, used by ``fedge export`` and by every client's program lookup.

    It names everything that changes the program's bytes: model, input shape, classes, loss, batch bound and the
    description format version.
    """
    shape = "x".join(str(d) for d in spec.input_shape)
    return f"{spec.name}-{shape}-c{spec.num_classes}-{loss.tag}-b{max_batch}-v{FORMAT_VERSION}.pte"


def export_command(spec: ModelSpec, loss: TrainingLoss, max_batch: int, out: str) -> str:
    """The ``fedge export`` command that writes ``program_file_name(spec, loss, max_batch)`` into ``out``.

    What a client without the exporters prints for a missing program: every part of the name is spelled out (input
    shape, classes, the loss's hyperparameters), since ``fedge export``'s defaults (the papers' input shapes) need not
    be the run's.
    """
    argv = ["fedge", "export", "--model", spec.name, "--input-shape", ",".join(str(d) for d in spec.input_shape)]
    argv += ["--num-classes", str(spec.num_classes), "--format", "pte-train", "--objective", loss.objective.kind]
    for f in dataclasses.fields(loss.objective):
        argv += [f"--{f.name}", repr(getattr(loss.objective, f.name))]
    for term in loss.terms:
        argv += ["--term", term_flag(term)]
    return shlex.join([*argv, "--max-batch", str(max_batch), "--out", out])
