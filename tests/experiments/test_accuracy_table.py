"""experiments/accuracy_table.py, the script behind the results READMEs' tables, on a real (small) fedge sim run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from markdown_support import table_rows

from fedge.config import RunConfig, TrainConfig
from sim.run import run_inprocess

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "accuracy_table.py"


def table(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = RunConfig(
        algorithm="fedntd", num_clients=4, rounds=4, partition="shards", seed=1, train=TrainConfig(lr=0.1)
    )
    path = tmp_path_factory.mktemp("runs") / "fedntd"
    run_inprocess(config, path)
    return path


def test_the_row_is_made_from_the_runs_metrics(run_dir: Path) -> None:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    accuracies = [r["accuracy"] for r in records]
    first_at_half = next((str(r["round"]) for r in records if r["accuracy"] >= 0.5), "-")

    done = table(run_dir, "--rounds", "2,4,9", "--thresholds", "0,50,101")
    assert done.returncode == 0, done.stderr
    header, rule, cells = table_rows(done.stdout)
    assert header[:5] == ["run", "round 2", "round 4", "round 9", "best"] and len(rule) == len(header) == 10
    assert cells[0] == "FedNTD"  # the label fedge report gives it
    assert cells[1:4] == [f"{100 * accuracies[1]:.2f}", f"{100 * accuracies[3]:.2f}", ""]  # no round 9
    assert cells[4] == f"{100 * max(accuracies):.2f}"
    assert cells[5] == f"{100 * sum(accuracies) / 4:.2f}"  # fewer than 5 evaluations: the mean of all
    assert cells[6] == f"1 / {first_at_half} / -"
    assert cells[7] == f"{records[-1]['forgetting']:.4f}"
    assert cells[9] == "4"


def test_runs_that_differ_only_in_where_they_ran_are_told_apart(run_dir: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "20261126-gpu-fedntd"
    shutil.copytree(run_dir, elsewhere)
    done = table(run_dir, elsewhere, "--rounds", "4")
    assert done.returncode == 0, done.stderr
    labels = [line.split("|")[1].strip() for line in done.stdout.splitlines()[2:]]
    assert labels == ["FedNTD [fedntd]", "FedNTD [20261126-gpu-fedntd]"]  # as in the report made of both


def test_a_directory_that_is_not_a_run_is_a_clear_error(tmp_path: Path) -> None:
    done = table(tmp_path)
    assert done.returncode == 1
    assert "is not a run directory" in done.stderr and "Traceback" not in done.stderr
