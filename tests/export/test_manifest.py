"""Export manifests: every exported file is checked against its SHA-256 before a runtime sees a byte.

The device-side checks run in a subprocess whose exit code is asserted: a damaged ``.pte`` used to abort (134) or
crash (139) the process that loaded it, and a damaged ``.onnx`` served wrong logits without a word.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fedge.algorithms.catalog import make_objective
from fedge.config import RunConfig, TrainConfig
from fedge.errors import ConfigError
from fedge.programs.spec import ModelSpec, TrainingLoss, program_file_name
from fedge_cli.main import main
from fedge_io import manifest
from fedge_io.experiment import prepare
from sim.provision import write_client_files

FEDGE = [sys.executable, "-m", "fedge_cli.main"]
MODEL = ["--model", "tiny_mlp", "--input-shape", "1,8,8"]


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_file_is_read_only_if_it_matches_the_manifest_beside_it(tmp_path: Path) -> None:
    manifest.write_file(tmp_path, "a.bin", b"program bytes", "pte")
    assert manifest.verified_read(tmp_path / "a.bin") == b"program bytes"
    doc = json.loads((tmp_path / manifest.MANIFEST_FILE).read_text())
    assert doc["format"] == manifest.FORMAT and doc["files"]["a.bin"]["bytes"] == len(b"program bytes")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", manifest.MANIFEST_FILE]  # no lock file left

    flip(tmp_path / "a.bin", 3)
    with pytest.raises(manifest.ManifestError, match=r"a\.bin: SHA-256 does not match .*altered or damaged"):
        manifest.verified_read(tmp_path / "a.bin")
    (tmp_path / "b.bin").write_bytes(b"foreign")
    with pytest.raises(manifest.ManifestError, match="not listed in"):
        manifest.verified_read(tmp_path / "b.bin")
    with pytest.raises(manifest.ManifestError, match="not listed in"):  # listed or nothing, even when not required
        manifest.verified_read(tmp_path / "b.bin", required=False)

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "c.bin").write_bytes(b"no manifest")
    with pytest.raises(manifest.ManifestError, match=r"no manifest\.json beside it.*--unverified-programs"):
        manifest.verified_read(bare / "c.bin")
    assert manifest.verified_read(bare / "c.bin", required=False) == b"no manifest"


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        json.dumps({"format": "other/1", "files": {}}),
        json.dumps({"format": manifest.FORMAT, "files": {"../x": {"sha256": "0" * 64, "bytes": 1, "kind": "pte"}}}),
        json.dumps({"format": manifest.FORMAT, "files": {"x": {"sha256": "zz", "bytes": 1, "kind": "pte"}}}),
        json.dumps({"format": manifest.FORMAT, "files": {"x": {"sha256": "0" * 64, "bytes": -1, "kind": "pte"}}}),
        json.dumps({"format": manifest.FORMAT, "files": {"x": {"sha256": "0" * 64, "bytes": True, "kind": "pte"}}}),
        " " * (manifest.MAX_MANIFEST_BYTES + 1),
    ],
    ids=["not-json", "other-format", "path-name", "bad-digest", "negative-size", "bool-size", "oversize"],
)
def test_a_malformed_manifest_is_one_clear_error(tmp_path: Path, text: str) -> None:
    (tmp_path / manifest.MANIFEST_FILE).write_text(text)
    (tmp_path / "x").write_bytes(b"x")
    with pytest.raises(manifest.ManifestError, match=r"manifest|larger than"):
        manifest.verified_read(tmp_path / "x")


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("exports")
    args = ["export", *MODEL, "--format", "onnx", "pte", "pte-train", "--objective", "ce", "ntd", "--max-batch", "64"]
    assert main([*args, "--out", str(out)]) == 0
    return out


def test_a_second_export_adds_files_with_the_same_weights_and_refuses_other_weights(
    exports: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "exports"
    shutil.copytree(exports, out)
    (out / "tiny_mlp.onnx").unlink()
    assert main(["export", *MODEL, "--format", "onnx", "--out", str(out)]) == 0  # the same (seed 0) weights: added
    listed = manifest.read_manifest(out)
    assert listed is not None and sorted(listed) == sorted(p.name for p in out.iterdir() if p.name != "manifest.json")
    before = (out / "weights.safetensors").read_bytes()
    assert main(["export", *MODEL, "--seed", "4", "--format", "onnx", "--out", str(out)]) == 2
    assert "already holds exports of other weights" in capsys.readouterr().err
    assert (out / "weights.safetensors").read_bytes() == before  # nothing in the directory was touched
    assert main(["export", "check", str(out / "tiny_mlp.onnx")]) == 0


def run_device_side(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """A fedge command in its own process: a crash there is an exit code here, not a dead test run."""
    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    return subprocess.run([*FEDGE, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def test_fedge_export_check_refuses_flipped_bytes_at_several_offsets_with_one_line(
    exports: Path, tmp_path: Path
) -> None:
    """Every kind of file, damaged at four offsets, checked by one `fedge export check` process: a damaged file that
    reached a runtime would abort or crash it (no exit status 1, lines missing)."""
    damaged_files = []
    for name in ("tiny_mlp.pte", "tiny_mlp-1x8x8-c10-ce-b64-v3.pte", "tiny_mlp.onnx"):
        size = (exports / name).stat().st_size
        for offset in (8, size // 3, size // 2, size - 9):
            damaged = tmp_path / f"{name}-at-{offset}"
            damaged.mkdir()
            for f in (name, "weights.safetensors", manifest.MANIFEST_FILE):
                (damaged / f).write_bytes((exports / f).read_bytes())
            flip(damaged / name, offset)
            damaged_files.append(str(damaged / name))
    done = run_device_side(["export", "check", *damaged_files], tmp_path)
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert done.stdout.count("SHA-256 does not match") == len(damaged_files) == 12, done.stdout[-2000:]
    assert "Traceback" not in done.stderr


def client_files(tmp_path: Path) -> tuple[Path, Path]:
    """The run config and a data file of a FedAvg digits client on tiny_mlp (what a device is given)."""
    config = RunConfig(
        algorithm="fedavg",
        dataset="digits",
        model="tiny_mlp",
        num_clients=2,
        rounds=1,
        train=TrainConfig(batch_size=50),
    )
    files = write_client_files(prepare(config), tmp_path / "data")
    (tmp_path / "config.json").write_text(config.to_json() + "\n")
    return tmp_path / "config.json", files["c000"]


def test_a_client_never_loads_a_damaged_program_or_model_file(exports: Path, tmp_path: Path) -> None:
    config, data = client_files(tmp_path)
    spec = ModelSpec("tiny_mlp", (1, 8, 8), 10)
    program = program_file_name(spec, TrainingLoss(make_objective("ce", {})), 64)
    damaged = tmp_path / "programs"
    damaged.mkdir()
    for f in (program, "tiny_mlp.onnx", manifest.MANIFEST_FILE):
        (damaged / f).write_bytes((exports / f).read_bytes())
    flip(damaged / program, 1000)
    flip(damaged / "tiny_mlp.onnx", (damaged / "tiny_mlp.onnx").stat().st_size // 2)
    # No broker listens on port 1: a client that got past its programs fails to connect, after a second.
    base = ["client", "--client-id", "c000", "--data", str(data), "--run-config", str(config), "--run", "r"]
    base += ["--broker", "mqtt://127.0.0.1:1", "--connect-timeout", "1"]

    # A deployed .onnx is the user's file: refused at start-up with the reason, exit 2, before any connection. (No
    # --run-config: a predict-only client given a training run's config stops at once, exit 3, as it cannot train.)
    predict = [a for a in base if a not in ("--run-config", str(config))]
    done = run_device_side(
        [*predict, "--runtime", "onnxruntime", "--predict-only", "--model-file", str(damaged / "tiny_mlp.onnx")],
        tmp_path,
    )
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "tiny_mlp.onnx: SHA-256 does not match" in done.stderr and "Traceback" not in done.stderr
    assert "cannot reach" not in done.stderr.lower()

    # A damaged program in the program directory is never loaded: the workstation client makes it again (and checks
    # it) instead, then goes on to the broker; the file is whole again afterwards.
    done = run_device_side([*base, "--runtime", "executorch", "--program-cache", str(damaged)], tmp_path)
    assert done.returncode not in (-6, -11, 134, 139) and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"{program}: SHA-256 does not match" in done.stderr and "making it again" in done.stderr
    assert "prepared 1 training program(s)" in done.stderr
    assert manifest.verified_read(damaged / program) == (exports / program).read_bytes()


def test_a_program_without_a_manifest_needs_the_unverified_flag(exports: Path, tmp_path: Path) -> None:
    from edge_client.backends.executorch import ProgramDirectory

    spec = ModelSpec("tiny_mlp", (1, 8, 8), 10)
    loss = TrainingLoss(make_objective("ce", {}))
    name = program_file_name(spec, loss, 64)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / name).write_bytes((exports / name).read_bytes())
    with pytest.raises(manifest.ManifestError, match=r"no manifest\.json"):
        ProgramDirectory(bare).program(spec, loss, 64)
    assert ProgramDirectory(bare, unverified=True).program(spec, loss, 64) == (exports / name).read_bytes()


def test_the_program_cache_makes_a_damaged_program_again_instead_of_loading_it(tmp_path: Path) -> None:
    from export.cache import cached_program

    made: list[int] = []

    def make() -> bytes:
        made.append(1)
        return b"fresh program"

    path = tmp_path / "p.pte"
    assert cached_program(path, make, None) == b"fresh program" and len(made) == 1
    assert cached_program(path, make, None) == b"fresh program" and len(made) == 1  # verified, reused
    flip(path, 2)
    assert cached_program(path, make, None) == b"fresh program" and len(made) == 2  # damaged: made again
    assert manifest.verified_read(path) == b"fresh program"


def test_a_program_under_another_programs_name_is_refused_when_loaded(exports: Path, tmp_path: Path) -> None:
    from edge_client.backends.executorch import ExecuTorchBackend, ProgramDirectory

    spec = ModelSpec("tiny_mlp", (1, 8, 8), 10)
    ce, ntd = (TrainingLoss(make_objective(k, {})) for k in ("ce", "ntd"))
    # The FedNTD program copied under the CE program's name, and recorded so: its digest is fine, its loss is not.
    manifest.write_file(
        tmp_path,
        program_file_name(spec, ce, 64),
        (exports / program_file_name(spec, ntd, 64)).read_bytes(),
        "pte-train",
    )
    backend = ExecuTorchBackend("tiny_mlp", (1, 8, 8), 10, programs=ProgramDirectory(tmp_path))
    with pytest.raises(ConfigError, match=r"is a program of tiny_mlp .*ntd-tau1-beta1.*renamed or copied"):
        backend.prepare([ce], 50)
