"""Compressed runs over a real broker with real client processes: the in-process model, bytes and $SYS agreement."""

from __future__ import annotations

from pathlib import Path

import pytest
from mqtt_support import mosquitto_url  # noqa: F401 - pytest fixture
from safetensors.torch import load_file

from fedge.accounting.ledger import read_ledger_csv
from fedge.algorithms.dsfl import DSFLSettings
from fedge.config import RunConfig, TrainConfig
from sim.laptop import run_over_mqtt
from sim.run import run_inprocess

pytestmark = pytest.mark.broker

TINY = {"dataset": "digits", "model": "tiny_mlp", "num_clients": 3, "rounds": 2, "train": TrainConfig(local_epochs=1)}


def assert_same_run(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "global_model.safetensors"), load_file(b / "global_model.safetensors")
    assert wa.keys() == wb.keys()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-6
    ledgers = [
        sorted((e.round, e.direction, e.client, e.kind, e.tensor_bytes) for e in read_ledger_csv(d / "ledger.csv"))
        for d in (a, b)
    ]
    assert ledgers[0] == ledgers[1]


@pytest.mark.parametrize(
    ("algorithm", "upload", "broadcast"),
    [("fedavg", "topk:density=0.2", "float16"), ("dsfl", "int8:row,offset", "topk:k=3")],
)
def test_a_compressed_run_over_mosquitto_gives_the_in_process_model(
    tmp_path: Path,
    mosquitto_url: str,  # noqa: F811
    algorithm: str,
    upload: str,
    broadcast: str,
) -> None:
    extra = {"algo": DSFLSettings(open_per_round=50, distill_epochs=1), "open_size": 200} if algorithm == "dsfl" else {}
    config = RunConfig(
        algorithm=algorithm,
        upload_codec=upload,
        broadcast_codec=broadcast,
        **TINY,  # type: ignore[arg-type]
        **extra,  # type: ignore[arg-type]
    )
    run_inprocess(config, tmp_path / "inprocess")
    result = run_over_mqtt(config, tmp_path / "mqtt", broker=mosquitto_url, round_timeout=60)
    # Same model and same (compressed) tensor bytes: the client processes decoded, trained, kept their error
    # feedback and encoded exactly as in-process clients do.
    assert_same_run(tmp_path / "inprocess", tmp_path / "mqtt")
    assert result.summary["rejected"] == 0 and result.summary["dropped"] == []
    assert abs(result.summary["broker_bytes"]["diff_pct"]) < 3.0, result.summary["broker_bytes"]
    up = [e for e in read_ledger_csv(tmp_path / "mqtt" / "ledger.csv") if e.direction == "up"]
    assert up and all(e.uncompressed_bytes > 1.5 * e.tensor_bytes for e in up)  # what really travelled is smaller
