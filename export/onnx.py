"""Export to ONNX with a dynamic batch dimension, and read or replace the weights of an ONNX model by name.

The dynamo exporter (``torch.onnx.export(..., dynamo=True)``) runs with ``optimize=False``: its optimizer folds
batch norm into neighbouring constants and rewrites the LSTM weights, which would break the one-to-one mapping
between initializers and state-dict names. ONNX Runtime optimizes the graph when it creates a session anyway, so
nothing is lost at run time (logits still match eager to ~1e-7).

Old device runtimes refuse a file by its IR version before they look at its operators: onnxruntime 1.16/1.17 (what
JetPack 5/6 ship) stop at IR 9, while the exporter stamps IR 10 whatever the opset. So a file targets
the oldest onnxruntime release that implements its opset (:data:`ONNXRUNTIME_RELEASES`, onnxruntime's compatibility
table) and declares the newest IR version that release loads; every later release loads it too. The default, opset
17, gives IR 8: onnxruntime 1.12 and later.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from edge_client.backends.onnx_file import ONNX_META_KEY
from fedge.errors import ConfigError, ExportError
from fedge.programs.spec import ModelSpec, ProgramMeta, describe_weights

log = logging.getLogger(__name__)

INPUT_NAME = "x"
OUTPUT_NAME = "logits"

ONNXRUNTIME_RELEASES: tuple[tuple[str, int, int], ...] = (
    # (release, newest default-domain opset it implements, newest IR version it loads)
    ("1.9", 15, 8),
    ("1.10", 15, 8),
    ("1.11", 16, 8),
    ("1.12", 17, 8),
    ("1.13", 17, 8),
    ("1.14", 18, 8),
    # Documented as opset 19, but 1.15.1 has no Shape-19 kernel ("Could not find an implementation for Shape(19)",
    # measured): every model here but reuters_mlp uses Shape, so opset 19 targets 1.16.
    ("1.15", 18, 8),
    ("1.16", 19, 9),
    ("1.17", 20, 9),
    ("1.18", 21, 10),
    ("1.19", 21, 10),
    ("1.20", 21, 10),
)
"""onnxruntime's compatibility table (https://onnxruntime.ai/docs/reference/compatibility.html), oldest first.

A release runs every opset up to its own (7 and later), so an opset-``n`` file declaring IR ``v`` loads on every
release with opset >= ``n`` and IR >= ``v``. Checked with onnxruntime 1.15.1, 1.16.3, 1.17.3 and 1.18.1: each loads
every opset up to its row and refuses the next (tests/export/test_onnx.py, given such runtimes).
"""

EXPORTER_OPSET = 18
"""The opset torch's dynamo exporter builds its graphs in; a lower target is converted from it."""

MIN_OPSET = 15
"""The lowest opset ``onnx.version_converter`` reaches from the exporter's graphs (``Shape`` has no 15 -> 14 step)."""

DEFAULT_OPSET = 17
"""Opset 17 / IR 8: onnxruntime 1.12 and later load it, JetPack 5/6's 1.16 and 1.17 included."""


@dataclass(frozen=True)
class OnnxTarget:
    """What an ONNX file declares for ``opset``, and the oldest onnxruntime release that loads it."""

    opset: int
    ir_version: int
    min_onnxruntime: str


def onnx_target(opset: int) -> OnnxTarget:
    """The IR version and oldest onnxruntime of an ``opset`` file; ConfigError naming the choices for any other."""
    supported = range(MIN_OPSET, ONNXRUNTIME_RELEASES[-1][1] + 1)
    if opset not in supported:
        choices = ", ".join(f"{t.opset} (onnxruntime >= {t.min_onnxruntime})" for t in map(onnx_target, supported))
        raise ConfigError(
            f"ONNX opset {opset} is not supported: choose one of {supported[0]}-{supported[-1]}, the newest that "
            f"the oldest onnxruntime you deploy implements: {choices}; default {DEFAULT_OPSET}"
        )
    release, _, ir_version = next(r for r in ONNXRUNTIME_RELEASES if r[1] >= opset)
    return OnnxTarget(opset, ir_version, release)


def export_onnx(model: nn.Module, spec: ModelSpec, *, opset: int = DEFAULT_OPSET) -> bytes:
    """The eval-mode ``model`` as a serialized ONNX model with input ``x`` (batch dim dynamic) and output ``logits``.

    The file declares ``opset`` and the IR version of :func:`onnx_target`; its ``fedge`` metadata names both and the
    oldest onnxruntime release that loads it.
    """
    import onnx
    import onnx.version_converter

    target = onnx_target(opset)
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
            # Below its own opset the exporter converts with onnxscript's adapters, which fail on batch norm at 15
            # and then keep opset 18 with only a warning; onnx's version converter below handles every model here.
            opset_version=max(opset, EXPORTER_OPSET),
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
    if opset < EXPORTER_OPSET:
        try:
            proto = onnx.version_converter.convert_version(proto, opset)
        except Exception as exc:  # RuntimeError from a missing adapter, ValueError for a bad target
            raise ExportError(f"ONNX export of {spec.name} cannot be converted to opset {opset}: {exc}") from exc
    declared = {o.domain: o.version for o in proto.opset_import}
    if declared.get("", declared.get("ai.onnx")) != opset:
        raise ExportError(f"ONNX export of {spec.name} should declare opset {opset} but declares {declared}")
    # The exporter stamps the newest IR version whatever the opset; what old runtimes check first is this number.
    proto.ir_version = target.ir_version
    missing = sorted(set(names) - {i.name for i in proto.graph.initializer})
    if missing:
        raise ExportError(f"ONNX export of {spec.name} lost the state-dict names of initializers {missing}")
    extra = {"opset": str(opset), "ir_version": str(target.ir_version), "min_onnxruntime": target.min_onnxruntime}
    meta = ProgramMeta("onnx", spec, weights=names, shapes=shapes, extra=extra)
    entry = proto.metadata_props.add()
    entry.key, entry.value = ONNX_META_KEY, meta.to_json()
    try:
        # full_check adds shape inference: the converted graph must still type-check at this opset and IR version.
        onnx.checker.check_model(proto, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise ExportError(
            f"ONNX export of {spec.name} at opset {opset} / IR {target.ir_version} is invalid: {exc}"
        ) from exc
    return bytes(proto.SerializeToString())
