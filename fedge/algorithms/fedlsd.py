"""FedLSD (local self-distillation; the constant-weight case of FedCAD, He et al., AAAI 2022, eq. 1-2).

Local objective per sample: ``(1 - a_y) * CE + a_y * L_d`` with ``L_d`` the soft cross-entropy to the received
global model at temperature ``tau`` (eq. 2) and the same weight ``a_y = w`` for every class. FedCAD
(:mod:`fedge.algorithms.fedcad`) reuses this flow and replaces the weights by its class-wise ones.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import torch

from fedge.algorithms.base import Algorithm, ClientData, weights_traffic
from fedge.algorithms.fedavg import FedAvg, FedAvgClient, FedAvgSettings, LocalRound
from fedge.config import AlgorithmSettings
from fedge.errors import ConfigError
from fedge.learning.losses import class_weighted_distillation_loss
from fedge.learning.objectives import Objective, ObjectiveInput
from fedge.wire.fields import bounded


@dataclass(frozen=True)
class ClassWeightedSettings(FedAvgSettings):
    """What FedLSD and FedCAD share: the temperature of their class-weighted distillation (FedCAD eq. 2)."""

    kd_tau: float = field(default=1.0, metadata=bounded(1e-3, 1e3, help="distillation temperature, FedCAD eq. 2"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.kd_tau > 0:
            raise ConfigError(f"kd_tau must be > 0, got {self.kd_tau}")


ClassWeightedT = TypeVar("ClassWeightedT", bound=ClassWeightedSettings)


@dataclass(frozen=True)
class FedLSDSettings(ClassWeightedSettings):
    lsd_weight: float = field(default=0.5, metadata=bounded(0.0, 1.0, help="distillation weight a_y of every class"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.lsd_weight <= 1:
            raise ConfigError(f"lsd_weight must be in [0, 1], got {self.lsd_weight}")


@dataclass(frozen=True)
class ClassWeightedDistillation(Objective):
    """FedCAD eq. 1-2: per-sample ``(1 - a_y) CE + a_y * soft-CE(teacher)``; the weights a_y are an input (C,)."""

    kind = "lsd"
    inputs = (
        ObjectiveInput("teacher", per_sample=True, shape=("C",)),
        ObjectiveInput("class_weights", per_sample=False, shape=("C",)),
    )
    tau: float = 1.0

    def loss(self, logits: torch.Tensor, y: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return class_weighted_distillation_loss(logits, inputs["teacher"], y, inputs["class_weights"], tau=self.tau)


class ClassWeightedClient(FedAvgClient[ClassWeightedT]):
    """FedAvg's flow with the class-weighted distillation of FedCAD eq. 1-2; subclasses choose the weights a_y."""

    def objective(self, r: LocalRound[ClassWeightedT]) -> tuple[Objective, dict[str, torch.Tensor]]:
        teacher = r.backend.logits(r.data.x)  # (N, C): the received global model, frozen for the whole round
        weights = self.class_weights(r.settings, teacher, r.data)  # (C,)
        return ClassWeightedDistillation(tau=r.settings.kd_tau), {"teacher": teacher, "class_weights": weights}

    @abstractmethod
    def class_weights(self, settings: ClassWeightedT, teacher: torch.Tensor, data: ClientData) -> torch.Tensor:
        """a_y for every class, (C,)."""


class FedLSDClient(ClassWeightedClient[FedLSDSettings]):
    settings_type: ClassVar[type[AlgorithmSettings]] = FedLSDSettings

    def class_weights(self, settings: FedLSDSettings, teacher: torch.Tensor, data: ClientData) -> torch.Tensor:
        """a_y for every class: FedLSD's constant weight."""
        return torch.full((data.num_classes,), float(settings.lsd_weight))


ALGORITHM = Algorithm(
    name="fedlsd",
    label="FedLSD",
    paper="He et al., AAAI 2022 (FedCAD eq. 1-2 with a constant weight)",
    settings=FedLSDSettings,
    server=FedAvg,
    client=FedLSDClient(),
    traffic=weights_traffic,
    describe=lambda s: f"weight={s.lsd_weight:g}",
    secagg_gap="",
    objectives=(ClassWeightedDistillation,),
)
