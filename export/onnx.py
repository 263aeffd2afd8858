"""Export to ONNX with a dynamic batch dimension, and read or replace the weights of an ONNX model by name.

The dynamo exporter (``torch.onnx.export(..., dynamo=True)``) runs with ``optimize=False``: its optimizer folds
batch norm into neighbouring constants and rewrites the LSTM weights, which would break the one-to-one mapping
between initializers and state-dict names. ONNX Runtime optimizes the graph when it creates a session anyway, so
nothing is lost at run time (logits still match eager to ~1e-7).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from fedge.errors import ExportError
from fedge.programs import ModelSpec, ProgramMeta, describe_weights
from fedge.types import StateDict

if TYPE_CHECKING:
    import onnx

log = logging.getLogger(__name__)

META_KEY = "fedge"
"""Key of the ``metadata_props`` entry that holds the JSON :class:`ProgramMeta`."""

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
    entry.key, entry.value = META_KEY, meta.to_json()
    onnx.checker.check_model(proto)
    return bytes(proto.SerializeToString())


def read_meta(data: bytes, *, source: str = "ONNX model") -> ProgramMeta:
    """The fedge description embedded in an ONNX model."""
    proto = _parse(data, source)
    for entry in proto.metadata_props:
        if entry.key == META_KEY:
            return ProgramMeta.from_json(entry.value, source=source)
    raise ExportError(f"{source} carries no fedge description; export it with `fedge export --format onnx`")


def read_weights(data: bytes, *, source: str = "ONNX model") -> StateDict:
    """The exchanged weights held by an ONNX model's initializers, in state-dict order."""
    from onnx import numpy_helper

    meta = read_meta(data, source=source)
    inits = {i.name: i for i in _parse(data, source).graph.initializer}
    return {k: torch.from_numpy(numpy_helper.to_array(inits[k]).copy()) for k in meta.weights}


def replace_weights(data: bytes, state: Mapping[str, torch.Tensor], *, source: str = "ONNX model") -> bytes:
    """``data`` with the initializers of the exchanged weights replaced by ``state`` (same names, shapes, dtypes)."""
    from onnx import numpy_helper

    meta = read_meta(data, source=source)
    missing = [k for k in meta.weights if k not in state]
    unexpected = [k for k in state if k not in set(meta.weights)]
    if missing or unexpected:
        raise ExportError(f"weights do not fit {source}: missing {missing}, unexpected {unexpected}")
    proto = _parse(data, source)
    for init in proto.graph.initializer:
        if init.name in state:
            old = numpy_helper.to_array(init)
            new = state[init.name].detach().cpu().numpy()
            if new.shape != old.shape:
                raise ExportError(f"{init.name}: {source} has shape {old.shape}, the weights {new.shape}")
            init.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(new, dtype=old.dtype), init.name))
    return bytes(proto.SerializeToString())


def _parse(data: bytes, source: str) -> onnx.ModelProto:
    import onnx
    from google.protobuf.message import DecodeError

    try:
        return onnx.load_from_string(data)
    except DecodeError as exc:
        raise ExportError(f"{source} is not an ONNX model: {exc}") from exc
