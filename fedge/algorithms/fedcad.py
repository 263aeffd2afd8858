"""FedCAD (class-wise adaptive self-distillation; He et al., AAAI 2022, eq. 1-3).

FedLSD's flow and loss with class-wise weights ``alpha_y = (gamma - beta)/2 * E[phi] + (gamma + beta)/2`` from the
global model's reliability on the client's own data (eq. 3, :func:`fedge.learning.losses.fedcad_class_weights`),
computed once per round from the frozen teacher's logits. Defaults beta = 0.25, gamma = 0.5 (the paper's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fedge.algorithms.base import Algorithm, ClientData, weights_traffic
from fedge.algorithms.fedavg import FedAvg
from fedge.algorithms.fedlsd import ClassWeightedClient, ClassWeightedSettings
from fedge.errors import ConfigError
from fedge.learning.losses import fedcad_class_weights
from fedge.wire.fields import bounded


@dataclass(frozen=True)
class FedCADSettings(ClassWeightedSettings):
    cad_beta: float = field(default=0.25, metadata=bounded(0.0, 1.0, help="lower end beta of alpha_y, eq. 3"))
    cad_gamma: float = field(default=0.5, metadata=bounded(0.0, 1.0, help="upper end gamma of alpha_y, eq. 3"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.cad_beta <= self.cad_gamma <= 1:
            raise ConfigError(
                f"FedCAD needs 0 <= cad_beta <= cad_gamma <= 1, got beta={self.cad_beta}, gamma={self.cad_gamma}"
            )


class FedCADClient(ClassWeightedClient[FedCADSettings]):
    settings_type = FedCADSettings

    def class_weights(self, settings: FedCADSettings, teacher: torch.Tensor, data: ClientData) -> torch.Tensor:
        """FedCAD eq. 3 on all of the client's data."""
        return fedcad_class_weights(
            teacher, data.y, data.num_classes, beta=settings.cad_beta, gamma=settings.cad_gamma, tau=settings.kd_tau
        )


ALGORITHM = Algorithm(
    name="fedcad",
    label="FedCAD",
    paper="He et al., AAAI 2022, eq. 1-3",
    settings=FedCADSettings,
    server=FedAvg,
    client=FedCADClient(),
    traffic=weights_traffic,
    describe=lambda s: f"β={s.cad_beta:g}, γ={s.cad_gamma:g}",
    secagg_gap="",
)
