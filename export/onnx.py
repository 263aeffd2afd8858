"""Export to ONNX with a dynamic batch dimension, and read or replace the weights of an ONNX model by name.

The dynamo exporter (``torch.onnx.export(..., dynamo=True)``) runs with ``optimize=False``: its optimizer folds
batch norm into neighbouring constants and rewrites the LSTM weights, which would break the one-to-one mapping
between initializers and state-dict names. ONNX Runtime optimizes the graph when it creates a session anyway, so
nothing is lost at run time (logits still match eager to ~1e-7).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from edge_client.backends.onnx_file import ONNX_META_KEY
from fedge.errors import ExportError
from fedge.programs import ModelSpec, ProgramMeta, describe_weights

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

INPUT_NAME = "x"
OUTPUT_NAME = "logits"


def export_onnx(model: nn.Module, spec: ModelSpec, *, opset: int | None = None) -> bytes:
    """The eval-mode ``model`` as a serialized ONNX model with input ``x`` (batch dim dynamic) and output ``logits``."""
    import onnx

    was_training = model.training
    model.eval()
    shapes = describe_weights(model)
    names = tuple(shapes)
    try:
        program = torch.onnx.export(
            model,
            (spec.example(2),),
            dynamo=True,
            optimize=False,
            opset_version=opset,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_shapes={"x": {0: torch.export.Dim("batch")}},
            verbose=False,
        )
    except Exception as exc:  # the exporter raises many types; name the model
        raise ExportError(f"ONNX export of {spec.name} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        model.train(was_training)
    if program is None:
        raise ExportError(f"ONNX export of {spec.name} returned no program")
    proto = program.model_proto
    missing = sorted(set(names) - {i.name for i in proto.graph.initializer})
    if missing:
        raise ExportError(f"ONNX export of {spec.name} lost the state-dict names of initializers {missing}")
    meta = ProgramMeta("onnx", spec, weights=names, shapes=shapes)
    entry = proto.metadata_props.add()
    entry.key, entry.value = ONNX_META_KEY, meta.to_json()
    onnx.checker.check_model(proto)
    return bytes(proto.SerializeToString())
