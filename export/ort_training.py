"""ONNX Runtime training artifacts: the model and its loss as an ONNX graph, with ORT's gradient graph added.

Runs in the separate ``.venv-ort-training`` (``make ort-training``: onnxruntime-training 1.19.2, onnx 1.17.0, torch);
the device side is :mod:`edge_client.backends.ort_training`.

**The graph.** :class:`TrainingGraph` is the module exported: ``(x, y, *objective inputs, *anchors, *bn stats) ->
(loss, logits, *new bn stats)``. The loss is the registered objective's own code (:meth:`Objective.loss`, what eager
clients run) plus FedProx's ``mu/2 ||w - anchor||^2`` when the artifacts have one, so every objective
(``ce``, ``ntd``, ``lsd``, ``soft``, ``fd``) goes through the same path as the ExecuTorch training programs. It is
exported by torch's TorchScript-based ONNX exporter (opset 17, training mode, no constant folding, dynamic batch),
which needs no onnxscript and keeps the parameters as initializers named ``model.<state-dict name>``.
``onnxruntime.training.artifacts.generate_artifacts`` then adds the gradient graph; its custom ``onnxblock`` loss
block, :class:`GraphLoss`, takes the graph's own ``loss`` output as the loss rather than building a second one from
the logits. ORT's gradient of ``SoftmaxCrossEntropyLoss`` (what ``F.cross_entropy`` exports to) reads the node's
optional second output, which the exporter omits, so it is added before.

**Batch norm.** ORT training keeps no mutable buffers: the gradient graph has no way to hand updated running
statistics back. So, as in the ExecuTorch programs, the running statistics are graph inputs and their updated
values graph outputs: each ``BatchNorm`` layer is swapped for :class:`StatBatchNorm` (same parameters), which
normalizes with the batch statistics and computes the new running mean and unbiased variance as ``nn.BatchNorm``
does (momentum 0.1). The eval model (``eval_model.onnx``, exported from the same layers in eval mode and sharing the
parameters) normalizes with the running statistics passed in.

**The optimizer** is not in the artifacts: ORT's SGD has no momentum, so the client applies ``torch.optim.SGD``'s
update on the host from the gradients ORT exposes (:class:`edge_client.backends.ort_training.OrtTrainer`).

**Parity.** :func:`check_artifacts` runs the gate of :mod:`export.parity` (each step against a float64 step from the
same weights, free-running steps with momentum and weight decay on real-looking data against eager float64 within
eager float32's own spread, then eval logits of the trained weights); :class:`ArtifactCache` makes, checks and caches
artifacts for a client before it says hello.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edge_client.backends.cache_dir import default_cache_dir
from edge_client.backends.ort_training import (
    ARTIFACT_FILES,
    EVAL_MODEL,
    FORMAT,
    META_FILE,
    RUNTIME,
    ArtifactDirectory,
    OrtTrainer,
    artifact_dir_name,
    has_artifacts,
)
from export.cache import checked_once
from export.parity import ParityReport
from fedge.errors import ConfigError, ExportError
from fedge.learning.models import load_exchanged_state
from fedge.learning.objectives import OBJECTIVES, make_objective, objective_kinds
from fedge.learning.training import TrainRequest
from fedge.programs.spec import (
    WRAPPER_PREFIX,
    ModelSpec,
    ProgramMeta,
    TrainingLoss,
    describe_weights,
    example_training_inputs,
    stat_names,
    training_input_names,
)
from fedge.types import StateDict
from fedge_io import manifest

log = logging.getLogger(__name__)

OPSET = 17
LOSS_OUTPUT, LOGITS_OUTPUT = "loss", "logits"
ENV_DIR = ".venv-ort-training"
"""The environment ``make ort-training`` makes, at the repository root."""


# --- the exported graphs --------------------------------------------------------------------------------------------


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
    """``forward(x, y, *objective_inputs, *anchors, *bn_stats) -> (loss, logits, *new_bn_stats)``."""

    def __init__(self, model: nn.Module, loss: TrainingLoss) -> None:
        super().__init__(model)
        self.loss = loss

    def forward(self, x: torch.Tensor, y: torch.Tensor, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        objective = self.loss.objective
        n = len(objective.inputs)
        n_anchor = len(self.param_names) if self.loss.prox_mu else 0
        inputs = {spec.name: t for spec, t in zip(objective.inputs, args[:n], strict=True)}
        anchors = args[n : n + n_anchor]
        self.feed(args[n + n_anchor :])
        logits = self.model(x)
        loss = objective.loss(logits, y, inputs)
        if self.loss.prox_mu:
            params = dict(self.model.named_parameters())
            prox = sum((params[k] - a).pow(2).sum() for k, a in zip(self.param_names, anchors, strict=True))
            loss = loss + 0.5 * self.loss.prox_mu * prox
        return (loss, logits.detach(), *self.new_stats())


class EvalGraph(_StatsFeeder):
    """``forward(x, *bn_stats) -> logits`` in eval mode."""

    def forward(self, x: torch.Tensor, *stats: torch.Tensor) -> torch.Tensor:
        self.feed(stats)
        return self.model(x)


def _export(
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


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Send the process's file descriptor 2 to ``path``: ORT's graph builders log hundreds of info lines there
    whatever the configured severity (their sessions are made with default options)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "wb") as fh:
            os.dup2(fh.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def toolchain() -> str:
    """Versions that change what the artifacts contain."""
    from importlib.metadata import version

    import onnx

    return f"torch{torch.__version__.split('+')[0]}-onnx{onnx.__version__}-ort{version('onnxruntime-training')}"


def generate(spec: ModelSpec, loss: TrainingLoss, directory: Path, *, weights: StateDict | None = None) -> Path:
    """Write the training artifacts of ``spec`` and ``loss`` into ``directory`` (created; must be empty).

    ``weights``: the parameters stored in the checkpoint (default: the seed-0 initialization). Clients set the
    weights before every use, so this only matters for a device that trains from the artifacts' own weights.
    """
    import onnx
    from onnxruntime.training import artifacts, onnxblock

    class GraphLoss(onnxblock.Block):
        """The loss is the graph's own ``loss`` output: the objective the exporter computed inside the graph."""

        def build(self, loss_output: str, *_: str) -> str:
            return loss_output

    model = spec.build(seed=0)
    if weights is not None:
        load_exchanged_state(model, weights)
    shapes = describe_weights(model)
    params = tuple(k for k, _ in model.named_parameters())
    stats = stat_names(model)
    state = model.state_dict()
    stat_values = tuple(state[k].detach().clone() for k in stats)
    anchors = tuple(p.detach().clone() for p in model.parameters()) if loss.prox_mu else ()
    graph = TrainingGraph(model.train(), loss)
    names = training_input_names(loss, params)
    per_sample = ["x", "y", *(i.name for i in loss.objective.inputs if i.per_sample)]
    outputs = [LOSS_OUTPUT, LOGITS_OUTPUT, *(f"new.{k}" for k in stats)]
    try:
        proto = _export(
            graph,
            (*example_training_inputs(spec, loss, anchors, batch=4), *stat_values),
            (*names, *stats),
            outputs,
            per_sample,
            training=True,
        )
        for node in proto.graph.node:  # ORT's gradient of this op reads its optional second output (log_prob)
            if node.op_type == "SoftmaxCrossEntropyLoss" and len(node.output) < 2:
                node.output.append(f"{node.output[0]}.log_prob")
        initializers = [i.name for i in proto.graph.initializer]
        trainable = [WRAPPER_PREFIX + k for k in params]
        lost = sorted(set(trainable) - set(initializers))
        if lost:
            raise ExportError(f"the exported graph lost the parameter initializers {lost}")
        eval_model = spec.build(seed=0)
        with torch.no_grad():
            # Parameter values do not matter here (they become inputs, fed from the checkpoint state at run time), but
            # the exporter merges equal eval-mode initializers (fresh BN weights are all ones): make each distinct.
            for i, param in enumerate(eval_model.parameters()):
                param.fill_(float(i + 1))
        eval_proto = _export(
            EvalGraph(eval_model).eval(),
            (spec.example(2), *stat_values),
            ("x", *stats),
            [LOGITS_OUTPUT],
            ["x"],
            training=False,
        )
    except ExportError:
        raise
    except Exception as exc:  # the exporter raises many types; name the model and loss
        raise ExportError(f"ONNX export of {spec.name} ({loss.tag}) failed: {type(exc).__name__}: {exc}") from exc
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ort_log = Path(tmp) / "ort.log"
        try:
            with _stderr_to(ort_log):
                artifacts.generate_artifacts(
                    proto,
                    requires_grad=trainable,
                    frozen_params=[i for i in initializers if i not in set(trainable)],
                    loss=GraphLoss(),
                    loss_input_names=[LOSS_OUTPUT],
                    additional_output_names=outputs[1:],
                    artifact_directory=str(directory),
                )
        except Exception as exc:  # ORT raises its own types; its log says which op has no gradient
            tail = ort_log.read_text(errors="replace").strip().splitlines()[-5:]
            raise ExportError(
                f"ONNX Runtime training artifacts of {spec.name} ({loss.tag}) failed: {type(exc).__name__}: {exc}"
                + (f" (ORT log: {' | '.join(tail)})" if tail else "")
            ) from exc
    # The eval model generate_artifacts writes is the training graph with BN's training flags off, but this graph's
    # batch norm is explicit (batch statistics): replace it by the eval-mode export, its parameters made inputs so that
    # it shares them with the training model through the checkpoint state, as ORT's own eval model does.
    kept = []
    for init in eval_proto.graph.initializer:
        if init.name.startswith(WRAPPER_PREFIX):
            eval_proto.graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, init.dims))
        else:
            kept.append(init)
    del eval_proto.graph.initializer[:]
    eval_proto.graph.initializer.extend(kept)
    onnx.save(eval_proto, str(directory / EVAL_MODEL))
    meta = ProgramMeta(
        FORMAT,
        spec,
        loss=loss,
        weights=tuple(shapes),
        shapes=shapes,
        params=params,
        stats=stats,
        max_batch=0,
        extra={"toolchain": toolchain(), "opset": str(OPSET)},
    )
    (directory / META_FILE).write_text(meta.to_json() + "\n")
    # Digests of the set, checked by OrtTrainer before ONNX Runtime opens a file (damaged weights load silently).
    manifest.record(directory, {name: manifest.entry(directory / name, "ort-training") for name in ARTIFACT_FILES})
    return directory


# --- parity gate and cache ------------------------------------------------------------------------------------------


def check_artifacts(
    directory: Path,
    weights: Mapping[str, torch.Tensor] | None = None,
    *,
    batch_size: int | None = None,
    source: str | None = None,
) -> list[ParityReport]:
    """Logit, stepwise and drift parity of a set of artifacts against eager PyTorch (:mod:`export.parity`'s gate).

    The drift check runs :data:`export.parity.DRIFT_STEPS` free-running steps of ``batch_size`` (default
    :data:`export.parity.DRIFT_BATCH`) real-looking samples with momentum 0.9 and weight decay 1e-5, and compares the
    weights and BN statistics with eager float64's, within a tolerance set by eager float32's own distance.

    A failed drift run is repeated on other samples (:func:`export.parity.drift_with_retries`, as the ExecuTorch gate
    does): seen on ORT, 2 of 12 model and loss combinations at the standard samples took the other side of a
    round-off tie from eager float32 (a ReLU input 2e-8 from zero), while ORT's step-by-step gradients there match
    eager to 4e-8.
    Without ``weights`` the seed-0 initialization is the starting point. Does not raise on failure.
    """
    from export.parity import (
        DRIFT_BATCH,
        drift_request,
        drift_with_retries,
        logits_parity,
        reference_model,
        stepwise_parity,
    )

    trainer = OrtTrainer(directory, threads=torch.get_num_threads())
    spec = trainer.meta.model
    start: StateDict = dict(weights) if weights is not None else trainer.get_weights()
    source = source or directory.name
    trained: list[StateDict] = []

    def run(request: TrainRequest) -> StateDict:
        trainer.set_weights(start)
        trainer.train(request)
        trained.append(trainer.get_weights())
        return trained[-1]

    def run_from(begin: Mapping[str, torch.Tensor], request: TrainRequest) -> StateDict:
        trainer.set_weights(begin)
        trainer.train(request)
        return trainer.get_weights()

    batch = batch_size or DRIFT_BATCH
    request = drift_request(spec, trainer.loss, batch_size=batch)
    # Stepwise first: each step from float64's weights measures the arithmetic itself, so a wrong gradient or an
    # imprecise kernel fails it whatever the samples; the retries are for drift only.
    stepwise = stepwise_parity(run_from, spec, start, request, source=source, runtime=RUNTIME)
    drift = drift_with_retries(run, spec, start, trainer.loss, batch_size=batch, source=source, runtime=RUNTIME)
    # Eval-mode logits (the eval model) on the trained weights: BN then normalizes with moved running statistics.
    trainer.set_weights(trained[0])
    logits = logits_parity(trainer.logits, reference_model(spec, trained[0]), spec, source=source, runtime=RUNTIME)
    return [logits, stepwise, *drift]


def _digest(directory: Path) -> bytes:
    """What identifies a set of artifacts for :func:`export.cache.checked_once`."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(directory)):
        if (directory / name).is_file():
            h.update(name.encode() + b"\0" + (directory / name).read_bytes())
    return h.digest()


class ArtifactCache:
    """An :data:`edge_client.backends.ort_training.ArtifactSource` that makes (and checks) what the cache lacks.

    A missing set is generated into a temporary directory beside its final place, parity-checked
    (:func:`check_artifacts`, raising :class:`ExportError` on failure) and renamed into place, so a client never
    loads a half-written or unchecked set and client processes can share the cache. A present set is checked again
    once per process: a cache directory is a place where stale or foreign files appear.
    """

    def __init__(self, cache_dir: Path | None = None, *, verify: bool = True) -> None:
        self.cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
        self.verify = verify

    def _check(self, directory: Path, name: str) -> None:
        from export.parity import require

        def check(_: bytes, source: str) -> None:
            for report in require(check_artifacts(directory, source=source)):
                log.info("%s", report)

        checked_once(_digest(directory), name, check if self.verify else None)

    def __call__(self, spec: ModelSpec, loss: TrainingLoss) -> Path:
        final = self.cache_dir / artifact_dir_name(spec, loss)
        try:
            if has_artifacts(final):
                self._check(final, str(final))
                log.debug("using cached ONNX Runtime training artifacts %s", final)
                return final
            log.info("making ONNX Runtime training artifacts %s (cached for later runs)", final.name)
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", suffix=".tmp", dir=self.cache_dir))
            try:
                generate(spec, loss, tmp)
                self._check(tmp, final.name)
                try:
                    os.rename(tmp, final)  # atomic; fails if another process got there first
                except OSError:
                    if not has_artifacts(final):
                        raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            return final
        except OSError as exc:
            raise ConfigError(f"cannot use the program cache {self.cache_dir}: {exc}") from exc


# --- speed ----------------------------------------------------------------------------------------------------------


def step_times(
    spec: ModelSpec, *, batch: int = 50, threads: int = 1, steps: int = 10, repeats: int = 5
) -> dict[str, float]:
    """Median ms per training step of these artifacts and of eager PyTorch, same process, ``threads`` threads each.

    FedNTD loss, momentum 0.9, weight decay 1e-5, ``steps`` steps of ``batch`` per pass, ``repeats`` passes after a
    warm-up pass, the runtimes interleaved. ``eager_ms``: :func:`fedge.learning.training.train` on the model in its
    default memory layout (what ``benchmarks/runtimes.py`` times); ``torch_client_ms``: the PyTorch client's backend
    (:class:`fedge.learning.backend.TorchBackend`, convolutions channels-last on the CPU). The ORT figure includes the
    host-side SGD step and the copies of weights and gradients between host and ORT. Runs in ``.venv-ort-training``;
    :func:`step_times_in_env` calls it from another environment.
    """
    from export.parity import DRIFT_SGD, parity_sample
    from fedge.algorithms.fedntd import NotTrueDistillation
    from fedge.learning.backend import TorchBackend
    from fedge.learning.training import TrainRequest, predict_logits, train

    torch.set_num_threads(threads)
    loss = TrainingLoss(NotTrueDistillation())
    x, y = parity_sample(spec, batch * steps, seed=3)
    teacher = predict_logits(spec.build(seed=1), x)
    request = TrainRequest(x, y, loss.objective, DRIFT_SGD, 1, batch, 0, inputs={"teacher": teacher})
    model = spec.build(seed=0)
    start = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}
    client = TorchBackend(spec.name, spec.input_shape, spec.num_classes)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = OrtTrainer(generate(spec, loss, Path(tmp) / "artifacts"), threads=threads)

        def ort_pass() -> None:
            trainer.set_weights(start)
            trainer.train(request)

        def eager_pass() -> None:
            load_exchanged_state(model, start)
            train(model, request)

        def client_pass() -> None:
            client.set_weights(start)
            client.train(request)

        passes = {"eager_ms": eager_pass, "torch_client_ms": client_pass, "ort_training_ms": ort_pass}
        times: dict[str, list[float]] = {name: [] for name in passes}
        for i in range(repeats + 1):
            for name, run in passes.items():  # interleaved: every runtime sees the same machine load
                t = time.perf_counter()
                run()
                if i:  # the first pass is a warm-up
                    times[name].append((time.perf_counter() - t) * 1e3 / steps)
    result = {name: statistics.median(values) for name, values in times.items()}
    result["ratio"] = result["ort_training_ms"] / result["eager_ms"]
    result["ratio_to_torch_client"] = result["ort_training_ms"] / result["torch_client_ms"]
    return result


def env_python(root: Path | None = None) -> Path | None:
    """The Python of ``.venv-ort-training`` at ``root`` (default: this checkout), or None if it is not installed."""
    base = root if root is not None else Path(__file__).resolve().parents[1]
    python = base / ENV_DIR / "bin" / "python"
    return python if python.exists() else None


def step_times_in_env(
    spec: ModelSpec,
    *,
    batch: int = 50,
    threads: int = 1,
    repeats: int = 5,
    python: Path | None = None,
    timeout: float = 600.0,
) -> dict[str, float] | None:
    """:func:`step_times` run in ``.venv-ort-training`` from any environment (e.g. ``benchmarks/runtimes.py``); None
    when that environment is not installed."""
    python = python or env_python()
    if python is None:
        return None
    cmd = [str(python), "-m", "export.ort_training", "bench", "--model", spec.name, "--input-shape"]
    cmd += [",".join(map(str, spec.input_shape)), "--num-classes", str(spec.num_classes)]
    cmd += ["--batch", str(batch), "--threads", str(threads), "--repeats", str(repeats)]
    root = Path(__file__).resolve().parents[1]  # the checkout whose code the other environment must run
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, cwd=root)
    if done.returncode != 0:
        raise ExportError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# --- command line (in .venv-ort-training) ---------------------------------------------------------------------------


def _spec(args: argparse.Namespace) -> ModelSpec:
    from fedge.learning.models import example_input

    try:
        shape = (
            tuple(int(d) for d in args.input_shape.split(","))
            if args.input_shape
            else tuple(example_input(args.model, batch=1).shape[1:])
        )
    except ValueError:
        raise ConfigError(f"--input-shape must be comma-separated integers, got {args.input_shape!r}") from None
    return ModelSpec(args.model, shape, args.num_classes)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m export.ort_training [generate|check|bench]``: make artifacts for a device, check, time them."""
    p = argparse.ArgumentParser(prog="python -m export.ort_training", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["generate", "check", "bench"], nargs="?", default="generate")
    p.add_argument("--model", default="fedavg_cnn")
    p.add_argument("--input-shape", default=None, help="per-sample input shape, e.g. 1,28,28 (none: the paper's)")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--objective", nargs="+", choices=objective_kinds(), default=["ntd"])
    p.add_argument("--tau", type=float, default=1.0, help="distillation temperature baked into ntd/lsd artifacts")
    p.add_argument("--beta", type=float, default=1.0, help="distillation weight baked into ntd artifacts")
    p.add_argument("--gamma", type=float, default=1.0, help="FD regularizer weight baked into fd artifacts")
    p.add_argument("--prox-mu", type=float, default=0.0, help="FedProx: bake the proximal term mu in")
    p.add_argument("--out", type=Path, default=None, help="artifact directory (default: the program cache)")
    p.add_argument("--batch", type=int, default=50, help="bench: batch size")
    p.add_argument("--threads", type=int, default=1, help="bench: threads for both runtimes")
    p.add_argument("--repeats", type=int, default=5, help="bench: timed passes of 10 steps (after one warm-up)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = _spec(args)
    if args.command == "bench":
        print(json.dumps(step_times(spec, batch=args.batch, threads=args.threads, repeats=args.repeats)))
        return 0
    failed = False
    for kind in args.objective:
        given = {"tau": args.tau, "beta": args.beta, "gamma": args.gamma}
        fields = {f.name for f in dataclasses.fields(OBJECTIVES[kind])}
        objective = make_objective(kind, {k: repr(float(v)) for k, v in given.items() if k in fields})
        loss = TrainingLoss(objective, float(args.prox_mu))
        try:
            if args.command == "check":  # what is there, without making anything
                for report in check_artifacts(ArtifactDirectory(args.out)(spec, loss)):
                    print(report)
                    failed |= not report.passed
            else:  # made, checked (the parity gate logs its reports) and written under the cache's name
                print(ArtifactCache(args.out)(spec, loss))
        except (ConfigError, ExportError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
