"""benchmarks/local_training.py runs end to end on tiny settings (no timing is checked: the figures come from real
runs). It had rotted once, unnoticed, when ``make_strategy`` changed its signature."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_local_training_benchmark_prints_every_path_against_the_plain_loop():
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/local_training.py",
            "--model",
            "tiny_mlp",
            "--samples",
            "60",
            "--epochs",
            "1",
            "--repeats",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("  ")[0] for line in done.stdout.splitlines()}
    assert {"plain PyTorch loop", "fedge FedAvg round", "fedge FedNTD round"} <= rows
    assert "load average" in done.stdout
