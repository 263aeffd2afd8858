"""The torch modules exported as ONNX Runtime training and eval graphs, and their ONNX export.

:class:`TrainingGraph`: ``(x, y, *objective inputs, *term inputs, *bn stats) -> (loss, logits, *new bn stats)``, the
loss being :func:`fedge.learning.terms.batch_loss` (the objective plus the local terms, as eager training computes it);
:class:`EvalGraph`: ``(x, *bn stats) -> logits``. Batch norm runs as :class:`StatBatchNorm`, its running statistics
passed in and out as tensors (ORT training keeps no mutable buffers).
"""

from __future__ import annotations

import copy
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedge.errors import ExportError
from fedge.learning.terms import batch_loss, needs_representation
from fedge.learning.training import representation_and_logits
from fedge.programs.spec import TrainingLoss, describe_weights, split_term_inputs, stat_names

OPSET = 17
LOSS_OUTPUT, LOGITS_OUTPUT = "loss", "logits"


class StatBatchNorm(nn.Module):
    """A batch-norm layer whose running statistics come in and go out as tensors instead of living in buffers.

    Holds the very ``weight`` and ``bias`` of the ``nn.BatchNorm`` it replaces. Before a forward pass the owner sets
    :attr:`stats_in`; in training mode the forward pass normalizes with the batch statistics and leaves the updated
    running statistics in :attr:`stats_out` (momentum update, unbiased variance, as ``nn.BatchNorm``); in eval mode it
    normalizes with :attr:`stats_in`.
    """

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm) -> None:
        super().__init__()
        if bn.momentum is None or not bn.track_running_stats:
            raise ExportError(f"{type(bn).__name__} without a momentum or running statistics is not supported")
        self.weight = bn.weight
        self.bias = bn.bias
        self.eps = float(bn.eps)
        self.momentum = float(bn.momentum)
        self.stats_in: tuple[torch.Tensor, torch.Tensor] | None = None
        self.stats_out: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.stats_in is not None, "set stats_in before the forward pass"
        running_mean, running_var = self.stats_in
        dims = [0, *range(2, x.dim())]  # every axis but the channels
        shape = [1, -1] + [1] * (x.dim() - 2)  # (1, C, 1, ...) to broadcast a per-channel value
        if self.training:
            mean = x.mean(dims)  # (C,)
            centred = x - mean.reshape(shape)
            var = (centred * centred).mean(dims)  # (C,) biased, for normalizing
            count = x.shape[0]  # samples per channel; traced as a shape, so the batch stays dynamic
            for d in x.shape[2:]:
                count = count * d
            m = self.momentum
            unbiased = var.detach() * (count / (count - 1.0))
            self.stats_out = (running_mean * (1.0 - m) + mean.detach() * m, running_var * (1.0 - m) + unbiased * m)
        else:
            var = running_var
            centred = x - running_mean.reshape(shape)
        scale = torch.rsqrt(var + self.eps)
        if self.weight is not None:
            scale = scale * self.weight
        out = centred * scale.reshape(shape)
        return out + self.bias.reshape(shape) if self.bias is not None else out


def _swap_batch_norm(model: nn.Module) -> dict[str, StatBatchNorm]:
    """Replace every batch-norm layer of ``model`` (in place) by a :class:`StatBatchNorm`; returns them by name."""
    swapped: dict[str, StatBatchNorm] = {}
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.modules.batchnorm._BatchNorm):
                full = f"{parent_name}.{name}" if parent_name else name
                swapped[full] = StatBatchNorm(child)
                setattr(parent, name, swapped[full])
    return swapped


class _StatsFeeder(nn.Module):
    """The model (as ``self.model``, so parameters are named ``model.<name>``) with its BN statistics as tensors."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.stat_names = stat_names(model)
        self.param_names = tuple(k for k, _ in model.named_parameters())
        self.model = model
        self.norms = _swap_batch_norm(model)

    def feed(self, stats: Sequence[torch.Tensor]) -> None:
        by_name = dict(zip(self.stat_names, stats, strict=True))
        for name, bn in self.norms.items():
            bn.stats_in = (by_name[f"{name}.running_mean"], by_name[f"{name}.running_var"])

    def new_stats(self) -> list[torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, bn in self.norms.items():
            assert bn.stats_out is not None
            out[f"{name}.running_mean"], out[f"{name}.running_var"] = bn.stats_out
        return [out[k] for k in self.stat_names]


class TrainingGraph(_StatsFeeder):
    """``forward(x, y, *objective_inputs, *term_inputs, *bn_stats) -> (loss, logits, *new_bn_stats)``."""

    def __init__(self, model: nn.Module, loss: TrainingLoss) -> None:
        weight_names = tuple(describe_weights(model))
        # The reference models of a term (MOON): the same architecture, every weight an input, in eval mode; kept out
        # of this module's parameters (a list attribute is not registered).
        reference = copy.deepcopy(model) if any(t.references for t in loss.terms) else None
        super().__init__(model)
        self.loss = loss
        self.weight_names = weight_names
        self._reference = [_StatsFeeder(reference).eval()] if reference is not None else []

    def forward(self, x: torch.Tensor, y: torch.Tensor, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        objective, terms = self.loss.objective, self.loss.terms
        n = len(objective.inputs)
        inputs = {spec.name: t for spec, t in zip(objective.inputs, args[:n], strict=True)}
        (tensors, references), stats = split_term_inputs(self.loss, self.param_names, self.weight_names, args[n:])
        self.feed(stats)
        params = dict(self.model.named_parameters())
        if not needs_representation(terms):
            logits = self.model(x)
            loss = batch_loss(objective, terms, logits, y, inputs, params=params, tensors=tensors)
        else:
            z, logits = representation_and_logits(self.model, x)
            reference_z = [{r: self._represent(w, x) for r, w in refs.items()} for refs in references]
            loss = batch_loss(
                objective, terms, logits, y, inputs, params=params, tensors=tensors, z=z, reference_z=reference_z
            )
        return (loss, logits.detach(), *self.new_stats())

    def _represent(self, weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """A reference model's eval-mode representation of ``x`` from its weights (inputs of the graph). Its
        parameters are swapped for the inputs by hand: the TorchScript tracer refuses ``torch.func.functional_call``."""
        feeder = self._reference[0]
        feeder.feed([weights[k] for k in feeder.stat_names])
        modules = dict(feeder.model.named_modules())
        saved = []
        for k in feeder.param_names:
            owner, _, attr = k.rpartition(".")
            module = modules[owner]
            saved.append((module, attr, module._parameters[attr]))
            module._parameters[attr] = weights[k]
        try:
            z, _ = representation_and_logits(feeder.model, x)
        finally:
            for module, attr, param in saved:
                module._parameters[attr] = param
        return z.detach()


class EvalGraph(_StatsFeeder):
    """``forward(x, *bn_stats) -> logits`` in eval mode."""

    def forward(self, x: torch.Tensor, *stats: torch.Tensor) -> torch.Tensor:
        self.feed(stats)
        return self.model(x)


def export_graph(
    module: nn.Module,
    args: tuple[torch.Tensor, ...],
    input_names: Sequence[str],
    output_names: Sequence[str],
    per_sample: Sequence[str],
    *,
    training: bool,
) -> Any:
    """``module`` as an ONNX ModelProto, the batch dimension of ``per_sample`` inputs and of the logits dynamic."""
    import onnx

    dynamic = {name: {0: "batch"} for name in (*per_sample, LOGITS_OUTPUT)}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        # The TorchScript exporter is deprecated in favour of the dynamo one (which needs onnxscript and writes IR
        # versions ORT training 1.19 does not take), and the losses' shape checks trace as constants: both expected.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        # The LSTM's initial state is zeros made from the batch size, which the exporter cannot see: it warns about
        # batch sizes other than the example's, yet the graph is checked at other batch sizes.
        warnings.filterwarnings("ignore", message="Exporting a model to ONNX with a batch_size other than 1")
        torch.onnx.export(
            module,
            args,
            str(Path(tmp) / "graph.onnx"),
            dynamo=False,
            opset_version=OPSET,
            training=torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL,
            do_constant_folding=False,  # folding would rename or merge parameter initializers
            input_names=list(input_names),
            output_names=list(output_names),
            dynamic_axes=dynamic,
        )
        return onnx.load(str(Path(tmp) / "graph.onnx"))
