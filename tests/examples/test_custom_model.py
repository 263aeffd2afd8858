"""examples/custom_model/ run small, as its README says: a plugin's model and dataset in process, from a directory of
files, and deployed over a real mosquitto (fedge provision, fedge coordinator and two fedge client processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mqtt_support import mosquitto_url  # noqa: F401 - pytest fixture
from plugin_support import fresh_plugins  # noqa: F401 - pytest fixture

from fedge import plugins
from fedge_cli.main import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_model"
PLUGIN = str(EXAMPLE / "wine_plugin.py")
SMALL = ["--algorithm", "fedavg", "--partition", "iid", "--local-epochs", "2", "--batch-size", "8", "--lr", "0.05"]


# Each test as in a new process: the plugin not yet imported (``--plugin`` imports it and sets FEDGE_PLUGINS).
pytestmark = pytest.mark.usefixtures("fresh_plugins")


def final_accuracy(run_parent: Path) -> float:
    (run,) = run_parent.iterdir()
    return float(json.loads((run / "summary.json").read_text())["final_accuracy"])


def test_sim_trains_the_plugins_model_on_its_arrays(tmp_path: Path) -> None:
    flags = [*SMALL, "--num-clients", "3", "--rounds", "3", "--executor", "sequential", "--quiet", "--no-report"]
    assert main(["sim", "--plugin", PLUGIN, "--dataset", "wine", *flags, "--out", str(tmp_path)]) == 0
    (run,) = tmp_path.iterdir()
    config = json.loads((run / "config.json").read_text())
    assert (config["dataset"], config["model"]) == ("wine", None)  # the dataset's default model: wine_mlp
    assert json.loads((run / "summary.json").read_text())["model"] == "wine_mlp"
    assert final_accuracy(tmp_path) > 0.8  # 3 cultivars: the largest class is 40% of the test split
    assert PLUGIN in os.environ[plugins.ENV].split(",")  # what client processes and workers import


def test_sim_reads_the_same_data_from_a_directory_of_files(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(EXAMPLE / "make_wine_files.py"), str(tmp_path / "wine")], check=True)
    assert len(list((tmp_path / "wine" / "train").glob("class_*/*.npy"))) == 133
    flags = [*SMALL, "--num-clients", "3", "--rounds", "2", "--executor", "sequential", "--quiet", "--no-report"]
    flags += ["--dataset", "wine_files", "--data-dir", str(tmp_path / "wine"), "--out", str(tmp_path / "runs")]
    assert main(["sim", "--plugin", PLUGIN, *flags]) == 0
    assert final_accuracy(tmp_path / "runs") > 0.8


def test_without_the_plugin_the_error_says_how_to_bring_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--dataset", "wine", "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "unknown dataset 'wine'" in err and "--plugin MODULE_OR_FILE" in err and "Traceback" not in err


def test_provision_coordinator_and_clients_over_mosquitto(tmp_path: Path, mosquitto_url: str) -> None:  # noqa: F811
    data = tmp_path / "data"
    settings = [*SMALL, "--num-clients", "2", "--rounds", "2"]
    assert main(["provision", "--plugin", PLUGIN, "--dataset", "wine", *settings, "--out", str(data)]) == 0
    env = {**os.environ, plugins.ENV: ""}  # the clients get the plugin from their own --plugin flag
    client = [
        sys.executable,
        "-m",
        "fedge_cli.main",
        "client",
        "--plugin",
        PLUGIN,
        "--broker",
        mosquitto_url,
        "--run",
        "wine",
    ]
    client += ["--device", "cpu", "--no-state", "--threads", "1"]
    clients = [
        subprocess.Popen(
            [*client, "--client-id", cid, "--data", str(data / f"{cid}.safetensors")],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for cid in ("c000", "c001")
    ]
    try:
        coordinator = ["coordinator", "--plugin", PLUGIN, "--broker", mosquitto_url, "--run", "wine", "--no-report"]
        coordinator += ["--config", str(data / "config.json"), "--out", str(tmp_path / "runs")]
        coordinator += ["--round-timeout", "60", "--join-timeout", "60", "--tensorboard", str(tmp_path / "tb")]
        code = main(coordinator)
    finally:
        for proc in clients:
            proc.terminate()
        errors = [proc.communicate(timeout=30)[1].decode() for proc in clients]
    assert code == 0, errors
    (run,) = (tmp_path / "runs").iterdir()
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["replied"] for line in lines] == [["c000", "c001"]] * 2
    assert lines[-1]["accuracy"] > 0.8
    # The coordinator's --tensorboard: the same accuracies, from the same round records.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb" / run.name))
    events.Reload()
    accuracy = [(e.step, e.value) for e in events.Scalars("accuracy/accuracy")]
    assert accuracy == [(line["round"], pytest.approx(line["accuracy"], rel=1e-6)) for line in lines]


def test_the_plugins_model_exports_to_onnx_and_passes_its_parity_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "exports"
    flags = ["--model", "wine_mlp", "--input-shape", "13", "--num-classes", "3", "--format", "onnx"]
    assert main(["export", "--plugin", PLUGIN, *flags, "--out", str(out)]) == 0
    assert "wine_mlp.onnx: logits parity on onnxruntime ok" in capsys.readouterr().out
    assert main(["export", "check", str(out / "wine_mlp.onnx")]) == 0
