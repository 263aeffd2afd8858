"""ONNX Runtime training (``.venv-ort-training``, ``make ort-training``) trains like eager
``fedge.learning.training.train``.

The ORT side runs in that environment (``ort_training_worker.py``); the eager reference is computed here, in this
environment, from the very tensors the worker used: free-running steps with momentum 0.9 and weight decay 1e-5 on
real-looking data, batch-norm statistics included.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from edge_client.backends.ort_training import RUNTIME, ArtifactDirectory, artifact_dir_name
from export.gates.drift import drift_parity
from fedge.algorithms.catalog import make_objective, terms_from_flags
from fedge.errors import ConfigError
from fedge.learning.models import exchanged_state, load_exchanged_state
from fedge.learning.terms import TermCall
from fedge.learning.training import SGDSettings, TrainRequest, train
from fedge.programs.spec import ModelSpec, TrainingLoss, program_file_name

ROOT = Path(__file__).resolve().parents[2]
ORT_PYTHON = ROOT / ".venv-ort-training" / "bin" / "python"
WORKER = Path(__file__).with_name("ort_training_worker.py")
SGD = SGDSettings(lr=0.01, momentum=0.9, weight_decay=1e-5)  # export.gates.inputs.DRIFT_SGD, what the worker runs

needs_ort_env = pytest.mark.skipif(
    not ORT_PYTHON.exists(), reason=f"{ORT_PYTHON} is absent: install it with `make ort-training`"
)

# FedNTD, 8 free-running steps of 50 through the parity-gated cache (the gate's own steps and batch), on the CNN of
# FedNTD, a small MLP and the DS-FL CNN with batch norm.
FEDNTD: list[dict[str, Any]] = [
    {"id": "fedntd-fedavg_cnn", "model": "fedavg_cnn", "input_shape": [1, 28, 28], "batch": 50, "steps": 8},
    {"id": "fedntd-tiny_mlp", "model": "tiny_mlp", "input_shape": [1, 8, 8], "batch": 50, "steps": 8},
    {"id": "fedntd-dsfl_mnist_cnn", "model": "dsfl_mnist_cnn", "input_shape": [1, 28, 28], "batch": 50, "steps": 8},
]
FEDNTD = [{**c, "objective": "ntd", "params": {"tau": "2.0", "beta": "1.0"}, "gate": True} for c in FEDNTD]
# Every other loss of the training programs on the batch-norm CNN: 5 steps of 20.
BN_CNN: dict[str, Any] = {"model": "dsfl_mnist_cnn", "input_shape": [1, 28, 28], "batch": 20, "steps": 5}
LOSSES: list[dict[str, Any]] = [
    {**BN_CNN, "id": "ce-scaffold", "objective": "ce", "terms": ["correction"]},
    {**BN_CNN, "id": "fedprox", "objective": "ce", "terms": ["prox:mu=0.1"]},
    {**BN_CNN, "id": "fedcurv", "objective": "ce", "terms": ["fisher_prox:mu=0.4"]},
    # MOON: the two reference models' eval-mode representations (batch norm on their own statistics) in the graph
    {**BN_CNN, "id": "moon", "objective": "ce", "terms": ["moon:mu=0.5,tau=0.5"]},
    {**BN_CNN, "id": "lsd", "objective": "lsd", "params": {"tau": "2.0"}},
    {**BN_CNN, "id": "soft", "objective": "soft"},
    {**BN_CNN, "id": "fd", "objective": "fd", "params": {"gamma": "0.5"}},
]


PERTURBED = {
    "id": "perturbed",
    "model": "dsfl_mnist_cnn",
    "input_shape": [1, 28, 28],
    "objective": "ntd",
    "perturbed": True,
}


@pytest.fixture(scope="module")
def ort_results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, dict[str, Any]]]]:
    """One worker process for every case (starting that environment's torch and ORT costs seconds)."""
    out = tmp_path_factory.mktemp("ort-training")
    cases = out / "cases.json"
    cases.write_text(json.dumps([*FEDNTD, *LOSSES, PERTURBED]))
    done = subprocess.run(
        [str(ORT_PYTHON), str(WORKER), str(cases), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    yield out, {r["id"]: r for r in results}


def scaled_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest ``|a - b| / max(1, |b|)`` (export.gates.report's measure) and where."""
    return max((float(((a[k] - b[k]).abs() / b[k].abs().clamp(min=1.0)).max()), k) for k in b)


def group(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def rebuilt_request(case: dict[str, Any], batch_seed: int, tensors: dict[str, torch.Tensor]) -> TrainRequest:
    """The request the worker trained with, from the tensors it saved."""
    calls = []
    for term in terms_from_flags(case.get("terms", ())):
        own = {n: group(tensors, f"term.{term.kind}.{n}.") for n in term.tensors}
        refs = {n: group(tensors, f"reference.{term.kind}.{n}.") for n in term.references}
        calls.append(TermCall(term, own, refs))
    return TrainRequest(
        tensors["x"],
        tensors["y"],
        make_objective(case["objective"], case.get("params", {})),
        SGD,
        epochs=1,
        batch_size=case["batch"],
        seed=batch_seed,
        inputs=group(tensors, "input."),
        terms=tuple(calls),
    )


@needs_ort_env
@pytest.mark.parametrize("case", FEDNTD + LOSSES, ids=[c["id"] for c in FEDNTD + LOSSES])
def test_onnxruntime_training_matches_eager_momentum_sgd(
    case: dict[str, Any], ort_results: tuple[Path, dict[str, dict[str, Any]]]
) -> None:
    """Weights and BN statistics after free-running steps against eager float64 computed here, within the parity
    gate's float tolerance (10x eager float32's own distance, :func:`export.gates.drift.drift_parity`), on the standard
    samples or else on both retry samples, as the gate accepts: a ReLU or max-pool input within round-off of its kink
    parts two correct float32 runs by chance (see :func:`export.ort_training.check.check_artifacts`)."""
    out, results = ort_results
    result = results[case["id"]]
    spec = ModelSpec(case["model"], tuple(case["input_shape"]), 10)
    reports = []
    for run in result["runs"]:
        tensors = load_file(str(out / f"{case['id']}-{run['data_seed']}.safetensors"))
        got = group(tensors, "got.")
        start = group(tensors, "start.")
        assert run["steps"] == case["steps"]
        request = rebuilt_request(case, run["batch_seed"], tensors)
        model = spec.build(seed=0)
        load_exchanged_state(model, start)
        train(model, request)
        expected = exchanged_state(model)
        assert got.keys() == expected.keys()
        assert scaled_diff(expected, start)[0] > 1e-3  # the weights really trained
        if any(k.endswith("running_var") for k in got):  # and the BN statistics moved as eager's did
            assert max(float((expected[k] - start[k]).abs().max()) for k in got if "running" in k) > 1e-3

        def ort_weights(_: TrainRequest, weights: dict[str, torch.Tensor] = got) -> dict[str, torch.Tensor]:
            return weights  # what ORT trained, in the other environment

        reports.append(drift_parity(ort_weights, spec, start, request, source=case["id"], runtime=RUNTIME))
        # Eval-mode logits of the trained weights (BN on the running statistics) through the artifacts' eval model.
        model.eval()
        load_exchanged_state(model, got)
        with torch.no_grad():
            logits = model(tensors["x_eval"])
        assert float((tensors["logits"] - logits).abs().max()) < 1e-5
    first, *retries = reports
    assert first.passed or all(r.passed for r in retries), "; ".join(map(str, reports))
    if case.get("gate"):  # the parity gate of the cache (in that environment) passed too
        assert len(result["gate"]) >= 2 and all(" ok:" in line for line in result["gate"]), result["gate"]


@needs_ort_env
def test_the_gate_refuses_artifacts_whose_batch_norm_statistics_drift(
    ort_results: tuple[Path, dict[str, dict[str, Any]]],
) -> None:
    """BN momentum 0.12 instead of 0.1: logits at the same weights still agree, the running statistics do not, on the
    standard samples and on both retries."""
    result = ort_results[1]["perturbed"]
    # logits, then the stepwise check and every drift run
    assert result["passed"] == [True, False, False, False, False], result["gate"]
    assert all("running_" in line for line in result["gate"][1:]), result["gate"]


@needs_ort_env
def test_damaged_artifacts_are_refused_before_onnx_runtime_opens_them(
    ort_results: tuple[Path, dict[str, dict[str, Any]]], tmp_path: Path
) -> None:
    """A flipped byte in each file of a gated set, at its first byte or its middle (alternating over the files, one
    device-side process each: an ORT environment's start costs seconds): a one-line error from that process (exit
    1), never a crash, never weights that load."""
    from edge_client.backends.ort_training import ARTIFACT_FILES
    from fedge_io import manifest

    (made,) = [d for d in (ort_results[0] / "cache").iterdir() if d.name.startswith("tiny_mlp-")]
    for i, name in enumerate(ARTIFACT_FILES):
        size = (made / name).stat().st_size
        offset = 0 if i % 2 == 0 else size // 2
        damaged = tmp_path / f"{name}-{offset}" / made.name
        shutil.copytree(made, damaged)
        data = bytearray((damaged / name).read_bytes())
        data[offset] ^= 0x01
        (damaged / name).write_bytes(bytes(data))
        check = ["check", "--model", "tiny_mlp", "--input-shape", "1,8,8", "--objective", "ntd", "--tau", "2"]
        done = subprocess.run(
            [str(ORT_PYTHON), "-m", "export.ort_training", *check, "--out", str(damaged.parent)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 1, (name, offset, done.returncode, done.stderr[-2000:])
        assert f"{name}: SHA-256 does not match" in done.stderr and "Traceback" not in done.stderr
    assert manifest.read_manifest(made) is not None


def test_artifacts_are_named_by_the_training_program_scheme() -> None:
    spec = ModelSpec("fedavg_cnn", (1, 28, 28), 10)
    loss = TrainingLoss(make_objective("ntd", {"tau": "2.0"}))
    name = artifact_dir_name(spec, loss)
    assert name.startswith("fedavg_cnn-1x28x28-c10-ntd-tau2-beta1-b0-") and name.endswith(".ort-training")
    assert name.removesuffix(".ort-training") + ".pte" == program_file_name(spec, loss, 0)  # batch bound 0: unbounded


def test_missing_artifacts_say_how_to_make_them(tmp_path: Path) -> None:
    spec = ModelSpec("tiny_mlp", (1, 8, 8), 10)
    with pytest.raises(ConfigError, match=r"python -m export\.ort_training --model tiny_mlp"):
        ArtifactDirectory(tmp_path)(spec, TrainingLoss(make_objective("ce")))


def test_an_onnxruntime_training_client_offers_every_algorithm() -> None:
    from edge_client.cli import runtime_capabilities
    from fedge.registry import ALGORITHMS

    offered = runtime_capabilities("onnxruntime-training", False)
    assert offered == tuple(ALGORITHMS) and {"fedprox", "fedcurv", "moon"} <= set(offered)


def test_outside_its_environment_the_runtime_says_where_it_lives() -> None:
    from edge_client.backends import make_backend

    try:
        import onnxruntime.training.api  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="make ort-training"):
            make_backend("onnxruntime-training", "tiny_mlp", (1, 8, 8), 10)
    else:
        pytest.skip("onnxruntime-training is installed in this environment")
