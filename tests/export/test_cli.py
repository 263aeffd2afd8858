"""`fedge export` and `fedge export check`: export, gate on parity, print sizes; refuse what fails."""

from __future__ import annotations

import dataclasses
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from export_support import SPECS, loss_of, pte_export

from edge_client.backends.executorch import ProgramDirectory, batch_bound
from edge_client.backends.onnx_file import read_meta, replace_weights
from edge_client.backends.runners import PteRunner, PteTrainer
from export.cli import export_jobs
from fedge.algorithms.catalog import make_objective, objective_classes, objective_kinds
from fedge.algorithms.fedprox import Proximal
from fedge.algorithms.moon import ModelContrastive
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.learning.terms import LocalTerm, term_flag
from fedge.programs.planning import planned_trainings
from fedge.programs.spec import ModelSpec, TrainingLoss, program_file_name
from fedge.registry import ALGORITHMS
from fedge_cli.main import build_parser, main
from fedge_io.experiment import prepare


def test_export_writes_checked_files_and_check_accepts_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "exports"
    args = ["export", "--model", "tiny_mlp", "--input-shape", "1,8,8", "--seed", "3", "--out", str(out)]
    assert main([*args, "--format", "onnx", "pte", "pte-train", "--objective", "ce", "--max-batch", "16"]) == 0
    printed = capsys.readouterr().out
    files = sorted(p.name for p in out.iterdir())
    # The training program gets the one name clients look programs up by (fedge.programs.spec.program_file_name).
    assert files == [
        "manifest.json",  # the SHA-256 of every file, checked before a runtime loads one (fedge_io/manifest.py)
        "tiny_mlp-1x8x8-c10-ce-b16-v3.pte",
        "tiny_mlp.onnx",
        "tiny_mlp.pte",
        "weights.safetensors",
    ]
    assert "drift parity on executorch ok" in printed and "logits parity on onnxruntime ok" in printed
    assert f"{out / 'tiny_mlp.onnx'}" in printed and "bytes)" in printed  # sizes

    paths = [str(out / f) for f in files if f not in ("weights.safetensors", "manifest.json")]
    assert main(["export", "check", *paths]) == 0  # the .pte check reads weights.safetensors beside it
    assert capsys.readouterr().out.count(" ok: ") == 5  # onnx, pte, and the training program's logits, step, drift


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


def test_export_opset_round_trips_to_the_file_and_an_unsupported_opset_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import onnx

    out = tmp_path / "exports"
    args = ["export", "--model", "fedavg_cnn", "--input-shape", "1,8,8", "--format", "onnx", "--out", str(out)]
    assert main(args) == 0
    # The default: opset 17 / IR 8, what onnxruntime 1.12 and later load (JetPack 5/6's 1.16/1.17 refuse IR 10).
    proto = onnx.load(str(out / "fedavg_cnn.onnx"))
    assert proto.ir_version == 8 and [(o.domain, o.version) for o in proto.opset_import] == [("", 17)]
    assert main([*args, "--opset", "19"]) == 0
    proto = onnx.load(str(out / "fedavg_cnn.onnx"))
    assert proto.ir_version == 9 and [(o.domain, o.version) for o in proto.opset_import] == [("", 19)]
    assert read_meta((out / "fedavg_cnn.onnx").read_bytes()).extra["min_onnxruntime"] == "1.16"
    assert main(["export", "check", str(out / "fedavg_cnn.onnx")]) == 0
    assert "logits parity on onnxruntime ok" in capsys.readouterr().out
    assert main([*args, "--opset", "12", "--out", str(tmp_path / "none")]) == 2
    assert "opset 12 is not supported: choose one of 15-21" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()


def test_training_programs_by_default_cover_the_bounds_clients_look_up(tmp_path: Path) -> None:
    out = tmp_path / "exports"
    args = ["export", "--model", "tiny_mlp", "--input-shape", "1,8,8", "--format", "pte-train", "--objective", "ce"]
    assert main([*args, "--out", str(out)]) == 0
    spec = SPECS["tiny_mlp"]
    # Local training at batch 50 and DS-FL distillation at batch 100: the names the client looks up.
    wanted = {program_file_name(spec, loss_of("ce"), batch_bound(b)) for b in (50, 100)}
    assert wanted == {"tiny_mlp-1x8x8-c10-ce-b64-v3.pte", "tiny_mlp-1x8x8-c10-ce-b128-v3.pte"}
    assert wanted <= {p.name for p in out.iterdir()}
    for name in wanted:
        assert PteTrainer((out / name).read_bytes()).meta.max_batch == int(name.split("-b")[1].split("-")[0])


def _planned_names(algorithm: str) -> tuple[set[str], ModelSpec, set[tuple[LocalTerm, ...]]]:
    """The training programs a client of ``algorithm`` with every default looks up, found as the client finds them,
    and the sets of local terms baked into them."""
    exp = prepare(RunConfig(algorithm=algorithm, dataset="digits"))
    data = exp.client_data("c001", exp.open_x())
    spec = ModelSpec(exp.model, exp.input_shape, data.num_classes)
    plans = planned_trainings(exp.config, "c001", data, exp.model, exp.input_shape)
    names = {program_file_name(spec, p.loss, batch_bound(p.batch_size)) for p in plans}
    return names, spec, {p.loss.terms for p in plans}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_fedge_export_with_its_defaults_writes_the_programs_a_default_client_looks_up(algorithm: str) -> None:
    """For every algorithm: one export command per set of local terms (baked into the programs, the settings such an
    export must be given: FedProx's mu, MOON's mu and tau, ...)."""
    needed, spec, term_sets = _planned_names(algorithm)
    assert needed
    shape = ",".join(str(d) for d in spec.input_shape)
    made: set[str] = set()
    for terms in term_sets:
        argv = ["export", "--model", spec.name, "--input-shape", shape, "--format", "pte-train", "--objective"]
        argv += list(objective_kinds())
        for term in terms:
            argv += ["--term", term_flag(term)]
        _, jobs = export_jobs(build_parser().parse_args(argv))
        made |= {job.name for job in jobs}
    assert needed <= made


@pytest.mark.parametrize("kind", objective_kinds())
def test_the_command_a_client_prints_for_a_missing_program_writes_that_program(kind: str, tmp_path: Path) -> None:
    spec = ModelSpec("fedavg_cnn", (1, 8, 8), 10)  # not the paper's 1x28x28, which `fedge export` defaults to
    hyper = {"tau": "2.5", "beta": "0.3", "gamma": "0.7"}  # none of them the defaults
    fields = {f.name for f in dataclasses.fields(objective_classes()[kind])}
    terms = (Proximal(mu=0.01), ModelContrastive(mu=0.3, tau=0.7))  # every hyperparameter of a term in the command
    loss = TrainingLoss(make_objective(kind, {k: v for k, v in hyper.items() if k in fields}), terms)
    with pytest.raises(ConfigError, match="export it with") as caught:
        ProgramDirectory(tmp_path).program(spec, loss, 128)
    command = str(caught.value).split("`")[1]
    _, jobs = export_jobs(build_parser().parse_args(shlex.split(command)[1:]))
    assert [job.name for job in jobs] == [program_file_name(spec, loss, 128)]
    assert jobs[0].loss == loss and jobs[0].max_batch == 128


def test_an_xnnpack_inference_program_of_a_convolution_model_takes_the_batch_bound_it_was_asked_for(
    tmp_path: Path,
) -> None:
    from executorch.runtime import Runtime

    out = tmp_path / "exports"
    args = ["export", "--model", "fedavg_cnn", "--input-shape", "1,8,8", "--format", "pte", "--out", str(out)]
    assert main(args) == 0
    data = (out / "fedavg_cnn.pte").read_bytes()
    # The default bound is the largest training bound, 128; ExecuTorch 1.4.1 used to plan such programs for 15.
    assert PteRunner(data).meta.max_batch == 128
    x = SPECS["fedavg_cnn"].example(128, seed=2)
    method = Runtime.get().load_program(data).load_method("forward")
    (logits,) = method.execute([x])  # one call, no splitting
    with torch.no_grad():
        expected = SPECS["fedavg_cnn"].build(seed=0).eval()(x)
    assert float((logits - expected).abs().max()) < 1e-5
