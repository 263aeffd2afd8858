"""ONNX export and ONNX Runtime: logit parity for every model, weights by state-dict name, refusals, old runtimes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from export_support import SPECS, model_with, onnx_export, weights

from edge_client.backends import make_backend
from edge_client.backends.onnx_file import read_meta, read_weights, replace_weights
from edge_client.backends.runners import OnnxRunner
from export.cache import onnx_model
from export.gates.logits import LOGIT_TOLERANCE, check_onnx
from export.gates.report import require
from export.onnx import (
    DEFAULT_OPSET,
    MIN_OPSET,
    ONNXRUNTIME_RELEASES,
    OnnxTarget,
    export_onnx,
    onnx_target,
)
from fedge.algorithms.fedavg import CrossEntropy
from fedge.errors import ConfigError, ExportError
from fedge.learning.training import SGDSettings, TrainRequest


@pytest.mark.isa
@pytest.mark.parametrize("name", sorted(SPECS))
def test_onnx_runtime_logits_match_eager_for_every_model(name: str) -> None:
    data = onnx_export(name)
    (report,) = require(check_onnx(data, weights(name), source=name))  # batches 1 and 5: the batch dim is dynamic
    assert report.max_abs_diff < LOGIT_TOLERANCE
    assert read_meta(data).model == SPECS[name]
    # Initializers carry the state-dict names and values, one to one.
    stored, expected = read_weights(data), weights(name)
    assert list(stored) == list(expected)
    assert all(torch.equal(stored[k], expected[k]) for k in expected)


def test_weights_go_in_by_name_and_come_out_unchanged() -> None:
    runner = OnnxRunner(onnx_export("dsfl_mnist_cnn"))
    other = {k: v + 0.01 * torch.randn_like(v) for k, v in weights("dsfl_mnist_cnn").items()}
    runner.set_weights(other)
    model = model_with("dsfl_mnist_cnn")
    from fedge.learning.models import load_exchanged_state

    load_exchanged_state(model, other)
    x = SPECS["dsfl_mnist_cnn"].example(4, seed=3)
    with torch.no_grad():
        expected = model.eval()(x)
    assert torch.allclose(runner.logits(x), expected, atol=LOGIT_TOLERANCE, rtol=0)
    got = runner.get_weights()
    assert all(torch.equal(got[k], other[k]) for k in other)
    with pytest.raises(ConfigError, match="missing"):
        runner.set_weights({k: v for k, v in other.items() if "running" not in k})


@pytest.mark.isa
def test_a_model_that_does_not_compute_what_eager_computes_is_refused_with_the_measured_difference() -> None:
    good = weights("fedavg_cnn")
    tampered = dict(good)
    tampered["classifier.2.bias"] = good["classifier.2.bias"] + 1e-3  # what a broken conversion might do
    data = replace_weights(onnx_export("fedavg_cnn"), tampered)
    (report,) = check_onnx(data, good, source="tampered.onnx")
    assert not report.passed and report.max_abs_diff == pytest.approx(1e-3, rel=1e-3)
    with pytest.raises(ExportError, match=r"tampered\.onnx: logits parity on onnxruntime FAILED: max abs diff 0\.001"):
        require([report])


def test_an_onnxruntime_client_refuses_to_train_and_says_what_it_can_do(tmp_path: Path) -> None:
    spec = SPECS["tiny_mlp"]
    data = onnx_model(spec, cache_dir=tmp_path)
    backend = make_backend("onnxruntime", spec.name, spec.input_shape, spec.num_classes, onnx_model=data)
    x = spec.example(3)
    with pytest.raises(ConfigError, match=r"cannot train.*predict-only"):
        backend.train(TrainRequest(x, torch.zeros(3, dtype=torch.long), CrossEntropy(), SGDSettings(0.1), 1, 2, 0))
    assert backend.logits(x).shape == (3, 10)
    assert list(tmp_path.glob("tiny_mlp-1x8x8-c10-*.onnx"))  # exported once, checked, cached


def _declared(data: bytes) -> tuple[int, int]:
    """(IR version, default-domain opset) a file declares."""
    proto = onnx.load_from_string(data)
    (opset,) = (o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    return proto.ir_version, opset


def _release(version: str) -> tuple[str, int, int] | None:
    """The row of ``ONNXRUNTIME_RELEASES`` for an onnxruntime version such as "1.16.3" (None if not listed)."""
    major_minor = ".".join(version.split(".")[:2])
    return next((r for r in ONNXRUNTIME_RELEASES if r[0] == major_minor), None)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_default_export_declares_what_onnxruntime_1_16_loads_and_computes_eager_logits(name: str) -> None:
    data = onnx_export(name)  # export_onnx with its defaults
    ir_version, opset = _declared(data)
    # onnxruntime 1.16 and 1.17 (JetPack 5/6) load IR <= 9 and implement opsets up to 19 and 20; they refuse IR 10.
    assert ir_version <= 9 and opset <= 17
    for jetpack in ("1.16", "1.17"):
        row = _release(jetpack)
        assert row is not None and opset <= row[1] and ir_version <= row[2]
    assert read_meta(data).extra == {"opset": "17", "ir_version": "8", "min_onnxruntime": "1.12"}
    (report,) = require(check_onnx(data, weights(name), source=name))
    assert report.max_abs_diff < LOGIT_TOLERANCE


def test_each_opset_targets_the_oldest_onnxruntime_that_implements_it_at_the_ir_version_it_loads() -> None:
    assert onnx_target(DEFAULT_OPSET) == OnnxTarget(17, 8, "1.12")
    assert onnx_target(19) == OnnxTarget(19, 9, "1.16")  # 1.15 lacks the Shape-19 kernel (measured)
    for opset in range(MIN_OPSET, ONNXRUNTIME_RELEASES[-1][1] + 1):
        target = onnx_target(opset)
        runs_it = [r for r in ONNXRUNTIME_RELEASES if r[1] >= opset]
        assert target.min_onnxruntime == runs_it[0][0]
        # every release that implements the opset loads the declared IR version: a later release never loads less
        assert all(target.ir_version <= ir for _, _, ir in runs_it)


def test_an_export_below_the_exporters_opset_is_converted_by_onnx_and_still_matches_eager() -> None:
    # Batch norm at opset 15: the exporter's own down-conversion fails there (and keeps opset 18 with a warning).
    name = "dsfl_mnist_cnn"
    data = export_onnx(model_with(name), SPECS[name], opset=MIN_OPSET)
    assert _declared(data) == (8, 15)
    (report,) = require(check_onnx(data, weights(name), source=f"{name} opset 15"))
    assert report.max_abs_diff < LOGIT_TOLERANCE
    assert list(read_weights(data)) == list(weights(name))  # the conversion keeps the state-dict names
    data = export_onnx(model_with("tiny_mlp"), SPECS["tiny_mlp"], opset=21)
    assert _declared(data) == (10, 21)
    require(check_onnx(data, weights("tiny_mlp"), source="tiny_mlp opset 21"))


@pytest.mark.parametrize("opset", [14, 22])
def test_an_opset_without_a_target_is_a_config_error_naming_the_choices(opset: int) -> None:
    with pytest.raises(
        ConfigError, match=rf"opset {opset} is not supported: choose one of 15-21.*17 \(onnxruntime >= 1\.12\)"
    ):
        export_onnx(model_with("tiny_mlp"), SPECS["tiny_mlp"], opset=opset)


OLD_ORT_ENV = "FEDGE_OLD_ORT_PYTHON"
"""Pythons (separated by os.pathsep) whose onnxruntime is an old release, each in a throwaway venv, e.g.
``python3 -m venv /tmp/ort116 && /tmp/ort116/bin/pip install onnxruntime==1.16.3 'numpy<2'`` (about 15 s)."""

_OLD_ORT_SCRIPT = """
import json, sys
import numpy as np
import onnxruntime as ort
ort.set_default_logger_severity(3)
results = {}
for model, x in json.loads(sys.argv[1]):
    try:
        session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        results[model] = session.run(None, {"x": np.load(x)})[0].tolist()
    except Exception as exc:  # a refusal is a result here
        results[model] = str(exc)
print(json.dumps({"version": ort.__version__, "results": results}))
"""


def _run_old_onnxruntime(python: str, files: list[tuple[Path, Path]]) -> tuple[str, dict[str, list[object] | str]]:
    """(onnxruntime version, per model file: its logits or the error it was refused with) in ``python``."""
    done = subprocess.run(
        [python, "-c", _OLD_ORT_SCRIPT, json.dumps([[str(m), str(x)] for m, x in files])],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    return out["version"], out["results"]


@pytest.mark.skipif(
    not os.environ.get(OLD_ORT_ENV),
    reason=f"{OLD_ORT_ENV} names no python with an old onnxruntime (e.g. a venv with onnxruntime==1.16.3 'numpy<2')",
)
@pytest.mark.parametrize("python", os.environ.get(OLD_ORT_ENV, "").split(os.pathsep))
def test_an_old_onnxruntime_loads_default_exports_and_what_the_table_says(python: str, tmp_path: Path) -> None:
    files: list[tuple[Path, Path]] = []
    for name in sorted(SPECS):
        model_path, x_path = tmp_path / f"{name}.onnx", tmp_path / f"{name}-x.npy"
        model_path.write_bytes(onnx_export(name))
        np.save(x_path, SPECS[name].example(7, seed=5).numpy())
        files.append((model_path, x_path))
    version, _ = _run_old_onnxruntime(python, [])
    row = _release(version)
    # fedavg_cnn (Shape, Conv, MaxPool, Gemm) at the newest opset the table gives this release, and at the next one
    edge = [row[1], row[1] + 1] if row is not None and row[1] < ONNXRUNTIME_RELEASES[-1][1] else []
    for opset in edge:
        model_path = tmp_path / f"fedavg_cnn-opset{opset}.onnx"
        model_path.write_bytes(export_onnx(model_with("fedavg_cnn"), SPECS["fedavg_cnn"], opset=opset))
        files.append((model_path, tmp_path / "fedavg_cnn-x.npy"))
    version, results = _run_old_onnxruntime(python, files)
    for name in sorted(SPECS):
        got = results[str(tmp_path / f"{name}.onnx")]
        assert not isinstance(got, str), f"onnxruntime {version} refused the default {name} export: {got}"
        with torch.no_grad():
            expected = model_with(name).eval()(SPECS[name].example(7, seed=5))
        diff = float((torch.tensor(got) - expected).abs().max())
        print(f"{name}: onnxruntime {version} vs eager, max abs diff {diff:.2e}", file=sys.stderr)
        assert diff < LOGIT_TOLERANCE
    if edge:
        assert not isinstance(results[str(tmp_path / f"fedavg_cnn-opset{edge[0]}.onnx")], str)
        assert isinstance(results[str(tmp_path / f"fedavg_cnn-opset{edge[1]}.onnx")], str), (
            f"onnxruntime {version} loads opset {edge[1]}: ONNXRUNTIME_RELEASES undersells it"
        )
