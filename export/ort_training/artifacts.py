"""A set of ONNX Runtime training artifacts written to a directory (see :mod:`export.ort_training`).

:func:`generate` exports the graphs of :mod:`export.ort_training.graph`, has ORT add the gradient graph and the
optimizer and checkpoint files, replaces ORT's eval model by the eval-mode export, and writes the program metadata and
the digests of the set.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from edge_client.backends.ort_training import ARTIFACT_FILES, EVAL_MODEL, FORMAT, META_FILE
from export.ort_training.graph import LOGITS_OUTPUT, LOSS_OUTPUT, OPSET, EvalGraph, TrainingGraph, export_graph
from fedge.errors import ExportError
from fedge.learning.models import load_exchanged_state
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
    example = example_training_inputs(spec, loss, model, batch=4)
    graph = TrainingGraph(model.train(), loss)
    names = training_input_names(loss, params, tuple(shapes))
    per_sample = ["x", "y", *(i.name for i in loss.objective.inputs if i.per_sample)]
    outputs = [LOSS_OUTPUT, LOGITS_OUTPUT, *(f"new.{k}" for k in stats)]
    try:
        proto = export_graph(
            graph,
            (*example, *stat_values),
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
        eval_proto = export_graph(
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
