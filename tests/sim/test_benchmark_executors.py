"""benchmarks/executors.py's code paths on tiny settings (no timing is checked: the figures come from real runs)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from fedge.config import RunConfig, TrainConfig

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_executors", ROOT / "benchmarks" / "executors.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


TINY = RunConfig(
    algorithm="fedavg",
    dataset="digits",
    model="tiny_mlp",
    num_clients=4,
    train=TrainConfig(lr=0.05, momentum=0.9, local_epochs=1, batch_size=32),
)


def test_the_plain_sequential_and_batched_paths_alternate_on_tiny_settings(capsys: pytest.CaptureFixture[str]):
    bench = _bench()
    config = dataclasses.replace(TINY, rounds=2)
    done = bench.bench_setup("tiny", config, ["plain", "sequential", "batched"], rounds=2, device="cpu")
    names = [p.name for p in done]
    assert names[0].startswith("plain") and any(n.startswith("batched") for n in names)
    assert all(len(p.times) == 2 and min(p.times) > 0 for p in done)
    out = bench.report("tiny", done)
    assert set(out) == set(names)
    assert "batched, 1 thread" in capsys.readouterr().out


def test_the_gpu_mode_stops_with_one_line_without_cuda(monkeypatch: pytest.MonkeyPatch):
    bench = _bench()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["executors.py", "--device", "cuda", "--quick"])
    with pytest.raises(SystemExit, match="CUDA is not available") as info:
        bench.main()
    assert "\n" not in str(info.value)
    bench.check_device("cpu")  # the CPU needs nothing


def test_the_defaults_comparison_reports_cpu_seconds_auto_choices_and_the_verdict(capsys: pytest.CaptureFixture[str]):
    bench = _bench()
    out = bench.bench_overlap("tiny", TINY, blocks=2, per_block=1)
    assert out["same_records"] is True
    paths = ["plain loop", "fedge sim, --overlap off", "fedge sim, --overlap on", "fedge sim defaults (auto)"]
    figures = [v for k, v in out.items() if any(k.startswith(p) for p in paths)]
    assert len(figures) == 4
    for f in figures:
        assert len(f["blocks_s"]) == len(f["blocks_cpu_s"]) == 2 and f["median_cpu_round_s"] > 0
    assert out["defaults_vs_best_choice"] > 0 and out["defaults_vs_plain"] > 0
    printed = capsys.readouterr().out
    assert "auto chose the " in printed and "against the faster of --overlap off/on" in printed
