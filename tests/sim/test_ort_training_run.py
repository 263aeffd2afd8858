"""FedNTD over real brokers with `fedge client --runtime onnxruntime-training` processes, which run in the separate
`.venv-ort-training` (``make ort-training``), make their parity-checked artifacts before the hello, and end with the
global model of the all-PyTorch run."""

from __future__ import annotations

from pathlib import Path

import pytest
from mqtt_support import mosquitto_url  # noqa: F401 - pytest fixture
from safetensors.torch import load_file

from edge_client.backends.cache_dir import CACHE_ENV
from fedge.config import RunConfig, TrainConfig
from fedge.learning.backend import TorchBackend
from fedge_io.experiment import prepare
from sim.laptop import run_over_mqtt
from sim.run import run_inprocess

ORT_PYTHON = Path(__file__).resolve().parents[2] / ".venv-ort-training" / "bin" / "python"

pytestmark = [
    pytest.mark.broker,
    pytest.mark.skipif(not ORT_PYTHON.exists(), reason=f"{ORT_PYTHON} is absent: install it with `make ort-training`"),
]


def fedntd(model: str) -> RunConfig:
    train = TrainConfig(local_epochs=1, momentum=0.9, weight_decay=1e-5)
    return RunConfig(algorithm="fedntd", dataset="digits", model=model, num_clients=3, rounds=2, train=train)


def max_weight_diff(a: Path, b: Path) -> float:
    wa, wb = load_file(a / "global_model.safetensors"), load_file(b / "global_model.safetensors")
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def run_with_ort_clients(
    config: RunConfig, run_dir: Path, broker: str | None, ort_clients: tuple[str, ...], cache: Path
) -> None:
    result = run_over_mqtt(
        config,
        run_dir,
        broker=broker,
        round_timeout=180,
        client_runtimes=dict.fromkeys(ort_clients, "onnxruntime-training"),
        client_pythons=dict.fromkeys(ort_clients, str(ORT_PYTHON)),
    )
    assert all(r.replied == ("c000", "c001", "c002") for r in result.rounds)
    for client in ort_clients:
        log = (run_dir / "logs" / f"{client}.log").read_text()
        assert "(onnxruntime-training runtime)" in log
        assert "prepared 1 training program(s) for fedntd" in log  # before the hello, from the run's config
    assert any(cache.glob("*-ntd-tau1-beta1-b0-v3.ort-training"))


def test_a_mixed_fleet_with_onnxruntime_training_clients_gives_the_all_pytorch_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tiny_mlp, one PyTorch and two ORT training clients, over the embedded broker (secured by a fleet kit)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "artifacts"))  # the ORT clients make their artifacts here
    config = fedntd("tiny_mlp")
    run_with_ort_clients(config, tmp_path / "mqtt", None, ("c001", "c002"), tmp_path / "artifacts")
    run_inprocess(config, tmp_path / "torch")
    assert max_weight_diff(tmp_path / "mqtt", tmp_path / "torch") < 1e-5


def test_onnxruntime_training_clients_over_mosquitto_give_the_all_pytorch_cnn(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    mosquitto_url: str,  # noqa: F811
) -> None:
    """fedavg_cnn, every client on ORT training, over mosquitto."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "artifacts"))
    config = fedntd("fedavg_cnn")
    run_with_ort_clients(config, tmp_path / "mqtt", mosquitto_url, ("c000", "c001", "c002"), tmp_path / "artifacts")
    # PyTorch clients run convolutions channels-last on the CPU by default, the ORT graph in the default layout: two
    # float32 summation orders. ORT and default-layout PyTorch have ended 1.5e-8 apart, but where a max-pool window
    # is nearly tied, round-off picks a different maximum and float32 runs part by ~1e-5: on a 2-core AMD EPYC the
    # two PyTorch layouts end 2.5e-5 apart and ORT 2.5e-5 / 2.9e-5 from them. So the bound is 1e-5, or
    # twice how far the two all-PyTorch runs are from each other on this machine when that is more; a wrong gradient,
    # momentum or weight decay is off by orders of magnitude more.
    exp = prepare(config)
    for layout in ("contiguous", "channels_last"):
        backend = TorchBackend("fedavg_cnn", exp.input_shape, exp.num_classes, channels_last=layout == "channels_last")
        run_inprocess(config, tmp_path / layout, backend_for=lambda client, b=backend: b)
    pytorch_spread = max_weight_diff(tmp_path / "contiguous", tmp_path / "channels_last")
    diff = max_weight_diff(tmp_path / "mqtt", tmp_path / "contiguous")
    assert diff < max(1e-5, 2 * pytorch_spread), (diff, pytorch_spread)
