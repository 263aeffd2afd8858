"""Secure aggregation of SCAFFOLD (two parts: the weights' mean, the control deltas' sum), DS-FL (soft labels; its
first round has no broadcast, so the round's parameters ride in the tasks) and FD (per-class output sums and holder
counts) over a real mosquitto, with real client processes that each build, clip and mask their own parts
(edge_client/secure.py): the model is the in-process secure run's to within what the devices' own stochastic rounding
(2^-26 per value here, from the OS, not the run's seed) carries through one more round of training, and every masked
value is in the ledger."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mqtt_support import mosquitto_url  # noqa: F401 - pytest fixture
from safetensors.torch import load_file

from fedge.accounting.ledger import read_ledger_csv
from fedge.algorithms.dsfl import DSFLSettings
from fedge.config import RunConfig, TrainConfig
from sim.laptop import run_over_mqtt
from sim.run import run_inprocess

pytestmark = pytest.mark.broker

TINY = {"dataset": "digits", "model": "tiny_mlp", "num_clients": 3, "rounds": 2, "train": TrainConfig(local_epochs=1)}


@pytest.mark.parametrize("algorithm", ["scaffold", "dsfl"])
def test_two_rounds_over_mosquitto_give_the_in_process_secure_model(
    algorithm: str,
    tmp_path: Path,
    mosquitto_url: str,  # noqa: F811
) -> None:
    extra: dict[str, object] = {}
    if algorithm == "dsfl":
        extra = {"algo": DSFLSettings(open_per_round=50, distill_epochs=1), "open_size": 200}
    config = RunConfig(algorithm=algorithm, secure_aggregation=True, **TINY, **extra)  # type: ignore[arg-type]
    run_inprocess(config, tmp_path / "inprocess")
    result = run_over_mqtt(config, tmp_path / "mqtt", broker=mosquitto_url, round_timeout=60)
    assert result.summary["dropped"] == [] and result.summary["rejected"] == 0
    a = load_file(tmp_path / "inprocess" / "global_model.safetensors")
    b = load_file(tmp_path / "mqtt" / "global_model.safetensors")
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    rows = [json.loads(line) for line in (tmp_path / "mqtt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["secagg_survivors"] for r in rows] == [3.0, 3.0]
    # Each client's masked upload is a frame of its own: 4 bytes for every value of its parts.
    masked = [e for e in read_ledger_csv(tmp_path / "mqtt" / "ledger.csv") if e.kind == "secagg.masked-input"]
    assert len(masked) == 2 * 3
    values = sum(t.numel() for k, t in a.items() if k.endswith(("weight", "bias")))  # SCAFFOLD: model + control
    expected = 4 * (50 * 10 if algorithm == "dsfl" else 2 * values)
    assert all(e.tensor_bytes == expected for e in masked), (expected, {e.tensor_bytes for e in masked})
    assert torch.isfinite(torch.cat([t.reshape(-1).float() for t in b.values()])).all()


def test_fd_over_mosquitto_sums_outputs_and_holds_as_in_process(
    tmp_path: Path,
    mosquitto_url: str,  # noqa: F811
) -> None:
    """FD (no global model; clients keep their own): each device masks its C x C outputs and its C holds; the round's
    accuracy (the clients' own test counts, pooled over the survivors) is the in-process secure run's, up to what the
    devices' own rounding moves a local model's predictions (none here), and every masked value is in the ledger."""
    config = RunConfig(algorithm="fd", secure_aggregation=True, **TINY)  # type: ignore[arg-type]
    run_inprocess(config, tmp_path / "inprocess")
    result = run_over_mqtt(config, tmp_path / "mqtt", broker=mosquitto_url, round_timeout=60)
    assert result.summary["dropped"] == [] and result.summary["rejected"] == 0
    rows = {}
    for side in ("inprocess", "mqtt"):
        rows[side] = [json.loads(line) for line in (tmp_path / side / "metrics.jsonl").read_text().splitlines()]
    assert [r["secagg_survivors"] for r in rows["mqtt"]] == [3.0, 3.0]
    assert [r["accuracy"] for r in rows["mqtt"]] == pytest.approx([r["accuracy"] for r in rows["inprocess"]], abs=0.01)
    masked = [e for e in read_ledger_csv(tmp_path / "mqtt" / "ledger.csv") if e.kind == "secagg.masked-input"]
    assert len(masked) == 2 * 3 and all(e.tensor_bytes == 4 * (10 * 10 + 10) for e in masked)  # outputs and holds
