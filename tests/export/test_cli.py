"""`fedge export` and `fedge export check`: export, gate on parity, print sizes; refuse what fails."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from export_support import pte_export

from cli.main import main
from edge_client.backends.onnx_file import replace_weights


def test_export_writes_checked_files_and_check_accepts_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "exports"
    args = ["export", "--model", "tiny_mlp", "--input-shape", "1,8,8", "--seed", "3", "--out", str(out)]
    assert main([*args, "--format", "onnx", "pte", "pte-train", "--objective", "ce", "--max-batch", "16"]) == 0
    printed = capsys.readouterr().out
    files = sorted(p.name for p in out.iterdir())
    # The training program gets the one name clients look programs up by (fedge.programs.program_file_name).
    assert files == ["tiny_mlp-1x8x8-c10-ce-b16-v2.pte", "tiny_mlp.onnx", "tiny_mlp.pte", "weights.safetensors"]
    assert "drift parity on executorch ok" in printed and "logits parity on onnxruntime ok" in printed
    assert f"{out / 'tiny_mlp.onnx'}" in printed and "bytes)" in printed  # sizes

    paths = [str(out / f) for f in files if f != "weights.safetensors"]
    assert main(["export", "check", *paths]) == 0  # the .pte check reads weights.safetensors beside it
    assert capsys.readouterr().out.count(" ok: ") == 4  # onnx, pte, and the training program's logits + steps


def test_check_refuses_a_file_that_does_not_match_its_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "exports"
    assert main(["export", "--model", "tiny_mlp", "--input-shape", "1,8,8", "--format", "onnx", "--out", str(out)]) == 0
    from safetensors.torch import load_file

    weights = load_file(str(out / "weights.safetensors"))
    bad = {k: v + 1e-3 if k == "layers.2.bias" else v for k, v in weights.items()}
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(out / "weights.safetensors", other / "weights.safetensors")
    (other / "tiny_mlp.onnx").write_bytes(replace_weights((out / "tiny_mlp.onnx").read_bytes(), bad))
    capsys.readouterr()
    assert main(["export", "check", str(other / "tiny_mlp.onnx")]) == 1
    assert "FAILED: max abs diff 0.001" in capsys.readouterr().out


def test_an_inference_pte_without_its_weights_or_a_broken_file_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "model.pte").write_bytes(pte_export("tiny_mlp"))
    assert main(["export", "check", str(tmp_path / "model.pte")]) == 2
    assert "cannot be read back; pass the weights" in capsys.readouterr().err
    (tmp_path / "broken.pte").write_bytes(b"\0" * 16)
    assert main(["export", "check", str(tmp_path / "broken.pte")]) == 2
    assert "ExecuTorch cannot load" in capsys.readouterr().err
