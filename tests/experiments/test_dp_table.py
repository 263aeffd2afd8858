"""experiments/dp_table.py, the script behind the DP experiment's table, on two real (small) fedge sim runs."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from markdown_support import table_rows

from fedge.config import RunConfig, TrainConfig
from sim.run import run_inprocess

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "dp_table.py"
TRAIN = TrainConfig(lr=0.05, momentum=0.9, local_epochs=1, batch_size=32)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("runs")
    common = dict(dataset="digits", model="tiny_mlp", num_clients=60, client_fraction=0.5, rounds=5, train=TRAIN)
    private = run_inprocess(RunConfig(algorithm="fedavg", **common), base / "nodp", executor="sequential")  # type: ignore[arg-type]
    noised = run_inprocess(
        RunConfig(algorithm="fedavg", dp_noise_multiplier=1.0, dp_clip="adaptive", dp_noise_seed=0, **common),  # type: ignore[arg-type]
        base / "z1",
        executor="sequential",
    )
    return private.path, noised.path


def _accuracies(run: Path) -> list[float]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [line["accuracy"] for line in lines if line.get("accuracy") is not None]


def test_rows_come_from_the_runs_and_the_gap_from_the_private_run(runs: tuple[Path, Path]) -> None:
    private, noised = runs
    done = subprocess.run([sys.executable, SCRIPT, noised, private], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    header, _, first, second = table_rows(done.stdout)
    assert header[:5] == ["run", "model", "algorithm", "Z", "clip"]
    assert first[0] == "`nodp`" and first[3] == "no DP" and first[5] == "-"  # the private run first, whatever the order
    lines = [json.loads(line) for line in (noised / "metrics.jsonl").read_text().splitlines()]
    assert second[0] == "`z1`" and second[3] == "1" and second[4] == "adaptive"
    assert second[5] == f"{lines[-1]['dp_epsilon']:.2f}" and second[6] == "5"
    a, b = _accuracies(noised), _accuracies(private)
    assert second[7] == f"{100 * a[-1]:.2f}" and second[8] == f"{100 * max(a):.2f}"
    assert second[10] == f"{100 * (statistics.fmean(a[-5:]) - statistics.fmean(b[-5:])):+.2f}"


def test_a_run_with_no_evaluation_yet_is_named_not_a_traceback(runs: tuple[Path, Path], tmp_path: Path) -> None:
    started = tmp_path / "started"
    started.mkdir()
    (started / "config.json").write_text((runs[1] / "config.json").read_text())
    first = json.loads((runs[1] / "metrics.jsonl").read_text().splitlines()[0])
    (started / "metrics.jsonl").write_text(json.dumps({**first, "accuracy": None}) + "\n")
    done = subprocess.run([sys.executable, SCRIPT, started], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "started: no evaluated round in metrics.jsonl yet" in done.stderr
    assert "Traceback" not in done.stderr
