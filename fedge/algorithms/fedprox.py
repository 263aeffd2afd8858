"""FedProx (Li et al., MLSys 2020): FedAvg whose local objective adds a proximal term to the received weights.

Local objective, FedProx eq. 2: ``h(w) = F_k(w) + mu/2 * ||w - w^t||^2`` over the trainable parameters, with
``w^t`` the round's global weights and ``F_k`` cross-entropy. FedNTD's Table 5 uses mu = 0.1 (searched in
{0.1, 0.5, 1.0}); that is the default. The term is part of the training request
(:class:`fedge.learning.training.TrainRequest`), so every runtime applies it, the exported ExecuTorch programs included.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fedge.algorithms.base import Algorithm, weights_traffic
from fedge.algorithms.fedavg import FedAvg, FedAvgClient, FedAvgSettings, LocalRound
from fedge.errors import ConfigError
from fedge.learning.training import TrainRequest
from fedge.wire.fields import bounded


@dataclass(frozen=True)
class FedProxSettings(FedAvgSettings):
    prox_mu: float = field(default=0.1, metadata=bounded(0.0, 1e3, help="proximal weight mu, FedProx eq. 2"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.prox_mu >= 0:
            raise ConfigError(f"prox_mu must be >= 0, got {self.prox_mu}")


class FedProxClient(FedAvgClient[FedProxSettings]):
    settings_type = FedProxSettings

    def request(self, r: LocalRound[FedProxSettings]) -> TrainRequest:
        return dataclasses.replace(super().request(r), prox_mu=r.settings.prox_mu, anchor=r.global_weights)


ALGORITHM = Algorithm(
    name="fedprox",
    label="FedProx",
    paper="Li et al., MLSys 2020, eq. 2",
    settings=FedProxSettings,
    server=FedAvg,
    client=FedProxClient(),
    traffic=weights_traffic,
    describe=lambda s: f"μ={s.prox_mu:g}",
    secagg_gap="",
)
