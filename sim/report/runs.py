"""A run directory as the report reads it (:class:`Run`), and the labels that tell runs apart."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedge.accounting.ledger import LedgerEntry, read_ledger_csv
from fedge.accounting.records import RoundRecord
from fedge.config import RunConfig
from fedge.errors import FedgeError
from fedge.registry import get_algorithm
from fedge_io.rundir import read_run


@dataclass(frozen=True)
class Run:
    """One run directory, loaded."""

    path: Path
    label: str
    config: RunConfig
    rounds: list[RoundRecord]
    summary: dict[str, Any]
    ledger: list[LedgerEntry] | None  # None when the run has no ledger.csv
    finished: bool = True  # False: no summary.json (the run was stopped, or is still running)

    def series(self, key: str, x_key: str = "round") -> tuple[list[float], list[float]]:
        """(x, y) over the rounds that recorded the metric ``key`` (a metrics.jsonl name)."""
        points = [(r.value(x_key), r.value(key)) for r in self.rounds]
        kept = [(x, y) for x, y in points if x is not None and y is not None]
        return [x for x, _ in kept], [y for _, y in kept]

    def has(self, key: str) -> bool:
        return any(r.value(key) is not None for r in self.rounds)


def algorithm_name(config: RunConfig) -> str:
    """``"FedNTD"``, ``"DS-FL ERA"``, ... (DS-FL names its aggregation: ERA, eq. 13, or SA, eq. 16)."""
    name = get_algorithm(config.algorithm).label
    aggregation = getattr(config.algo, "aggregation", None)  # DS-FL's ERA or SA
    if aggregation:
        name = f"{name} {aggregation.upper()}"
    if config.buffered:
        name = f"{name} + FedBuff K={config.fedbuff_buffer_size}"
    return name


def partition_name(config: RunConfig) -> str:
    """``"IID"``, ``"shards s=2"`` or ``"Dir(α=0.1)"``."""
    if config.partition == "shards":
        return f"shards s={config.shards_per_client}"
    if config.partition == "dirichlet":
        return f"Dir(α={config.dirichlet_alpha:g})"
    return config.partition.upper() if config.partition == "iid" else config.partition


def run_label(config: RunConfig, *, partition: bool = True, dataset: bool = False) -> str:
    """A run's display name: ``"FedNTD (shards s=2)"``, ``"DS-FL ERA"`` (with ``partition=False``), ..."""
    details = ([config.dataset] if dataset else []) + ([partition_name(config)] if partition else [])
    name = algorithm_name(config)
    return f"{name} ({', '.join(details)})" if details else name


def not_a_run(path: str | Path) -> str | None:
    """Why ``path`` is not a run directory with a round to report ("is not ...", "has no ..."), or None."""
    p = Path(path)
    if not p.is_dir():
        return "is not a run directory: it does not exist" if not p.exists() else "is not a run directory"
    missing = [name for name in ("config.json", "metrics.jsonl") if not (p / name).is_file()]
    if missing:
        return f"is not a run directory: it has no {' or '.join(missing)}"
    if (p / "metrics.jsonl").stat().st_size == 0:
        return "has no completed round yet"
    return None


def load_run(path: str | Path) -> Run:
    """Read a run directory; :class:`FedgeError` naming the path if it is not one."""
    p = Path(path)
    reason = not_a_run(p)
    if reason is not None:
        raise FedgeError(f"{p} {reason} (pass directories written by `fedge sim` or `fedge coordinator`)")
    try:
        config, rounds, summary = read_run(p)
    except json.JSONDecodeError as exc:
        raise FedgeError(
            f"{p}: metrics.jsonl or summary.json is not valid JSON ({exc}); is the run corrupted?"
        ) from exc
    ledger = read_ledger_csv(p / "ledger.csv") if (p / "ledger.csv").is_file() else None
    return Run(p, run_label(config), config, rounds, summary, ledger, finished=(p / "summary.json").is_file())


def load_runs(run_dirs: Sequence[Path]) -> list[Run]:
    """Load ``run_dirs`` with the labels a report gives them side by side: only what differs between the runs, made
    unique with the directory name (two ERA runs on different machines, say)."""
    loaded = [load_run(p) for p in run_dirs]
    labels = _labels([r.config for r in loaded], [r.path for r in loaded])
    return [dataclasses.replace(r, label=lab) for r, lab in zip(loaded, labels, strict=True)]


def _labels(configs: Sequence[RunConfig], paths: Sequence[Path]) -> list[str]:
    """Labels that name only what differs between runs, made unique with the directory name."""
    partition = len({partition_name(c) for c in configs}) > 1
    dataset = len({c.dataset for c in configs}) > 1
    labels = [run_label(c, partition=partition, dataset=dataset) for c in configs]
    if len({(c.train.augment, c.train_size) for c in configs}) > 1:  # augmented runs beside unaugmented ones
        labels = [f"{lab}, {pipeline(c)}" for lab, c in zip(labels, configs, strict=True)]
    labels = [f"{lab} [{p.name}]" if labels.count(lab) > 1 else lab for lab, p in zip(labels, paths, strict=True)]
    return [f"{lab} #{i + 1}" if labels.count(lab) > 1 else lab for i, lab in enumerate(labels)]


def context(runs: Sequence[Run]) -> str:
    """What all runs share and their labels leave out, for plot titles: ``"digits, shards s=2"``."""
    shared = [
        values.pop()
        for values in ({r.config.dataset for r in runs}, {partition_name(r.config) for r in runs})
        if len(values) == 1
    ]
    return ", ".join(shared)


def pipeline(config: RunConfig) -> str:
    """A short label for the training data: ``"augment paper, 50000 images"``, ``"no augmentation"``."""
    augment = "no augmentation" if config.train.augment == "none" else f"augment {config.train.augment}"
    return f"{augment}, {config.train_size} images" if config.train_size else augment
