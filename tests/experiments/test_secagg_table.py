"""experiments/secagg_table.py, the script behind the secure-aggregation table, on two real (small) runs."""

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

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "secagg_table.py"
TRAIN = TrainConfig(lr=0.05, momentum=0.9, local_epochs=1, batch_size=32)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("runs")
    common = dict(dataset="digits", model="tiny_mlp", num_clients=20, client_fraction=0.5, rounds=3, train=TRAIN)
    plain = run_inprocess(RunConfig(algorithm="fedavg", **common), base / "plain", executor="sequential")  # type: ignore[arg-type]
    secure = run_inprocess(
        RunConfig(algorithm="fedavg", secure_aggregation=True, **common),  # type: ignore[arg-type]
        base / "secure",
        executor="sequential",
    )
    return plain.path, secure.path


def _lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_rows_come_from_the_runs_and_the_ratios_from_the_plain_run(runs: tuple[Path, Path]) -> None:
    plain, secure = runs
    done = subprocess.run([sys.executable, SCRIPT, secure, plain], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    header, _, first, second = table_rows(done.stdout)
    assert header[:4] == ["run", "algorithm", "cohort", "secure"]
    assert first[:4] == ["`plain`", "fedavg", "10", "no"] and first[8] == first[10] == "-"  # plain first
    assert second[:5] == ["`secure`", "fedavg", "10", "yes", "3"]
    p, s = _lines(plain), _lines(secure)
    a, b = [line["accuracy"] for line in s], [line["accuracy"] for line in p]
    assert second[5] == f"{100 * a[-1]:.2f}" and second[6] == f"{100 * max(a):.2f}"
    assert second[8] == f"{100 * (a[-1] - b[-1]):+.2f} / {100 * (statistics.fmean(a) - statistics.fmean(b)):+.2f}"
    up_plain = statistics.median(line["tensor_bytes_up"] / len(line["replied"]) for line in p)
    up_secure = statistics.median(line["tensor_bytes_up"] / len(line["replied"]) for line in s)
    assert up_secure > up_plain  # the keys and shares are counted
    assert second[9] == f"{up_secure:,.0f}" and second[10] == f"{up_secure / up_plain:.5f}x"
    walls = [statistics.median(line["wall_s"] for line in lines) for lines in (s, p)]
    assert second[12] == f"{walls[0] / walls[1]:.2f}x"


def test_a_run_still_going_is_compared_with_the_plain_runs_same_rounds(runs: tuple[Path, Path], tmp_path: Path) -> None:
    plain, secure = runs
    going = tmp_path / "going"
    going.mkdir()
    (going / "config.json").write_text((secure / "config.json").read_text())
    lines = _lines(secure)[:2]
    (going / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = subprocess.run([sys.executable, SCRIPT, going, plain], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    row = table_rows(done.stdout)[3]
    a, b = [line["accuracy"] for line in lines], [line["accuracy"] for line in _lines(plain)[:2]]
    assert row[0] == "`going` (running)" and row[4] == "2"
    assert row[8] == f"{100 * (a[-1] - b[-1]):+.2f} / {100 * (statistics.fmean(a) - statistics.fmean(b)):+.2f}"


def test_a_run_with_no_evaluation_yet_is_named_not_a_traceback(runs: tuple[Path, Path], tmp_path: Path) -> None:
    started = tmp_path / "started"
    started.mkdir()
    (started / "config.json").write_text((runs[1] / "config.json").read_text())
    (started / "metrics.jsonl").write_text(json.dumps({**_lines(runs[1])[0], "accuracy": None}) + "\n")
    done = subprocess.run([sys.executable, SCRIPT, started], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "started: no evaluated round in metrics.jsonl yet" in done.stderr
    assert "Traceback" not in done.stderr
