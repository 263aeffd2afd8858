"""Run configuration: frozen dataclasses, validated on construction, serializable to JSON.

Defaults follow the papers: FedNTD Appendix B.3-B.4 (momentum SGD, lr 0.01, decay 0.99 per round, weight decay 1e-5,
beta = tau = 1), FedCAD (beta = 0.25, gamma = 0.5), DS-FL 4.1 (1,000 open samples per round, ERA temperature 0.1).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedge.errors import ConfigError

ALGORITHMS = ("fedavg", "fedntd", "fedlsd", "fedcad", "fd", "dsfl")
WEIGHT_ALGORITHMS = ("fedavg", "fedntd", "fedlsd", "fedcad")
"""Algorithms that exchange model weights (FL); the others exchange model outputs."""


@dataclass(frozen=True)
class TrainConfig:
    """Local optimization, identical on every client."""

    lr: float = 0.01  # FedNTD B.3 (DS-FL 4.1 uses 0.1 with plain SGD)
    momentum: float = 0.9  # local only: momentum buffers never leave the client
    weight_decay: float = 1e-5
    lr_decay: float = 0.99  # per round: lr_r = lr * lr_decay ** (r - 1), sent in each task
    local_epochs: int = 3
    batch_size: int = 50

    def __post_init__(self) -> None:
        _check(self.lr > 0, f"lr must be > 0, got {self.lr}")
        _check(0 <= self.momentum < 1, f"momentum must be in [0, 1), got {self.momentum}")
        _check(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        _check(0 < self.lr_decay <= 1, f"lr_decay must be in (0, 1], got {self.lr_decay}")
        _check(self.local_epochs >= 0, f"local_epochs must be >= 0, got {self.local_epochs}")
        _check(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")

    def lr_at(self, rnd: int) -> float:
        """Learning rate of round ``rnd`` (1-based)."""
        return self.lr * self.lr_decay ** (rnd - 1)


@dataclass(frozen=True)
class AlgorithmConfig:
    """Hyperparameters of every algorithm; each algorithm reads the ones it needs."""

    # FedNTD (eq. 10-11) and FedAvg aggregation
    ntd_beta: float = 1.0
    ntd_tau: float = 1.0
    weighting: str = "weighted"  # "weighted" by data size (FedNTD eq. 2) or "uniform" (FedNTD Algorithm 1)
    # FedLSD / FedCAD (FedCAD eq. 1-3)
    lsd_weight: float = 0.5
    cad_beta: float = 0.25
    cad_gamma: float = 0.5
    kd_tau: float = 1.0
    # FD (DS-FL eq. 4-7)
    fd_gamma: float = 1.0  # weight of the distillation regularizer, eq. 7
    # DS-FL (eq. 9-16)
    aggregation: str = "era"  # "era" (eq. 13) or "sa" (eq. 16)
    era_temperature: float = 0.1
    open_size: int = 20_000  # I^o, unlabeled open set carved out of the training data
    private_size: int = 0  # I^p, 0 = everything not in the open set
    open_per_round: int = 1_000  # |o_r|
    distill_epochs: int = 2
    distill_lr: float = 0.1
    distill_batch_size: int = 100
    server_distill: bool = True  # eq. 11: the server's global model distills on the global soft labels

    def __post_init__(self) -> None:
        _check(self.ntd_beta >= 0 and self.ntd_tau > 0, "ntd_beta must be >= 0 and ntd_tau > 0")
        _check(self.weighting in ("weighted", "uniform"), f"weighting must be weighted|uniform, not {self.weighting!r}")
        _check(0 <= self.lsd_weight <= 1, f"lsd_weight must be in [0, 1], got {self.lsd_weight}")
        _check(
            0 <= self.cad_beta <= self.cad_gamma <= 1,
            f"FedCAD needs 0 <= cad_beta <= cad_gamma <= 1, got beta={self.cad_beta}, gamma={self.cad_gamma}",
        )
        _check(self.kd_tau > 0, "kd_tau must be > 0")
        _check(self.fd_gamma >= 0, "fd_gamma must be >= 0")
        _check(self.aggregation in ("era", "sa"), f"aggregation must be era|sa, not {self.aggregation!r}")
        _check(self.era_temperature > 0, "era_temperature must be > 0")
        _check(self.open_size >= 0 and self.private_size >= 0, "open_size and private_size must be >= 0")
        _check(self.open_per_round >= 1, "open_per_round must be >= 1")
        _check(self.distill_epochs >= 0 and self.distill_lr > 0, "distill_epochs >= 0 and distill_lr > 0 required")
        _check(self.distill_batch_size >= 1, "distill_batch_size must be >= 1")


@dataclass(frozen=True)
class RunConfig:
    """Everything that determines a run; two runs with equal configs produce the same global model."""

    algorithm: str = "fedntd"
    dataset: str = "digits"
    data_dir: str | None = None
    model: str | None = None  # None: the default model for the dataset
    num_clients: int = 10
    client_fraction: float = 1.0  # share of clients sampled each round
    rounds: int = 10
    partition: str = "shards"  # iid | shards | dirichlet
    shards_per_client: int = 2
    dirichlet_alpha: float = 0.1
    min_client_size: int = 10
    seed: int = 0
    min_replies: float = 1.0  # quorum: share of the sampled clients whose replies are needed to aggregate
    eval_every: int = 1
    eval_samples: int = 0  # 0 = the whole test set
    train: TrainConfig = field(default_factory=TrainConfig)
    algo: AlgorithmConfig = field(default_factory=AlgorithmConfig)

    def __post_init__(self) -> None:
        _check(self.algorithm in ALGORITHMS, f"unknown algorithm {self.algorithm!r}; choose one of {ALGORITHMS}")
        _check(self.num_clients >= 1, f"num_clients must be >= 1, got {self.num_clients}")
        _check(0 < self.client_fraction <= 1, f"client_fraction must be in (0, 1], got {self.client_fraction}")
        _check(self.rounds >= 1, f"rounds must be >= 1, got {self.rounds}")
        _check(0 < self.min_replies <= 1, f"min_replies must be in (0, 1], got {self.min_replies}")
        _check(self.eval_every >= 1, "eval_every must be >= 1")
        _check(self.eval_samples >= 0, "eval_samples must be >= 0")

    @property
    def clients_per_round(self) -> int:
        return max(1, round(self.client_fraction * self.num_clients))

    @property
    def exchanges_weights(self) -> bool:
        return self.algorithm in WEIGHT_ALGORITHMS

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunConfig:
        """Build from a dict such as a saved ``config.json``; unknown keys are an error, not silently dropped."""
        raw = dict(raw)
        train = _sub(TrainConfig, raw.pop("train", {}) or {}, "train")
        algo = _sub(AlgorithmConfig, raw.pop("algo", {}) or {}, "algo")
        return _sub(cls, {**raw, "train": train, "algo": algo}, "run")

    @classmethod
    def from_json_file(cls, path: str | Path) -> RunConfig:
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)


def _sub(kind: Any, raw: dict[str, Any], section: str) -> Any:
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown {section} setting(s) {unknown}; known: {sorted(known)}")
    return kind(**raw)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
