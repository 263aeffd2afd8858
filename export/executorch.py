"""Export to ExecuTorch: inference programs (``.pte``, XNNPACK-delegated) and on-device training programs.

A **training program** is a ``.pte`` with two methods:

- ``forward_backward(x, y, *objective_inputs, *term_inputs, *bn_stats) -> (loss, logits, *new_bn_stats)``: one
  training step's forward and backward pass. The loss is :func:`fedge.learning.terms.batch_loss`, the very code eager
  training runs: the registered objective plus the loss's local terms (FedProx's pull, SCAFFOLD's correction, MOON's
  contrast, ...), their hyperparameters fixed at export and their round tensors inputs
  (:func:`fedge.programs.spec.term_input_names`). A term with reference models gets their exchanged weights as inputs
  and their eval-mode representation of the batch computed inside the program. ExecuTorch's training ABI appends the
  gradients and the (mutable) parameters to the outputs, and an SGD optimizer in the runtime applies the gradients to
  those parameters in place.
- ``forward(x, *params, *bn_stats) -> logits``: eval-mode inference with the weights passed in, so the logits always
  come from the weights being trained.

Batch-norm running statistics are inputs and outputs of the training method rather than buffers mutated inside the
program: ExecuTorch 1.4.1 can keep mutable buffers, but gives no way to read or set them from the host, and its
Python ``TrainingModule`` mis-slices the outputs of a program that mutates buffers (it counts the buffer mutations
that the runtime does not return). With the statistics passed through, they follow eager PyTorch exactly (same
momentum update, unbiased variance) and travel with the weights.

Two workarounds are applied before lowering: the decomposition of ``max_pool2d_with_indices_backward``, whose
portable kernel accumulates into an un-zeroed buffer in 1.4.1 (pytorch/executorch#21686, wrong gradients from the
second step on), and of ``_native_batch_norm_legit_functional``, which has no out-variant kernel.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.export import Dim, ExportedProgram
from torch.func import functional_call

from export.edge_passes import alias_copies_removed, permutes_as_strided_copies
from export.lowering import CUSTOM_OP_DECOMPOSITIONS, lower_for_training
from fedge.errors import ExportError
from fedge.learning.terms import batch_loss, needs_representation
from fedge.learning.training import Split
from fedge.programs.spec import (
    EVAL_METHOD,
    META_METHOD,
    TRAIN_METHOD,
    ModelSpec,
    ProgramMeta,
    TrainingLoss,
    describe_weights,
    example_training_inputs,
    split_term_inputs,
    stat_names,
)

if TYPE_CHECKING:
    from executorch.exir import ExecutorchProgramManager

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 64
"""Upper bound of the batch dimension. ExecuTorch plans memory for the largest allowed shape, so keep it small."""


class TrainingStep(nn.Module):
    """The loss module exported as a training method: the model (as ``self.model``) plus a fixed loss."""

    def __init__(self, model: nn.Module, loss: TrainingLoss, reference: nn.Module | None = None) -> None:
        super().__init__()
        self.model = model
        self.loss = loss
        self.stat_names = stat_names(model)
        self.param_names = tuple(k for k, _ in model.named_parameters())
        self.weight_names = tuple(describe_weights(model))
        self.counter_names = tuple(k for k, v in model.named_buffers() if not v.is_floating_point())
        # The reference models' architecture, in eval mode; every weight of it is an input, so it is kept out of
        # this module's parameters (a list attribute is not registered).
        self._reference = [reference.eval()] if reference is not None else []

    def forward(self, x: torch.Tensor, y: torch.Tensor, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        objective, terms = self.loss.objective, self.loss.terms
        n = len(objective.inputs)
        inputs = {spec.name: t for spec, t in zip(objective.inputs, args[:n], strict=True)}
        (tensors, references), stats = split_term_inputs(self.loss, self.param_names, self.weight_names, args[n:])
        # BN updates running stats in place; updating clones of the inputs makes export return the new values as
        # plain outputs. The batch counters only matter for BN with momentum=None, which no model here uses.
        buffers = {k: s.clone() for k, s in zip(self.stat_names, stats, strict=True)}
        buffers.update({k: torch.zeros((), dtype=torch.long) for k in self.counter_names})
        params = dict(self.model.named_parameters())
        if not needs_representation(terms):
            logits = functional_call(self.model, buffers, (x,), strict=False)
            loss = batch_loss(objective, terms, logits, y, inputs, params=params, tensors=tensors)
        else:
            split = Split(self.model)
            z, logits = functional_call(split, {f"model.{k}": v for k, v in buffers.items()}, (x,), strict=False)
            reference_z = [{r: self._represent(w, x) for r, w in refs.items()} for refs in references]
            loss = batch_loss(
                objective, terms, logits, y, inputs, params=params, tensors=tensors, z=z, reference_z=reference_z
            )
        return (loss, logits.detach(), *(buffers[k] for k in self.stat_names))

    def _represent(self, weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """A reference model's eval-mode representation of ``x`` from its weights (inputs of the program)."""
        split = Split(self._reference[0])
        z, _ = functional_call(split, {f"model.{k}": v for k, v in weights.items()}, (x,), strict=False)
        return z.detach()


class EvalStep(nn.Module):
    """Eval-mode logits with every weight an input: ``forward(x, *params, *bn_stats)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.names = tuple(k for k, _ in model.named_parameters()) + stat_names(model)

    def forward(self, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, dict(zip(self.names, weights, strict=True)), (x,), strict=False)


def _batch_dim(max_batch: int) -> Dim:
    return Dim("batch", min=1, max=max_batch)


def export_inference(
    model: nn.Module, spec: ModelSpec, *, xnnpack: bool = True, max_batch: int = DEFAULT_MAX_BATCH
) -> bytes:
    """An inference ``.pte`` (eval mode, weights baked in) with a dynamic batch dimension up to ``max_batch``.

    The bound is what the file records (``fedge_meta``) and what ExecuTorch plans memory for;
    :class:`edge_client.backends.runners.PteRunner` splits larger batches. Should lowering still narrow it (see
    :func:`_lower_inference`), the model is exported again with the narrowed bound, so the record stays true.
    """
    was_training = model.training
    model.eval()
    shapes = describe_weights(model)
    meta = ProgramMeta(
        "pte", spec, weights=tuple(shapes), shapes=shapes, max_batch=max_batch, extra={"xnnpack": str(xnnpack)}
    )
    try:
        manager = _lower_inference(model, spec, meta, xnnpack)
        bound = _batch_upper_bound(manager.exported_program())
        if bound < max_batch:
            log.warning("%s: lowering narrowed the batch bound from %d to %d", spec.name, max_batch, bound)
            meta = dataclasses.replace(meta, max_batch=bound)
            manager = _lower_inference(model, spec, meta, xnnpack)
    except Exception as exc:  # torch.export and ExecuTorch raise many types; name the model and stage
        raise ExportError(f"ExecuTorch inference export of {spec.name} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        model.train(was_training)
    return bytes(manager.buffer)


def _lower_inference(model: nn.Module, spec: ModelSpec, meta: ProgramMeta, xnnpack: bool) -> ExecutorchProgramManager:
    from executorch.exir import to_edge_transform_and_lower

    partitioner = []
    if xnnpack:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        partitioner = [XnnpackPartitioner()]
    # Passes after torch.export re-trace convolutions with fake tensors, whose shape rule asks PyTorch which CPU
    # kernel eager mode would pick. That choice reads the batch size (oneDNN and NNPACK take batches of 16 and up), so
    # traced at the example batch of 2 it records the guard "batch < 16", and the program was planned for batch 15
    # whatever bound was asked (ExecuTorch 1.4.1, torch 2.13). With both kernel families off while exporting, the
    # choice never reads the batch size; the program runs XNNPACK's (or the portable) kernels either way.
    with torch.backends.mkldnn.flags(enabled=False), torch.backends.nnpack.flags(enabled=False):
        ep = torch.export.export(model, (spec.example(2),), dynamic_shapes={"x": {0: _batch_dim(meta.max_batch)}})
        edge = to_edge_transform_and_lower(ep, partitioner=partitioner, constant_methods={META_METHOD: meta.to_json()})
        return edge.to_executorch()


def _batch_upper_bound(ep: ExportedProgram) -> int:
    """The largest batch the lowered program's input ``x`` admits (what ExecuTorch plans memory for)."""
    from executorch.exir.sym_util import eval_upper_bound

    (x,) = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name == "x"]
    return int(eval_upper_bound(x.meta["val"].shape[0]))


def _step_shapes(shapes: tuple[object, ...], n_stats: int) -> dict[str, object]:
    """dynamic_shapes of ``TrainingStep.forward(x, y, *args)``: torch.export wants no ``args`` key when it is empty."""
    rest = (*shapes[2:], *(None for _ in range(n_stats)))
    return {"x": shapes[0], "y": shapes[1], **({"args": rest} if rest else {})}


def _decompose_for_training(ep: ExportedProgram, *, max_pool_workaround: bool) -> ExportedProgram:
    table = torch._decomp.decomposition_table
    ops = [torch.ops.aten._native_batch_norm_legit_functional.default]
    if max_pool_workaround:
        ops.append(torch.ops.aten.max_pool2d_with_indices_backward.default)
    return ep.run_decompositions({**{op: table[op] for op in ops}, **CUSTOM_OP_DECOMPOSITIONS})


def export_training(
    model: nn.Module,
    spec: ModelSpec,
    loss: TrainingLoss,
    *,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_pool_workaround: bool = True,
    lower: bool = True,
    faster_copies: bool = True,
) -> bytes:
    """A training ``.pte`` for ``loss`` (portable kernels) holding ``model``'s current weights.

    The program computes ``model`` rewritten by :func:`export.lowering.lower_for_training` (convolutions as im2col +
    ``mm``, linear layers as ``mm``, ...): same function, same weight names, but ops that reach ExecuTorch's optimized
    kernels, 20-35x faster per step than the portable convolution loops. ``lower=False`` exports the model as it is
    (the benchmark's "before"). ``faster_copies=False`` exports the lowering without its cheaper copies
    (:func:`export.lowering.patch_conv` and ``max_pool_2x2``, the ReLU after pooling, the edge passes of
    :mod:`export.edge_passes`): the benchmark's baseline for them. ``max_pool_workaround=False`` skips the max-pool
    backward decomposition; it exists to show that the parity check catches the upstream gradient bug, never use it
    for a real export.
    """
    from executorch.exir import EdgeCompileConfig, to_edge
    from torch.export.experimental import _export_forward_backward

    was_training = model.training
    model.train()
    # The lowered model shares model's parameters and buffers.
    program_model = lower_for_training(model, faster_copies=faster_copies) if lower else model
    # The reference models of a term (MOON) run the same lowered architecture, on a tree of their own.
    has_references = any(t.references for t in loss.terms)
    reference = lower_for_training(model, faster_copies=faster_copies) if lower and has_references else None
    if reference is None and has_references:
        reference = copy.deepcopy(model)
    step = TrainingStep(program_model, loss, reference)
    eval_step = EvalStep(program_model)
    params = tuple(k for k, _ in model.named_parameters())
    stats = step.stat_names
    state = dict(model.state_dict())
    stat_values = tuple(state[k].detach().clone() for k in stats)
    batch = _batch_dim(max_batch)
    args = example_training_inputs(spec, loss, model)
    # x, y and every per-sample input share the batch dimension; per-round inputs, the terms' inputs and BN stats
    # are static.
    per_sample = [{0: batch}, {0: batch}] + [{0: batch} if i.per_sample else None for i in loss.objective.inputs]
    shapes = (*per_sample, *(None for _ in args[len(per_sample) :]))
    try:
        ep = torch.export.export(
            step,
            (*args, *stat_values),
            dynamic_shapes=_step_shapes(shapes, len(stats)),
        )
        ep = _export_forward_backward(ep)
        ep = _decompose_for_training(ep, max_pool_workaround=max_pool_workaround)
        program_model.eval()
        weights = tuple(p.detach().clone() for p in model.parameters()) + stat_values
        ep_eval = torch.export.export(
            eval_step,
            (spec.example(2), *weights),
            dynamic_shapes={"x": {0: batch}, "weights": tuple(None for _ in weights)},
        ).run_decompositions(dict(CUSTOM_OP_DECOMPOSITIONS))
        meta = ProgramMeta(
            "pte-train",
            spec,
            loss=loss,
            weights=tuple(describe_weights(model)),
            shapes=describe_weights(model),
            params=params,
            stats=stats,
            max_batch=max_batch,
        )
        manager = to_edge(
            {TRAIN_METHOD: ep, EVAL_METHOD: ep_eval},
            constant_methods={META_METHOD: meta.to_json()},
            compile_config=EdgeCompileConfig(_check_ir_validity=False),
        )
        if lower and faster_copies:
            manager = manager.transform([permutes_as_strided_copies, alias_copies_removed])
        manager = manager.to_executorch()
    except Exception as exc:  # see export_inference
        raise ExportError(
            f"ExecuTorch training export of {spec.name} ({loss.tag}) failed: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        model.train(was_training)
        program_model.train(was_training)
    return bytes(manager.buffer)
