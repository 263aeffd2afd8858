"""Mixed fleets: PyTorch, ExecuTorch and ONNX Runtime clients in one run, in process and over a broker."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from export_support import program_cache
from safetensors.torch import load_file

from edge_client.backends import make_backend
from edge_client.backends.cache_dir import CACHE_ENV
from export.cache import ExportingSource, onnx_model
from fedge.algorithms.dsfl import DSFLSettings
from fedge.config import RunConfig, TrainConfig
from fedge.learning.backend import Backend
from fedge.programs.spec import ModelSpec
from fedge.types import ClientId
from fedge_io.experiment import prepare
from sim.laptop import run_over_mqtt
from sim.run import run_inprocess

FLEET = {"dataset": "digits", "model": "tiny_mlp", "num_clients": 4, "rounds": 2, "train": TrainConfig(local_epochs=1)}
DSFL = {"algo": DSFLSettings(open_per_round=50, distill_epochs=1, distill_batch_size=50), "open_size": 200}


def fleet(config: RunConfig, runtimes: dict[ClientId, str]) -> Callable[[ClientId], Backend]:
    """One backend per runtime, shared by the clients that use it (as run_inprocess shares its PyTorch backend)."""
    exp = prepare(config)
    backends: dict[str, Backend] = {}
    spec = ModelSpec(exp.model, exp.input_shape, exp.num_classes)
    for runtime in {"torch", *runtimes.values()}:
        name = runtime.removesuffix("-predict")
        backends[runtime] = make_backend(
            name,
            exp.model,
            exp.input_shape,
            exp.num_classes,
            programs=ExportingSource(program_cache()),
            onnx_model=onnx_model(spec, cache_dir=program_cache()) if name == "onnxruntime" else None,
            predict_only=runtime.endswith("-predict"),
        )
    return lambda c: backends[runtimes.get(c, "torch")]


def max_weight_diff(a: Path, b: Path) -> float:
    wa, wb = load_file(a / "global_model.safetensors"), load_file(b / "global_model.safetensors")
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


@pytest.mark.parametrize(
    "config",
    [RunConfig(algorithm="fedntd", **FLEET), RunConfig(algorithm="dsfl", **DSFL, **FLEET)],  # type: ignore[arg-type]
    ids=["fedntd", "dsfl"],
)
def test_a_fleet_of_pytorch_and_executorch_clients_computes_what_an_all_pytorch_fleet_computes(
    config: RunConfig, tmp_path: Path
) -> None:
    runtimes = {"c001": "executorch", "c003": "executorch"}  # c000 and c002 stay on PyTorch
    mixed = run_inprocess(config, tmp_path / "mixed", backend_for=fleet(config, runtimes))
    pure = run_inprocess(config, tmp_path / "torch")
    assert all(r.replied == ("c000", "c001", "c002", "c003") for r in mixed.rounds)
    # ExecuTorch clients train to within float round-off of PyTorch ones, so the global models agree.
    assert max_weight_diff(tmp_path / "mixed", tmp_path / "torch") < 1e-5
    assert [r.accuracy for r in mixed.rounds] == pytest.approx([r.accuracy for r in pure.rounds], abs=0.01)


def test_onnxruntime_clients_drop_out_of_training_rounds_and_serve_dsfl_predict_only(tmp_path: Path) -> None:
    fedntd = RunConfig(algorithm="fedntd", min_replies=0.5, **{**FLEET, "rounds": 1})  # type: ignore[arg-type]
    result = run_inprocess(fedntd, tmp_path / "fedntd", backend_for=fleet(fedntd, {"c002": "onnxruntime"}))
    (record,) = result.rounds
    assert record.dropped == ("c002",) and record.aggregated
    assert record.rejections[0].category == "client failed" and "cannot train" in record.rejections[0].detail

    dsfl = RunConfig(algorithm="dsfl", **DSFL, **FLEET)  # type: ignore[arg-type]
    runtimes = {"c001": "executorch", "c002": "onnxruntime-predict"}
    result = run_inprocess(dsfl, tmp_path / "dsfl", backend_for=fleet(dsfl, runtimes))
    assert all(r.replied == ("c000", "c001", "c002", "c003") for r in result.rounds)


@pytest.mark.broker
@pytest.mark.parametrize(
    "config",
    [RunConfig(algorithm="fedntd", **FLEET), RunConfig(algorithm="dsfl", **DSFL, **FLEET)],  # type: ignore[arg-type]
    ids=["fedntd", "dsfl"],
)
def test_a_mixed_fleet_of_client_processes_over_the_broker_computes_the_all_pytorch_model(
    config: RunConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fedge client --runtime executorch` processes next to `--runtime torch` ones, over the embedded broker."""
    monkeypatch.setenv(CACHE_ENV, str(program_cache()))  # the client processes share the session's programs
    runtimes = {"c001": "executorch", "c003": "executorch"}
    result = run_over_mqtt(config, tmp_path / "mqtt", broker=None, round_timeout=120, client_runtimes=runtimes)
    run_inprocess(config, tmp_path / "torch")
    assert all(r.replied == ("c000", "c001", "c002", "c003") for r in result.rounds)
    assert max_weight_diff(tmp_path / "mqtt", tmp_path / "torch") < 1e-5
    logs = {c: (tmp_path / "mqtt" / "logs" / f"{c}.log").read_text() for c in ("c000", "c001")}
    assert "(executorch runtime)" in logs["c001"] and "(torch runtime)" in logs["c000"]
    # Every program the run needed was made (or loaded) from the run's config before the hello, none in a round.
    expected = {"fedntd": 1, "dsfl": 2}[config.algorithm]  # FedNTD's loss; DS-FL's local CE and distillation
    assert f"prepared {expected} training program(s) for {config.algorithm}" in logs["c001"]
    assert "now, in a round" not in logs["c001"]
