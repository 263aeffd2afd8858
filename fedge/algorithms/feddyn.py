"""FedDyn (Acar et al., ICLR 2021, "Federated Learning Based on Dynamic Regularization", Algorithm 1): each client's
local objective is corrected by a linear term from its own past gradients and a quadratic pull to the server model, so
that the local optima agree with the global one.

Client k, sampled in round t with the server model ``theta^{t-1}``, minimizes

    L_k(theta) - <g_k, theta> + alpha/2 * ||theta - theta^{t-1}||^2

where ``g_k`` (= grad L_k at its previous local optimum, zeros at first) lives in the client's own store. The linear
term is SCAFFOLD's local term :class:`fedge.algorithms.scaffold.Correction` with ``c = -g_k`` (its gradient) and
the quadratic FedProx's :class:`fedge.algorithms.fedprox.Proximal` with ``mu = alpha``, anchored at the received
weights, so every runtime that runs SCAFFOLD and FedProx runs FedDyn. After training,
``g_k <- g_k - alpha * (theta_k^t - theta^{t-1})``.

The server keeps ``h`` (zeros at first): ``h <- h - alpha/m * sum_{k in P_t} (theta_k^t - theta^{t-1})`` with m the
number of clients, and ``theta^t = avg(theta_k^t) - h / alpha``, the average being FedAvg's (by data size, as the FedNTD
authors' implementation weights it; ``--weighting uniform`` gives the paper's plain mean). ``h`` is journaled.
Only trainable parameters carry ``g_k`` and ``h``; batch-norm buffers are averaged as in FedAvg. alpha = 0.1 is the
FedNTD authors' setting for their Table 1.

Under secure aggregation (:mod:`fedge.secagg.parts`) a client's masked input is its clipped move twice: weighted by
its averaging share (the survivors' mean, ``avg``) and unweighted (their sum, for ``h``), so it uploads twice
FedAvg's values, each part clipped to the bound on its own; ``h`` sums the survivors' moves.

Traffic is FedAvg's: ``g_k`` never leaves the client. A client that loses its store restarts from ``g_k = 0``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fedge.algorithms.base import (
    Algorithm,
    CheckedReply,
    ClientStore,
    ServerContext,
    StrategyState,
    tensors_like,
    weights_traffic,
)
from fedge.algorithms.fedavg import FedAvg, FedAvgClient, FedAvgSettings, LocalRound
from fedge.algorithms.fedprox import proximal
from fedge.algorithms.scaffold import Correction
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.learning.terms import TermCall
from fedge.learning.training import TrainRequest, TrainStats
from fedge.secagg.parts import SecurePart
from fedge.types import ClientId, StateDict
from fedge.wire.fields import bounded

_H = "feddyn.h."  # the server's h in its saved state
_OWN_GRAD = "feddyn.g_k."  # the client's g_k in its store
DRIFT_SUM = "feddyn.drift_sum."  # under secure aggregation: the survivors' summed move, in the stand-in reply


@dataclass(frozen=True)
class FedDynSettings(FedAvgSettings):
    dyn_alpha: float = field(
        default=0.1, metadata=bounded(1e-6, 1e3, help="dynamic-regularization weight alpha, FedDyn Algorithm 1")
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.dyn_alpha > 0:
            raise ConfigError(f"dyn_alpha must be > 0, got {self.dyn_alpha}")


class FedDyn(FedAvg[FedDynSettings]):
    """Server half: FedAvg's average, shifted by the accumulated drift ``-h / alpha``."""

    def __init__(self, config: RunConfig, context: ServerContext) -> None:
        super().__init__(config, context)
        trainable = [name for name, _ in self._model.named_parameters()]
        self._h: StateDict = {k: torch.zeros_like(self._weights[k]) for k in trainable}

    def state(self) -> StrategyState:
        tensors, values = super().state()
        return {**tensors, **{_H + k: v for k, v in self._h.items()}}, values

    def load_state(self, tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any]) -> None:
        super().load_state(tensors, values)
        self._h = tensors_like(tensors, _H, self._h)

    def server_step(self, averaged: StateDict, replies: Mapping[ClientId, CheckedReply]) -> StateDict:
        """``h`` from the sum of the clients' moves, then the shifted average. A reply that stands for several
        clients (secure aggregation's) carries their summed move under :data:`DRIFT_SUM`."""
        before, alpha = self._weights, self.settings.dyn_alpha
        shifted = super().server_step(averaged, replies)  # FedAvg's average of theta_k^t
        for k, h in self._h.items():
            moves = [_move(replies[c].update.tensors, before, k) for c in sorted(replies)]
            drift = torch.stack(moves).sum(dim=0)
            self._h[k] = h - alpha / self.config.num_clients * drift
            shifted[k] = shifted[k] - self._h[k] / alpha
        return shifted

    def secure_parts(self) -> tuple[SecurePart, ...]:
        """Under secure aggregation (:mod:`fedge.secagg.parts`): the model's weighted move for the average, and the
        trainable parameters' move once more, unweighted, for ``h``'s sum; each clipped to the bound on its own."""
        return (SecurePart(tuple(self._weights)), SecurePart(tuple(self._h), weighted=False, into=DRIFT_SUM))


def _move(tensors: Mapping[str, torch.Tensor], before: StateDict, k: str) -> torch.Tensor:
    """``theta_k^t - theta^{t-1}`` of parameter ``k``, or the summed moves a stand-in reply carries."""
    summed = tensors.get(DRIFT_SUM + k)
    return summed if summed is not None else tensors[k] - before[k]


class FedDynClient(FedAvgClient[FedDynSettings]):
    settings_type = FedDynSettings

    def request(self, r: LocalRound[FedDynSettings]) -> TrainRequest:
        own = _own_gradient(r.store, r.global_weights)
        request = super().request(r)
        linear = TermCall(Correction(), {"c": {k: -g for k, g in own.items()}})  # -<g_k, theta>
        return dataclasses.replace(
            request, terms=(*request.terms, *proximal(r.settings.dyn_alpha, r.global_weights), linear)
        )

    def upload(self, r: LocalRound[FedDynSettings], weights: StateDict, stats: TrainStats) -> dict[str, torch.Tensor]:
        alpha = r.settings.dyn_alpha
        for k, g in _own_gradient(r.store, r.global_weights).items():
            r.store[_OWN_GRAD + k] = g - alpha * (weights[k] - r.global_weights[k])
        return weights


def _own_gradient(store: ClientStore, global_weights: StateDict) -> StateDict:
    """g_k for every floating-point tensor of the model, zeros before this client's first round. The client cannot
    tell parameters from batch-norm buffers by name; every runtime reads the correction of parameters only, so the
    entries of buffers are kept but never used."""
    return {
        k: store.get(_OWN_GRAD + k, torch.zeros_like(w)) for k, w in global_weights.items() if w.is_floating_point()
    }


ALGORITHM = Algorithm(
    name="feddyn",
    label="FedDyn",
    paper="Acar et al., ICLR 2021, Algorithm 1",
    settings=FedDynSettings,
    server=FedDyn,
    client=FedDynClient(),
    traffic=weights_traffic,
    describe=lambda s: f"α={s.dyn_alpha:g}",
    secagg_gap="",
    dp_gap="",  # DP-FedAvg: h from the same noised sum of clipped moves as the model (fedge.privacy.contribution)
)
