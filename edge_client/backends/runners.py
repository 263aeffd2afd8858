"""Run exported programs: ONNX Runtime inference, ExecuTorch inference and ExecuTorch training programs.

These are the device-side halves of :mod:`export.onnx` and :mod:`export.executorch`: they need only the runtimes
(``onnxruntime``, ``executorch``), not the exporters. The edge-client backends and the parity checks both use them,
so what is checked is what runs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fedge.errors import ConfigError, ExportError
from fedge.learning.training import EpochMeter, SGDSettings, TrainRequest, TrainStats, batch_order
from fedge.programs.spec import (
    EVAL_METHOD,
    META_METHOD,
    TRAIN_METHOD,
    ProgramMeta,
    TrainingLoss,
    example_training_inputs,
    state_name,
    term_inputs,
)
from fedge.types import StateDict

log = logging.getLogger(__name__)

_GRADIENTS_INDEX = "__et_training_gradients_index_"
_PARAMETERS_INDEX = "__et_training_parameters_index_"
_FQN = "__et_training_fqn_"


def _check_state(meta: ProgramMeta, state: Mapping[str, torch.Tensor], source: str) -> None:
    """Raise ConfigError unless ``state`` has exactly the program's weights, with their shapes, as float tensors."""
    missing = [k for k in meta.weights if k not in state]
    unexpected = [k for k in state if k not in set(meta.weights)]
    if missing or unexpected:
        raise ConfigError(f"weights do not fit {source}: missing {missing}, unexpected {unexpected}")
    for k in meta.weights:
        v = state[k]
        if not isinstance(v, torch.Tensor) or not v.is_floating_point():
            raise ConfigError(f"weights do not fit {source}: {k} is not a floating-point tensor")
        if k in meta.shapes and tuple(v.shape) != meta.shapes[k]:
            raise ConfigError(f"weights do not fit {source}: {k} has shape {tuple(v.shape)}, expected {meta.shapes[k]}")


def _chunks(n: int, size: int) -> Sequence[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


class OnnxRunner:
    """An ONNX model in an ONNX Runtime session whose weights can be replaced by name."""

    runtime = "onnxruntime"

    def __init__(self, data: bytes, *, source: str = "ONNX model", threads: int = 0) -> None:
        import onnxruntime as ort

        from edge_client.backends.onnx_file import read_meta, read_weights

        self.source = source
        self.meta = read_meta(data, source=source)
        self._base = data
        self._options = ort.SessionOptions()
        self._options.intra_op_num_threads = threads  # 0: ONNX Runtime's default (one per core)
        self._state = read_weights(data, source=source)
        self._session = self._open(data)

    def _open(self, data: bytes) -> Any:
        import onnxruntime as ort

        try:
            return ort.InferenceSession(data, self._options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types
            raise ExportError(f"ONNX Runtime cannot load {self.source}: {exc}") from exc

    def set_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Rebuild the session with the initializers replaced by ``state`` (ONNX Runtime has no in-place update)."""
        from edge_client.backends.onnx_file import replace_weights

        _check_state(self.meta, state, self.source)
        self._session = self._open(replace_weights(self._base, state, source=self.source))
        self._state = {k: state[k].detach().cpu().clone() for k in self.meta.weights}

    def get_weights(self) -> StateDict:
        return {k: v.clone() for k, v in self._state.items()}

    def logits(self, x: torch.Tensor, *, batch_size: int = 1024) -> torch.Tensor:
        """Logits for ``x`` (N, *input_shape), computed in batches."""
        outs = [
            torch.from_numpy(self._session.run(None, {"x": np.ascontiguousarray(x[s].numpy())})[0])
            for s in _chunks(len(x), batch_size)
        ]
        return torch.cat(outs) if outs else torch.empty(0, self.meta.model.num_classes)


def _load_pte(data: bytes, source: str) -> tuple[Any, ProgramMeta]:
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    try:
        module = _load_for_executorch_from_buffer(data)
        names = module.method_names()  # loading is lazy: a malformed file fails here
    except RuntimeError as exc:  # the pybindings raise RuntimeError with an ExecuTorch error code
        raise ExportError(f"ExecuTorch cannot load {source}: {exc}") from exc
    if META_METHOD not in names:
        raise ExportError(f"{source} carries no fedge description; export it with `fedge export --format pte`")
    (text,) = module.run_method(META_METHOD, ())
    return module, ProgramMeta.from_json(str(text), source=source)


def read_pte_meta(data: bytes, *, source: str = "ExecuTorch program") -> ProgramMeta:
    """The fedge description embedded in a ``.pte``."""
    return _load_pte(data, source)[1]


class PteRunner:
    """An ExecuTorch inference program (weights baked in)."""

    runtime = "executorch"

    def __init__(self, data: bytes, *, source: str = "ExecuTorch program") -> None:
        self.source = source
        self._data = data  # the loaded program may point into this buffer: keep it alive
        self._module, self.meta = _load_pte(data, source)
        if self.meta.format != "pte":
            raise ExportError(f"{source} is a {self.meta.format!r} program, expected an inference program ('pte')")

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for ``x`` (N, *input_shape), computed in batches of at most the program's batch bound."""
        outs = [
            self._module.run_method(EVAL_METHOD, (x[s].contiguous(),))[0].clone()
            for s in _chunks(len(x), self.meta.max_batch)
        ]
        return torch.cat(outs) if outs else torch.empty(0, self.meta.model.num_classes)


class PteTrainer:
    """An ExecuTorch training program: weights in and out, local SGD steps, eval-mode logits.

    The parameters live inside the program; the batch-norm running statistics live here and go in and out of every
    step. ``get_sgd_optimizer`` updates the program's parameters in place; it is created per :meth:`train` call so
    the momentum buffers start at zero for every task, as in :func:`fedge.learning.training.train`. The local terms
    are inside the program; their round tensors (and reference weights) are inputs of every step.
    """

    runtime = "executorch"

    def __init__(self, data: bytes, *, source: str = "ExecuTorch training program") -> None:
        self.source = source
        self._data = data  # the loaded program may point into this buffer: keep it alive
        self._module, self.meta = _load_pte(data, source)
        if self.meta.format != "pte-train" or self.meta.loss is None:
            raise ExportError(f"{source} is a {self.meta.format!r} program, expected a training program")
        self.loss: TrainingLoss = self.meta.loss
        m = self._module
        self._grad_start = int(m.run_method(_GRADIENTS_INDEX + TRAIN_METHOD, ())[0])
        self._param_start = int(m.run_method(_PARAMETERS_INDEX + TRAIN_METHOD, ())[0])
        self._fqns = [str(n) for n in m.run_method(_FQN + TRAIN_METHOD, ())]
        user_outputs = 2 + len(self.meta.stats)  # loss, logits, new BN stats
        if self._grad_start != user_outputs or [state_name(n) for n in self._fqns] != list(self.meta.params):
            # A program that mutates buffers shifts these indices (the runtime does not return buffer mutations).
            raise ExportError(
                f"{source} does not have fedge's training-program layout (gradients at output {self._grad_start}, "
                f"expected {user_outputs}); re-export it with `fedge export --format pte-train`"
            )
        self._stats: dict[str, torch.Tensor] = {
            k: (torch.ones if k.endswith("running_var") else torch.zeros)(self.meta.shapes[k]) for k in self.meta.stats
        }  # BN's own initial values until weights are set
        self._params: dict[str, torch.Tensor] = self._prime()

    def _prime(self) -> dict[str, torch.Tensor]:
        """Run one forward-backward pass: ExecuTorch exposes the parameter tensors only as outputs of a step."""
        inputs = example_training_inputs(self.meta.model, self.loss, batch=2)
        outs = self._module.run_method(TRAIN_METHOD, (*inputs, *self._stats.values()), clone_outputs=False)
        # Not cloned: these alias the program's parameter memory, so copying into them sets the weights it uses.
        return {state_name(n): t for n, t in zip(self._fqns, outs[self._param_start :], strict=True)}

    def set_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        _check_state(self.meta, state, self.source)
        with torch.no_grad():
            for k, live in self._params.items():
                live.copy_(state[k])
        self._stats = {k: state[k].detach().to(torch.float32).contiguous().clone() for k in self.meta.stats}

    def get_weights(self) -> StateDict:
        """The exchanged weights in state-dict order (parameters from the program, BN statistics from the host)."""
        return {k: (self._params[k] if k in self._params else self._stats[k]).clone() for k in self.meta.weights}

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Eval-mode logits for ``x`` with the current weights, in batches of at most the program's batch bound."""
        weights = (*(self._params[k] for k in self.meta.params), *self._stats.values())
        outs = [
            self._module.run_method(EVAL_METHOD, (x[s].contiguous(), *weights))[0].clone()
            for s in _chunks(len(x), self.meta.max_batch)
        ]
        return torch.cat(outs) if outs else torch.empty(0, self.meta.model.num_classes)

    def check_request(self, request: TrainRequest) -> None:
        """ConfigError unless this program computes ``request``'s loss."""
        wanted = TrainingLoss.of(request.objective, request.terms)
        if wanted != self.loss:
            raise ConfigError(f"{self.source} trains {self.loss.tag}, the task asks for {wanted.tag}")

    def step_inputs(
        self, request: TrainRequest, idx: torch.Tensor, step: int = 0, terms: Sequence[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, ...]:
        """The training method's inputs for the samples ``idx`` (the ``step``-th batch), in the program's input order
        (before BN stats). ``terms``: the terms' inputs (:meth:`term_inputs`), when already made for the request."""
        r = request
        inputs = r.batch_inputs(idx, step)
        values = [r.batch_x(idx, step).contiguous(), r.y[idx].long()]
        for spec in r.objective.inputs:
            t = inputs[spec.name]
            values.append(t.bool() if spec.dtype == torch.bool else t.to(torch.float32).contiguous())
        values.extend(self.term_inputs(request) if terms is None else terms)
        return tuple(values)

    def term_inputs(self, request: TrainRequest) -> list[torch.Tensor]:
        """The terms' inputs of ``request``: the same for every step of it."""
        return term_inputs(self.loss, self.meta.params, self.meta.weights, request.terms)

    def gradients(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """:data:`fedge.learning.training.Gradients` of a cross-entropy program (no objective inputs, no terms): one
        forward-backward pass, no step; the BN statistics stay as they were."""
        if self.loss.objective.inputs or self.loss.terms:
            raise ConfigError(f"{self.source} trains {self.loss.tag}; gradients are read from a cross-entropy program")
        outs = self._module.run_method(TRAIN_METHOD, (x.contiguous(), y.long(), *self._stats.values()))
        return {
            state_name(n): g.clone()
            for n, g in zip(self._fqns, outs[self._grad_start : self._param_start], strict=True)
        }

    def optimizer(self, sgd: SGDSettings) -> Any:
        """A fresh ExecuTorch SGD optimizer over the program's parameters (momentum buffers at zero)."""
        from executorch.extension.training import get_sgd_optimizer

        params = {n: self._params[state_name(n)] for n in self._fqns}
        # dampening 0 and no Nesterov: torch.optim.SGD's defaults, as in fedge.learning.training.train.
        return get_sgd_optimizer(params, sgd.lr, sgd.momentum, 0.0, sgd.weight_decay, False)

    def step(self, optimizer: Any, inputs: tuple[torch.Tensor, ...]) -> float:
        """One training step on inputs from :meth:`step_inputs`: forward, backward, BN statistics, SGD update."""
        if len(inputs[0]) > self.meta.max_batch:
            raise ConfigError(
                f"a batch of {len(inputs[0])} exceeds the batch bound {self.meta.max_batch} of {self.source}; "
                "export a training program with a larger --max-batch"
            )
        outs = self._module.run_method(TRAIN_METHOD, (*inputs, *self._stats.values()), clone_outputs=False)
        # Outputs other than the parameters live in memory the next step reuses: copy what outlives this step.
        # The optimizer consumes (and modifies in place) the gradients before the next step, so they are not copied.
        n_stats = len(self.meta.stats)
        loss = float(outs[0])
        self._stats = {k: t.clone() for k, t in zip(self.meta.stats, outs[2 : 2 + n_stats], strict=True)}
        grads = dict(zip(self._fqns, outs[self._grad_start : self._param_start], strict=True))
        optimizer.step(grads)
        if not math.isfinite(loss):
            log.warning("%s: non-finite loss %s", self.source, loss)
        return loss

    def train(self, request: TrainRequest) -> TrainStats:
        """The request's epochs of mini-batch SGD in the batch order of :func:`fedge.learning.training.batch_order`."""
        self.check_request(request)
        order = batch_order(len(request.x), request.epochs, request.batch_size, request.seed)
        optimizer = self.optimizer(request.sgd)
        terms = self.term_inputs(request)
        total, samples = 0.0, 0
        meter = EpochMeter(request, len(order))
        for step, idx in enumerate(order):
            loss = self.step(optimizer, self.step_inputs(request, idx, step, terms))
            total += loss
            meter.step(loss)
            samples += len(idx)
        return TrainStats(steps=len(order), samples=samples, mean_loss=total / len(order) if order else 0.0)


def describe(meta: ProgramMeta) -> str:
    """A one-line description of an export for logs and the CLI."""
    what = {"onnx": "ONNX model", "pte": "ExecuTorch inference program", "pte-train": "ExecuTorch training program"}
    m = meta.model
    text = f"{what.get(meta.format, meta.format)} of {m.name} {list(m.input_shape)} -> {m.num_classes} classes"
    if meta.loss is not None:
        text += f", loss {meta.loss.tag}"
    if meta.max_batch:
        text += f", batch <= {meta.max_batch}"
    return text
