"""FedNTD (Lee et al., NeurIPS 2022): FedAvg whose local loss adds not-true distillation from the global model.

Local objective, eq. 10-11: ``CE + beta * tau^2 * KL(q~_global || q~_local)``, where ``q~`` is the softmax at
temperature ``tau`` over the not-true classes only (see :func:`fedge.learning.losses.ntd_loss`). The teacher is the
received global model, frozen (Algorithm 1): its logits on the local data are computed once per round, before training.
Defaults beta = tau = 1 (Appendix B.4). Everything else is FedAvg's flow.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from fedge.algorithms.base import Algorithm, weights_traffic
from fedge.algorithms.fedavg import FedAvg, FedAvgClient, FedAvgSettings, LocalRound
from fedge.errors import ConfigError
from fedge.learning.losses import ntd_loss
from fedge.learning.objectives import Objective, ObjectiveInput
from fedge.wire.fields import bounded


@dataclass(frozen=True)
class FedNTDSettings(FedAvgSettings):
    ntd_beta: float = field(
        default=1.0, metadata=bounded(0.0, 1e3, help="weight beta of the not-true distillation, eq. 10")
    )
    ntd_tau: float = field(default=1.0, metadata=bounded(1e-3, 1e3, help="its softmax temperature tau, eq. 11"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.ntd_beta >= 0 and self.ntd_tau > 0):
            raise ConfigError(f"ntd_beta must be >= 0 and ntd_tau > 0, got {self.ntd_beta} and {self.ntd_tau}")


@dataclass(frozen=True)
class NotTrueDistillation(Objective):
    """FedNTD eq. 10-11 against the teacher's logits."""

    kind = "ntd"
    inputs = (ObjectiveInput("teacher", per_sample=True, shape=("C",)),)
    tau: float = 1.0
    beta: float = 1.0

    def loss(self, logits: torch.Tensor, y: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return ntd_loss(logits, inputs["teacher"], y, tau=self.tau, beta=self.beta)


class FedNTDClient(FedAvgClient[FedNTDSettings]):
    settings_type = FedNTDSettings

    def objective(self, r: LocalRound[FedNTDSettings]) -> tuple[Objective, dict[str, torch.Tensor]]:
        teacher = r.backend.logits(r.data.x)  # (N, C): the received global model, frozen for the whole round
        return NotTrueDistillation(tau=r.settings.ntd_tau, beta=r.settings.ntd_beta), {"teacher": teacher}


ALGORITHM = Algorithm(
    name="fedntd",
    label="FedNTD",
    paper="Lee et al., NeurIPS 2022, eq. 10-11, Algorithm 1",
    settings=FedNTDSettings,
    server=FedAvg,
    client=FedNTDClient(),
    traffic=weights_traffic,
    describe=lambda s: f"β={s.ntd_beta:g}, τ={s.ntd_tau:g}",
    secagg_gap="",
    objectives=(NotTrueDistillation,),
)
