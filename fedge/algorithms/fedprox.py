"""FedProx (Li et al., MLSys 2020): FedAvg whose local objective adds a proximal term to the received weights.

Local objective, FedProx eq. 2: ``h(w) = F_k(w) + mu/2 * ||w - w^t||^2`` over the trainable parameters, with
``w^t`` the round's global weights and ``F_k`` cross-entropy. FedNTD's Table 5 uses mu = 0.1 (searched in
{0.1, 0.5, 1.0}); that is the default. The term is :class:`Proximal`, a local term
(:mod:`fedge.learning.terms`) that every runtime evaluates, the exported programs included (anchored at the round's
global weights, their input). FedDyn trains with it too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from fedge.algorithms.base import Algorithm, weights_traffic
from fedge.algorithms.fedavg import FedAvg, FedAvgClient, FedAvgSettings, LocalRound
from fedge.errors import ConfigError
from fedge.learning.terms import LocalTerm, TermBatch, TermCall
from fedge.learning.training import TrainRequest
from fedge.types import StateDict
from fedge.wire.fields import bounded


@dataclass(frozen=True)
class FedProxSettings(FedAvgSettings):
    prox_mu: float = field(default=0.1, metadata=bounded(0.0, 1e3, help="proximal weight mu, FedProx eq. 2"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.prox_mu >= 0:
            raise ConfigError(f"prox_mu must be >= 0, got {self.prox_mu}")


@dataclass(frozen=True)
class Proximal(LocalTerm):
    """``mu/2 * sum ||w - anchor||^2`` over the trainable parameters (FedProx eq. 2)."""

    kind = "prox"
    tensors = ("anchor",)
    mu: float = 0.1

    def __call__(self, b: TermBatch) -> torch.Tensor:
        anchor = b.tensors["anchor"]
        # Python's sum adds in parameter order from 0 (0 + s is s exactly), the same order on every runtime.
        squares = [(p - anchor[k]).pow(2).sum() for k, p in b.params.items()]
        return 0.5 * self.mu * sum(squares)  # type: ignore[return-value]


def proximal(mu: float, anchor: StateDict) -> tuple[TermCall, ...]:
    """The proximal term pulling towards ``anchor`` (none for mu = 0: then it is FedAvg's training, bit for bit)."""
    return (TermCall(Proximal(mu=mu), {"anchor": anchor}),) if mu > 0 else ()


class FedProxClient(FedAvgClient[FedProxSettings]):
    settings_type = FedProxSettings

    def request(self, r: LocalRound[FedProxSettings]) -> TrainRequest:
        request = super().request(r)
        return dataclasses.replace(request, terms=request.terms + proximal(r.settings.prox_mu, r.global_weights))


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
    terms=(Proximal,),
)
