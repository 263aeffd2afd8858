"""A client runtime that trains with ONNX Runtime training (``onnxruntime-training``), for every algorithm.

``onnxruntime-training`` 1.19.2 owns the same ``onnxruntime/`` package folder as ``onnxruntime`` and needs
``onnx==1.17.0``, so this runtime lives in its own environment (``make ort-training`` makes ``.venv-ort-training``)
and runs as its own client process.

One set of **training artifacts** per loss (objective and local terms with their fixed hyperparameters), made by
:mod:`export.ort_training` and found through an :class:`ArtifactSource`: a directory named by
:func:`artifact_dir_name` (from :func:`fedge.programs.spec.program_file_name`, the one naming scheme) holding

- ``training_model.onnx``: ``(x, y, *objective inputs, *term inputs, *bn stats) -> (loss, logits, *new bn stats)``,
  the loss being the objective's and the terms' own code (:func:`fedge.learning.terms.batch_loss`) exported with the
  model, plus ORT's gradient graph;
- ``eval_model.onnx``: eval-mode ``(x, *bn stats) -> logits`` on the same parameters;
- ``checkpoint``: ORT's parameter store (parameter names are state-dict names with the ``model.`` prefix);
- ``fedge.json``: the :class:`fedge.programs.spec.ProgramMeta` of the set.

ORT computes the loss and the gradients; the optimizer step runs here on the host in numpy, exactly
``torch.optim.SGD``'s update as :func:`fedge.learning.training.train` uses it (weight decay added to the gradient, the
momentum buffer starting as the first step's gradient, ``w -= lr * buf``; dampening 0, no Nesterov), because ORT's
own SGD has no momentum. Batches follow :func:`fedge.learning.training.batch_order`. Batch-norm running statistics go
in and out of every training step (ORT keeps no mutable buffers), so they follow eager PyTorch's update and travel
with the weights. A Fisher pass (FedCurv) squares the gradients of the cross-entropy artifacts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from edge_client.backends import RUNTIME_HOOKS
from edge_client.backends.cache_dir import default_cache_dir
from fedge.algorithms.fedavg import CrossEntropy
from fedge.errors import ConfigError, ExportError
from fedge.learning.models import exchanged_state, load_exchanged_state
from fedge.learning.terms import term_flag
from fedge.learning.training import (
    EpochMeter,
    SGDSettings,
    TrainRequest,
    TrainStats,
    batch_order,
    check_hooks,
    fisher_diagonal,
)
from fedge.programs.spec import (
    WRAPPER_PREFIX,
    ModelSpec,
    ProgramMeta,
    TrainingLoss,
    program_file_name,
    term_input_names,
    term_inputs,
)
from fedge.types import StateDict
from fedge_io import manifest

if TYPE_CHECKING:
    from cryptography.x509 import Certificate

log = logging.getLogger(__name__)

RUNTIME = "onnxruntime-training"
FORMAT = "ort-train"
"""``ProgramMeta.format`` of a set of ONNX Runtime training artifacts."""

TRAINING_MODEL, EVAL_MODEL, CHECKPOINT, META_FILE = "training_model.onnx", "eval_model.onnx", "checkpoint", "fedge.json"
ARTIFACT_FILES = (META_FILE, TRAINING_MODEL, EVAL_MODEL, CHECKPOINT)

ArtifactSource = Callable[[ModelSpec, TrainingLoss], Path]
"""Gives the directory holding the training artifacts of a model and loss; ConfigError if there is none."""


def artifact_dir_name(spec: ModelSpec, loss: TrainingLoss) -> str:
    """The directory name of the artifacts of ``spec`` and ``loss``: the training program's name with batch bound 0
    (ORT's batch dimension is unbounded) and the suffix ``.ort-training``."""
    return program_file_name(spec, loss, 0).removesuffix(".pte") + ".ort-training"


def has_artifacts(directory: Path) -> bool:
    """Whether ``directory`` holds every file of a set of artifacts."""
    return all((directory / name).is_file() for name in ARTIFACT_FILES)


def read_artifact_meta(directory: Path) -> ProgramMeta:
    """The fedge description of an artifact directory; ExportError if it is not one."""
    if not has_artifacts(directory):
        raise ExportError(f"{directory} is not a set of ONNX Runtime training artifacts (needs {list(ARTIFACT_FILES)})")
    meta = ProgramMeta.from_json((directory / META_FILE).read_text(), source=str(directory))
    if meta.format != FORMAT or meta.loss is None:
        raise ExportError(f"{directory} holds a {meta.format!r} export, expected ONNX Runtime training artifacts")
    return meta


class ArtifactDirectory:
    """Artifacts made beforehand under ``root`` (default: the program cache), named by :func:`artifact_dir_name`."""

    def __init__(self, root: Path | None = None, *, unverified: bool = False, trust: Certificate | None = None) -> None:
        self.root = root if root is not None else default_cache_dir()
        self.unverified = unverified
        self.trust = trust  # a CA whose signature each artifact directory's manifest must carry

    def __call__(self, spec: ModelSpec, loss: TrainingLoss) -> Path:
        directory = self.root / artifact_dir_name(spec, loss)
        if has_artifacts(directory):
            manifest.verify_files(directory, list(ARTIFACT_FILES), required=not self.unverified, trust=self.trust)
        else:
            flags = [f"--{k} {v}" for k, v in loss.objective.params.items()]
            flags += [f"--term {term_flag(t)}" for t in loss.terms]
            raise ConfigError(
                f"no ONNX Runtime training artifacts {directory.name} in {self.root}; make them in .venv-ort-training "
                f"with `python -m export.ort_training --model {spec.name} --input-shape "
                f"{','.join(map(str, spec.input_shape))} --num-classes {spec.num_classes} --objective "
                f"{' '.join([loss.objective.kind, *flags])} --out {self.root}`, or run the client with `fedge client` "
                "in that environment, which makes them"
            )
        return directory


def _sgd_step(weight: np.ndarray, grad: np.ndarray, buffer: np.ndarray | None, sgd: SGDSettings) -> np.ndarray | None:
    """``torch.optim.SGD``'s update of ``weight`` in place (dampening 0, no Nesterov); returns the momentum buffer.

    ``grad`` is a scratch copy this may overwrite. Same operations, in the same order and in float32, as torch's
    single-tensor SGD: ``g = g + wd * w``; ``buf = g`` on the first step, else ``buf = buf * momentum + g``;
    ``w = w - lr * buf``.
    """
    if sgd.weight_decay:
        grad += np.float32(sgd.weight_decay) * weight
    if sgd.momentum:
        if buffer is None:
            buffer = grad
        else:
            buffer *= np.float32(sgd.momentum)
            buffer += grad
        grad = buffer
    weight -= np.float32(sgd.lr) * grad
    return buffer


class OrtTrainer:
    """One set of training artifacts in an ORT training ``Module``: weights in and out, local steps, eval logits.

    The host holds the weights (parameters and BN statistics, float32 numpy) and copies the parameters into ORT's
    checkpoint state before each step and before inference; the gradients ORT computes come back the same way.
    """

    runtime = RUNTIME

    def __init__(self, directory: Path, *, threads: int = 0) -> None:
        import onnxruntime as ort
        from onnxruntime.training.api import CheckpointState, Module

        self.source = str(directory)
        # Every file of a set fedge made is listed in its manifest: a damaged one is refused before ORT opens it.
        manifest.verify_files(directory, list(ARTIFACT_FILES), required=False)
        self.meta = read_artifact_meta(directory)
        assert self.meta.loss is not None  # read_artifact_meta checks it
        self.loss: TrainingLoss = self.meta.loss
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads  # 0: ONNX Runtime's default (one per core)
        options.inter_op_num_threads = 1
        options.log_severity_level = 3  # warnings about unused initializers etc. are not the user's business
        try:
            self._state = CheckpointState.load_checkpoint(str(directory / CHECKPOINT))
            self._module = Module(
                str(directory / TRAINING_MODEL), self._state, str(directory / EVAL_MODEL), session_options=options
            )
        except Exception as exc:  # onnxruntime raises its own exception types
            raise ExportError(f"ONNX Runtime training cannot load {directory}: {exc}") from exc
        self._ort_params = {k: self._state.parameters[WRAPPER_PREFIX + k] for k in self.meta.params}
        model = self.meta.model.build(seed=0)  # initial values, until weights are set
        self._weights: dict[str, np.ndarray] = {
            k: v.detach().numpy().astype(np.float32, copy=True) for k, v in exchanged_state(model).items()
        }
        self._synced = False  # whether ORT's parameters equal the host's

    # --- weights ---------------------------------------------------------------------------------------------------
    def set_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        missing = [k for k in self.meta.weights if k not in state]
        if missing:
            raise ConfigError(f"weights do not fit {self.source}: missing {missing}")
        for k in self.meta.weights:
            value = state[k].detach().to(torch.float32).cpu().numpy()
            if value.shape != self.meta.shapes[k]:
                raise ConfigError(f"weights do not fit {self.source}: {k} has shape {value.shape}")
            self._weights[k] = np.array(value, dtype=np.float32, copy=True)
        self._synced = False

    def get_weights(self) -> StateDict:
        return {k: torch.from_numpy(self._weights[k].copy()) for k in self.meta.weights}

    def _push_parameters(self) -> None:
        if not self._synced:
            for k, param in self._ort_params.items():
                param.data = self._weights[k]  # copies into ORT's tensor
            self._synced = True

    def _stats(self) -> list[np.ndarray]:
        return [self._weights[k] for k in self.meta.stats]

    # --- compute ---------------------------------------------------------------------------------------------------
    def logits(self, x: torch.Tensor, *, batch_size: int = 1024) -> torch.Tensor:
        """Eval-mode logits for ``x`` (N, *input_shape) with the current weights, computed in batches."""
        self._push_parameters()
        self._module.eval()
        names = self._module.input_names()
        outs = []
        for start in range(0, len(x), batch_size):
            feeds = {"x": np.ascontiguousarray(x[start : start + batch_size].numpy())}
            feeds.update(zip(self.meta.stats, self._stats(), strict=True))
            outs.append(torch.from_numpy(np.asarray(self._module(*(feeds[n] for n in names)))))
        return torch.cat(outs) if outs else torch.empty(0, self.meta.model.num_classes)

    def check_request(self, request: TrainRequest) -> None:
        """ConfigError unless these artifacts compute ``request``'s loss."""
        wanted = TrainingLoss.of(request.objective, request.terms)
        if wanted != self.loss:
            raise ConfigError(f"{self.source} trains {self.loss.tag}, the task asks for {wanted.tag}")

    def _feeds(
        self, request: TrainRequest, idx: torch.Tensor, step: int, terms: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        r = request
        inputs = r.batch_inputs(idx, step)
        feeds = {"x": np.ascontiguousarray(r.batch_x(idx, step).numpy()), "y": r.y[idx].long().numpy()}
        for spec in r.objective.inputs:
            t = inputs[spec.name]
            feeds[spec.name] = (t.bool() if spec.dtype == torch.bool else t.to(torch.float32)).contiguous().numpy()
        feeds.update(terms)
        feeds.update(zip(self.meta.stats, self._stats(), strict=True))
        return feeds

    def _term_feeds(self, request: TrainRequest) -> dict[str, np.ndarray]:
        """The terms' inputs of ``request`` by input name: the same for every step of it."""
        names = term_input_names(self.loss, self.meta.params, self.meta.weights)
        values = term_inputs(self.loss, self.meta.params, self.meta.weights, request.terms)
        return {n: v.numpy() for n, v in zip(names, values, strict=True)}

    def gradients(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """:data:`fedge.learning.training.Gradients` of cross-entropy artifacts (no objective inputs, no terms): one
        forward-backward pass, no step; the BN statistics stay as they were."""
        if self.loss.objective.inputs or self.loss.terms:
            raise ConfigError(f"{self.source} trains {self.loss.tag}; gradients are read from cross-entropy artifacts")
        self._push_parameters()
        self._module.train()
        feeds = {"x": np.ascontiguousarray(x.numpy()), "y": y.long().numpy()}
        feeds.update(zip(self.meta.stats, self._stats(), strict=True))
        self._module.lazy_reset_grad()
        self._module(*(feeds[n] for n in self._module.input_names()))
        return {k: torch.from_numpy(np.array(p.grad, dtype=np.float32, copy=True)) for k, p in self._ort_params.items()}

    def train(self, request: TrainRequest) -> TrainStats:
        """The request's epochs of mini-batch SGD in the batch order of :func:`fedge.learning.training.batch_order`."""
        self.check_request(request)
        r = request
        order = batch_order(len(r.x), r.epochs, r.batch_size, r.seed)
        terms = self._term_feeds(r)
        self._module.train()
        names = self._module.input_names()  # the exporter drops inputs a loss does not read (y for soft targets)
        n_stats = len(self.meta.stats)
        buffers: dict[str, np.ndarray | None] = dict.fromkeys(self.meta.params)  # momentum, fresh per task
        total, samples = 0.0, 0
        meter = EpochMeter(r, len(order))
        for step, idx in enumerate(order):
            self._push_parameters()
            feeds = self._feeds(r, idx, step, terms)
            self._module.lazy_reset_grad()  # ORT accumulates gradients across steps unless told not to
            outs = self._module(*(feeds[n] for n in names))
            loss = float(outs[0])
            for k, value in zip(self.meta.stats, outs[len(outs) - n_stats :], strict=True):
                self._weights[k] = np.array(value, dtype=np.float32, copy=True)
            for k, param in self._ort_params.items():
                grad = np.array(param.grad, dtype=np.float32, copy=True)
                buffers[k] = _sgd_step(self._weights[k], grad, buffers[k], r.sgd)
            self._synced = False
            if not math.isfinite(loss):
                log.warning("%s: non-finite loss %s", self.source, loss)
            total += loss
            meter.step(loss)
            samples += len(idx)
        return TrainStats(steps=len(order), samples=samples, mean_loss=total / len(order) if order else 0.0)


class OrtTrainingBackend:
    """The :class:`fedge.learning.backend.Backend` protocol on ONNX Runtime training artifacts (CPU)."""

    runtime = RUNTIME

    def __init__(
        self,
        model: str,
        input_shape: tuple[int, ...],
        num_classes: int,
        *,
        artifacts: ArtifactSource | None = None,
        threads: int = 0,
    ) -> None:
        import onnxruntime.training.api  # noqa: F401  (here, so that a missing runtime fails before the hello)

        self.spec = ModelSpec(model, tuple(input_shape), num_classes)
        self.artifacts: ArtifactSource = artifacts if artifacts is not None else ArtifactDirectory()
        self.threads = threads
        self._scratch = self.spec.build(seed=0)  # validates the spec and weights; never trained
        self._state: StateDict = exchanged_state(self._scratch)  # the same start as TorchBackend
        self._trainers: dict[TrainingLoss, OrtTrainer] = {}
        self._loaded: dict[TrainingLoss, int] = {}  # which version of the weights each trainer holds
        self._version = 0
        self._prepared = False  # set once artifacts were prepared before the hello: a later one is made in a round

    # --- weights ---------------------------------------------------------------------------------------------------
    def set_weights(self, state: StateDict) -> None:
        load_exchanged_state(self._scratch, state)  # validates names, shapes and dtypes like TorchBackend
        self._state = {k: state[k].detach().to(torch.float32).cpu().clone() for k in self._state}
        self._version += 1

    def get_weights(self) -> StateDict:
        return {k: v.clone() for k, v in self._state.items()}

    def init_weights(self, seed: int) -> StateDict:
        return exchanged_state(self.spec.build(seed=seed))

    # --- compute ---------------------------------------------------------------------------------------------------
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Eval-mode logits from the current weights (any loaded artifacts' eval model; the CE one if none)."""
        loss = next(iter(self._trainers), TrainingLoss(CrossEntropy()))
        return self._synced(loss).logits(x)

    def train(self, request: TrainRequest) -> TrainStats:
        check_hooks(request, RUNTIME_HOOKS[self.runtime], self.runtime)  # never drop a term the artifacts lack
        loss = TrainingLoss.of(request.objective, request.terms)
        if self._prepared and loss not in self._trainers:
            log.warning(
                "making the %s training artifacts now, in a round: they were not among those prepared from the run "
                "config",
                loss.tag,
            )
        trainer = self._synced(loss)
        try:
            stats = trainer.train(request)
        except BaseException:  # abandoned part-way (a task past its deadline): its weights are no longer ours
            self._loaded[loss] = -1
            raise
        self._state = trainer.get_weights()
        self._version += 1
        self._loaded[loss] = self._version
        if request.fisher_samples > 0:  # squared gradients of the cross-entropy artifacts at the trained weights
            ce = self._synced(TrainingLoss(CrossEntropy()))
            stats = dataclasses.replace(stats, fisher=fisher_diagonal(ce.gradients, request))
        return stats

    # --- artifacts -------------------------------------------------------------------------------------------------
    def prepare(self, losses: Iterable[TrainingLoss], batch_size: int) -> None:
        """Load (or make) the artifacts of ``losses`` now, before the client says hello; the batch is dynamic."""
        for loss in losses:
            self._synced(loss)
        self._prepared = True

    def _synced(self, loss: TrainingLoss) -> OrtTrainer:
        """The trainer for ``loss``, holding the current weights."""
        trainer = self._trainers.get(loss)
        if trainer is None:
            trainer = self._trainers[loss] = OrtTrainer(self.artifacts(self.spec, loss), threads=self.threads)
            if trainer.meta.model != self.spec:
                raise ConfigError(f"{trainer.source} holds {trainer.meta.model}, this client's data is for {self.spec}")
            self._loaded[loss] = -1
        if self._loaded[loss] != self._version:
            trainer.set_weights(self._state)
            self._loaded[loss] = self._version
        return trainer


__all__ = [
    "ARTIFACT_FILES",
    "ArtifactDirectory",
    "ArtifactSource",
    "OrtTrainer",
    "OrtTrainingBackend",
    "artifact_dir_name",
    "read_artifact_meta",
]
