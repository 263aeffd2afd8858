"""Whole runs over real brokers with real client processes: same model as in-process, faults, $SYS byte counters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mqtt_support import embedded_url, mosquitto_url  # noqa: F401 - pytest fixtures
from safetensors.torch import load_file

from edge_client.client import EdgeClient
from fedge.accounting.ledger import read_ledger_csv
from fedge.algorithms.dsfl import DSFLSettings
from fedge.config import RunConfig, TrainConfig
from fedge.learning.backend import TorchBackend
from fedge_cli.main import main
from fedge_io.experiment import prepare
from sim.laptop import client_processes, run_over_mqtt
from sim.run import run_inprocess

pytestmark = pytest.mark.broker

TINY = {"dataset": "digits", "model": "tiny_mlp", "num_clients": 3, "rounds": 2, "train": TrainConfig(local_epochs=1)}


def tensor_ledger(run_dir: Path) -> list[tuple[int, str, str, str, int, int]]:
    """The ledger at tensor level, in a transport-independent order."""
    rows = [
        (e.round, e.direction, e.client, e.kind, e.recipients, e.tensor_bytes)
        for e in read_ledger_csv(run_dir / "ledger.csv")
    ]
    return sorted(rows)


def assert_same_run(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "global_model.safetensors"), load_file(b / "global_model.safetensors")
    assert wa.keys() == wb.keys()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-6
    assert tensor_ledger(a) == tensor_ledger(b)
    per_round = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines()]
    over_mqtt = [json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines()]
    for key in ("tensor_bytes_multicast", "tensor_bytes_unicast", "cum_tensor_bytes_multicast", "accuracy"):
        assert [r[key] for r in per_round] == [r[key] for r in over_mqtt], key


def test_fedntd_over_mosquitto_gives_the_in_process_model_and_bytes(tmp_path: Path, mosquitto_url: str) -> None:  # noqa: F811
    config = RunConfig(algorithm="fedntd", **TINY)  # type: ignore[arg-type]
    run_inprocess(config, tmp_path / "inprocess")
    result = run_over_mqtt(config, tmp_path / "mqtt", broker=mosquitto_url, round_timeout=60)
    assert_same_run(tmp_path / "inprocess", tmp_path / "mqtt")
    # Wire bytes: every round has them, and the broker's own counters agree within a few percent.
    assert all(r.bytes.wire > r.bytes.payload["unicast"] for r in result.rounds)
    bb = result.summary["broker_bytes"]
    assert abs(bb["diff_pct"]) < 3.0, bb
    assert result.summary["transport"] == "mqtt" and result.summary["dropped"] == []
    assert result.summary["rejected"] == 0 and result.summary["rejected_by_reason"] == {}
    assert sorted(result.summary["clients"]) == ["c000", "c001", "c002"] and result.summary["refused"] == {}
    # Every reply's round trip and the client's own compute time were measured.
    assert all(len(r.timings) == 3 and all(t.compute_s > 0 for t in r.timings) for r in result.rounds)


def test_dsfl_over_the_embedded_broker_gives_the_in_process_model(tmp_path: Path) -> None:
    algo = DSFLSettings(open_per_round=50, distill_epochs=1)
    config = RunConfig(algorithm="dsfl", algo=algo, open_size=200, **TINY)  # type: ignore[arg-type]
    run_inprocess(config, tmp_path / "inprocess")
    result = run_over_mqtt(config, tmp_path / "mqtt", broker=None, round_timeout=60)  # embedded amqtt
    assert_same_run(tmp_path / "inprocess", tmp_path / "mqtt")
    assert result.summary["initial_tensor_bytes"]["multicast"] == 200 * 64 * 4  # ComU@I still counted


def test_a_client_killed_mid_round_is_dropped_and_reported(tmp_path: Path, mosquitto_url: str) -> None:  # noqa: F811
    """Through the CLI: `fedge coordinator` with three `fedge client` processes, one of which dies in round 2."""
    data = tmp_path / "data"
    config_flags = ["--algorithm", "fedavg", "--dataset", "digits", "--model", "tiny_mlp", "--num-clients", "3"]
    assert main(["provision", "--out", str(data), *config_flags, "--rounds", "3", "--local-epochs", "1"]) == 0
    files = {p.stem: p for p in data.glob("c*.safetensors")}
    assert sorted(files) == ["c000", "c001", "c002"]
    with client_processes(files, mosquitto_url, "faults", log_dir=tmp_path / "logs", faults={"c001": 2}) as procs:
        code = main(
            [
                *("coordinator", "--broker", mosquitto_url, "--run", "faults", "--out", str(tmp_path / "runs")),
                *("--config", str(data / "config.json"), "--min-replies", "0.5", "--round-timeout", "60"),
                *("--rejoin-grace", "1", "--broker-counters", "off"),
            ]
        )
        assert code == 0
        assert procs["c001"].wait(10) == 70  # the fault injection's exit code: it really died mid-task
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dropped"] == [{"round": 2, "client": "c001"}]
    (drop,) = summary["drops"]
    assert drop["client"] == "c001" and drop["round"] == 2 and drop["reason"].startswith("went offline")
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["aggregated"] for r in rounds] == [True, True, True]
    assert rounds[2]["sampled"] == ["c000", "c002"]  # gone clients are not sampled again
    report = (run_dir / "report.md").read_text()
    assert "c001" in report


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_a_client_step_on_cuda_matches_cpu() -> None:
    config = RunConfig(algorithm="fedntd", **TINY)  # type: ignore[arg-type]
    exp = prepare(config)
    plan = exp.strategy("cuda").configure(1, ["c000"])
    updates = {}
    for device in ("cpu", "cuda"):
        backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes, device=device)
        updates[device] = EdgeClient("c000", exp.client_data("c000"), backend).handle(
            plan.tasks["c000"], plan.broadcast
        )
    for name, value in updates["cpu"].tensors.items():
        assert torch.allclose(value, updates["cuda"].tensors[name].cpu(), atol=1e-4), name


@pytest.mark.parametrize("algorithm", ["fedprox", "scaffold"])
def test_fedprox_and_scaffold_over_the_secured_embedded_broker_give_the_in_process_model(
    algorithm: str, tmp_path: Path
) -> None:
    """FedProx's proximal term and SCAFFOLD's control variates (kept by each client process across rounds) over MQTT."""
    config = RunConfig(algorithm=algorithm, **{**TINY, "rounds": 3})  # type: ignore[arg-type]
    run_inprocess(config, tmp_path / "inprocess")
    result = run_over_mqtt(config, tmp_path / "mqtt", broker=None, round_timeout=60)
    assert_same_run(tmp_path / "inprocess", tmp_path / "mqtt")
    assert result.summary["rejected"] == 0
