"""A model the exporters cannot lower: the error names the layer and says what to do, in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from plugin_support import fresh_plugins  # noqa: F401 - pytest fixture
from torch import nn

from export.diagnose import failing_layer
from fedge_cli.main import main

GATED = """
from torch import nn
from fedge.plugins import register_model


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # a Python branch on a tensor's value: torch.export cannot trace it
            return x
        return -x


class Gated(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(input_shape[0], 8), Gate(), nn.ReLU())
        self.head = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.head(self.body(x))


register_model("gated_mlp", Gated)
"""


@pytest.mark.usefixtures("fresh_plugins")
def test_the_error_names_the_innermost_layer_that_cannot_be_lowered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plugin = tmp_path / "gated.py"
    plugin.write_text(GATED)
    flags = ["--model", "gated_mlp", "--input-shape", "4", "--num-classes", "3", "--format", "onnx"]
    assert main(["export", "--plugin", str(plugin), *flags, "--out", str(tmp_path / "out")]) == 2
    # torch's exporter prints its graphs to stderr as it fails; fedge's own error is the last line, and one line.
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("fedge: error: ONNX export of gated_mlp failed: layer 'body.1' (Gate) cannot be lowered")
    assert "Could not guard on data-dependent expression" in error  # torch's reason, its first line
    assert "no Python branch or loop on tensor values" in error and "--runtime torch" in error


def test_a_model_whose_layers_all_export_is_not_blamed_on_one() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert failing_layer(model, torch.randn(2, 4)) is None
