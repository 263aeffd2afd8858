"""Reading an exported ONNX model on the device side: its fedge description and its weights, and replacing them.

What an onnxruntime client needs of the ``onnx`` package (the exporter, :mod:`export.onnx`, writes these files).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedge.errors import ExportError
from fedge.programs.spec import ProgramMeta
from fedge.types import StateDict

if TYPE_CHECKING:
    import onnx

ONNX_META_KEY = "fedge"
"""The ``metadata_props`` key under which an ONNX export carries its :class:`fedge.programs.spec.ProgramMeta`."""


def read_meta(data: bytes, *, source: str = "ONNX model") -> ProgramMeta:
    """The fedge description embedded in an ONNX model."""
    proto = _parse(data, source)
    for entry in proto.metadata_props:
        if entry.key == ONNX_META_KEY:
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
