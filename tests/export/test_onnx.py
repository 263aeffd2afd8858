"""ONNX export and ONNX Runtime: logit parity for every model, weights by state-dict name, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from export_support import SPECS, model_with, onnx_export, weights

from edge_client.backends import make_backend
from edge_client.backends.onnx_file import read_meta, read_weights, replace_weights
from edge_client.backends.runners import OnnxRunner
from export.cache import onnx_model
from export.parity import LOGIT_TOLERANCE, check_onnx, require
from fedge.algorithms.fedavg import CrossEntropy
from fedge.errors import ConfigError, ExportError
from fedge.training import SGDSettings, TrainRequest


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
    from fedge.models import load_exchanged_state

    load_exchanged_state(model, other)
    x = SPECS["dsfl_mnist_cnn"].example(4, seed=3)
    with torch.no_grad():
        expected = model.eval()(x)
    assert torch.allclose(runner.logits(x), expected, atol=LOGIT_TOLERANCE, rtol=0)
    got = runner.get_weights()
    assert all(torch.equal(got[k], other[k]) for k in other)
    with pytest.raises(ConfigError, match="missing"):
        runner.set_weights({k: v for k, v in other.items() if "running" not in k})


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
