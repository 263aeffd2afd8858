"""The run directory every kind of run writes: config, partition, metrics per round, byte ledger, model, summary.

Layout (the same for in-process and MQTT runs):
  config.json          the resolved RunConfig
  partition.json       class counts per client
  metrics.jsonl        one JSON object per round
  ledger.csv           every message, bytes at three levels (see fedge.ledger)
  global_model.safetensors   final global weights (absent for FD, which has no global model)
  summary.json         final/best accuracy, totals, ComU@x, dropped and rejected messages
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from fedge.config import RunConfig
from fedge.ledger import ByteLedger
from fedge.metrics import comu_at
from fedge.records import RoundRecord

COMU_THRESHOLDS = (0.5, 0.8, 0.9, 0.95, 0.97)


@dataclass
class RunResult:
    """Where a run was written and what it measured."""

    path: Path
    config: RunConfig
    rounds: list[RoundRecord]
    summary: dict[str, Any]


def new_run_dir(root: str | Path, config: RunConfig, label: str = "") -> Path:
    """A fresh directory ``root/<time>-<algorithm>-<dataset>[-label]``."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = "-".join(x for x in (stamp, config.algorithm, config.dataset, label) if x)
    path = Path(root) / name
    suffix = 1
    while path.exists():
        suffix += 1
        path = Path(root) / f"{name}-{suffix}"
    path.mkdir(parents=True)
    return path


class RunWriter:
    """Writes a run directory as the run goes, so an interrupted run still leaves its rounds on disk."""

    def __init__(self, path: Path, config: RunConfig, partition: Mapping[str, Any]) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(config.to_json() + "\n")
        (path / "partition.json").write_text(json.dumps(partition, indent=1) + "\n")
        self._metrics = open(path / "metrics.jsonl", "w")  # noqa: SIM115 - stays open for the whole run

    def round(self, record: RoundRecord) -> None:
        self._metrics.write(json.dumps(record.to_json()) + "\n")
        self._metrics.flush()

    def finish(
        self,
        rounds: Sequence[RoundRecord],
        ledger: ByteLedger,
        global_weights: Mapping[str, torch.Tensor] | None,
        *,
        initial_bytes: Mapping[str, int],
        extra: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        self._metrics.close()
        ledger.write_csv(self.path / "ledger.csv")
        if global_weights is not None:
            save_file(
                {k: v.contiguous() for k, v in global_weights.items()},
                self.path / "global_model.safetensors",
                metadata={"format": "fedge-exchanged-state"},
            )
        summary = summarize(rounds, initial_bytes)
        summary.update(extra or {})
        (self.path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary


def summarize(rounds: Sequence[RoundRecord], initial_bytes: Mapping[str, int]) -> dict[str, Any]:
    """Final and best accuracy, byte totals, ComU@x, drops and rejections of a run's per-round records."""
    evaluated = [r for r in rounds if r.accuracy is not None]
    acc = [float(r.accuracy) for r in evaluated if r.accuracy is not None]
    summary: dict[str, Any] = {
        "rounds": len(rounds),
        "final_accuracy": acc[-1] if acc else None,
        "best_accuracy": max(acc) if acc else None,
        "final_forgetting": evaluated[-1].forgetting if evaluated else None,
        "initial_tensor_bytes": dict(initial_bytes),
        "dropped": [{"round": r.round, "client": d.client} for r in rounds for d in r.drops],
        "drops": [
            {"round": r.round, "client": d.client, "reason": d.reason, "after_s": d.after_s}
            for r in rounds
            for d in r.drops
        ],
        "rejected": sum(len(r.rejections) for r in rounds),
        "rejected_by_reason": dict(Counter(x.category for r in rounds for x in r.rejections)),
        "skipped_rounds": [r.round for r in rounds if not r.aggregated],
    }
    if rounds:
        last = rounds[-1]
        summary["total_bytes"] = {k[4:]: v for k, v in last.bytes.flat().items() if k.startswith("cum_")}
    comu: dict[str, dict[str, int | None]] = {}
    for acc_model in ("multicast", "unicast"):
        cum = [r.bytes.cum_tensor[acc_model] for r in evaluated]
        comu[acc_model] = {
            f"{t:g}": comu_at(acc, cum, t)
            for t in COMU_THRESHOLDS  # cum already includes ComU@I
        }
    summary["comu_at"] = comu
    return summary


def read_run(path: str | Path) -> tuple[RunConfig, list[RoundRecord], dict[str, Any]]:
    """Load (config, per-round records, summary) of a run directory."""
    p = Path(path)
    config = RunConfig.from_json_file(p / "config.json")
    with open(p / "metrics.jsonl") as fh:
        rounds = [RoundRecord.from_json(json.loads(line)) for line in fh if line.strip()]
    summary_path = p / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else summarize(rounds, {})
    return config, rounds, summary
