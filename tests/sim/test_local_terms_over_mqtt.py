"""FedCurv and MOON, whose local terms run inside the exported programs, over the broker with an ExecuTorch and an
ONNX Runtime training client process next to a PyTorch one: the all-PyTorch model, within the parity gate's float
tolerance. Each on-device client makes (and parity-gates) its programs from the run's config before its hello: the
term's program, and for FedCurv also the cross-entropy program whose gradients its Fisher pass squares."""

from __future__ import annotations

from pathlib import Path

import pytest
from export_support import program_cache
from safetensors.torch import load_file

from edge_client.backends.cache_dir import CACHE_ENV
from fedge.algorithms.fedcurv import FedCurvSettings
from fedge.algorithms.moon import MoonSettings
from fedge.config import RunConfig, TrainConfig
from sim.laptop import run_over_mqtt
from sim.run import run_inprocess

ORT_PYTHON = Path(__file__).resolve().parents[2] / ".venv-ort-training" / "bin" / "python"

pytestmark = [
    pytest.mark.broker,
    pytest.mark.skipif(not ORT_PYTHON.exists(), reason=f"{ORT_PYTHON} is absent: install it with `make ort-training`"),
]

TRAIN = TrainConfig(local_epochs=1, momentum=0.9, weight_decay=1e-5)
CONFIGS = {  # small Fisher samples: the pass is what is tested, not its size
    "fedcurv": RunConfig(algorithm="fedcurv", algo=FedCurvSettings(fisher_samples=100), dataset="digits",
                         model="tiny_mlp", num_clients=3, rounds=2, train=TRAIN),
    "moon": RunConfig(algorithm="moon", algo=MoonSettings(), dataset="digits", model="tiny_mlp", num_clients=3,
                      rounds=2, train=TRAIN),
}  # fmt: skip


def max_weight_diff(a: Path, b: Path) -> float:
    wa, wb = load_file(a / "global_model.safetensors"), load_file(b / "global_model.safetensors")
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


@pytest.mark.timeout(900)  # two clients each make and parity-gate their programs on a loaded 2-core host
@pytest.mark.parametrize("algorithm", sorted(CONFIGS))
def test_executorch_and_onnxruntime_training_clients_give_the_all_pytorch_model(
    algorithm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The session's program cache: tests/export/test_executorch.py makes the same ExecuTorch programs (tiny_mlp 1x8x8,
    # the algorithms' default terms); the ORT client adds its artifacts beside them.
    monkeypatch.setenv(CACHE_ENV, str(program_cache()))
    config = CONFIGS[algorithm]
    runtimes = {"c001": "executorch", "c002": "onnxruntime-training"}
    result = run_over_mqtt(
        config,
        tmp_path / "mqtt",
        broker=None,
        round_timeout=300,
        client_runtimes=runtimes,
        client_pythons={"c002": str(ORT_PYTHON)},
    )
    assert all(r.replied == ("c000", "c001", "c002") for r in result.rounds)
    run_inprocess(config, tmp_path / "torch")
    assert max_weight_diff(tmp_path / "mqtt", tmp_path / "torch") < 1e-5
    programs = 2 if algorithm == "fedcurv" else 1
    for client, runtime in runtimes.items():
        log = (tmp_path / "mqtt" / "logs" / f"{client}.log").read_text()
        assert f"({runtime} runtime)" in log
        assert f"prepared {programs} training program(s) for {algorithm}" in log
        assert "now, in a round" not in log
