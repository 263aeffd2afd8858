"""FedAdam and FedYogi (Reddi et al., ICLR 2021, "Adaptive Federated Optimization", Algorithm 2): FedAvg's clients,
and a server that treats the averaged update as a pseudo-gradient for an adaptive optimizer.

Each round the clients train from the global weights ``x_t`` exactly as in FedAvg. The server averages their models as
FedAvg does (by data size, or robustly) and takes the difference ``Delta_t = avg(x_i) - x_t``. Then, per value:

    m_t = beta1 * m_{t-1} + (1 - beta1) * Delta_t
    v_t = beta2 * v_{t-1} + (1 - beta2) * Delta_t^2                              (FedAdam)
    v_t = v_{t-1} - (1 - beta2) * Delta_t^2 * sign(v_{t-1} - Delta_t^2)           (FedYogi)
    v_t = v_{t-1} + Delta_t^2                                                     (FedAdagrad)
    x_{t+1} = x_t + eta * m_t / (sqrt(v_t) + tau)

with ``m_{-1} = 0`` and ``v_{-1} = tau^2`` (the paper's ``v_{-1} >= tau^2``) and, as in the paper, no bias correction.
Defaults are the paper's: beta1 = 0.9, beta2 = 0.99, tau = 1e-3; eta is the run's to tune (the paper searches
10^-3 .. 10^0.5). Integer buffers (batch-norm counters) take FedAvg's average unchanged. ``m`` and ``v`` are the
server's state, saved in the journal, so a resumed run continues the same optimizer.

Traffic is FedAvg's: the optimizer lives on the server only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fedge.algorithms.base import Algorithm, CheckedReply, ServerContext, StrategyState, tensors_like, weights_traffic
from fedge.algorithms.fedavg import FedAvg, FedAvgClient, FedAvgSettings
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.types import ClientId, StateDict
from fedge.wire.fields import server_only

SERVER_OPTIMIZERS = ("adam", "yogi", "adagrad")
_FIRST = "server_m."  # m_t in the saved state
_SECOND = "server_v."  # v_t in the saved state


@dataclass(frozen=True)
class FedAdamSettings(FedAvgSettings):
    server_optimizer: str = field(
        default="adam",
        metadata=server_only("adam (FedAdam), yogi (FedYogi) or adagrad (FedAdagrad); Reddi et al. Alg. 2"),
    )
    server_opt_lr: float = field(default=0.03, metadata=server_only("server step size eta of the adaptive optimizer"))
    server_beta1: float = field(default=0.9, metadata=server_only("first-moment decay beta1"))
    server_beta2: float = field(default=0.99, metadata=server_only("second-moment decay beta2 (adam, yogi)"))
    server_tau: float = field(default=1e-3, metadata=server_only("adaptivity tau: eta * m / (sqrt(v) + tau)"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.server_optimizer not in SERVER_OPTIMIZERS:
            raise ConfigError(
                f"server_optimizer must be one of {', '.join(SERVER_OPTIMIZERS)}, not {self.server_optimizer!r}"
            )
        if not self.server_opt_lr > 0:
            raise ConfigError(f"server_opt_lr must be > 0, got {self.server_opt_lr}")
        for name in ("server_beta1", "server_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.server_tau > 0:
            raise ConfigError(f"server_tau must be > 0, got {self.server_tau}")


class FedAdam(FedAvg[FedAdamSettings]):
    """Server half: FedAvg's average, then one adaptive step along it."""

    def __init__(self, config: RunConfig, context: ServerContext) -> None:
        super().__init__(config, context)
        s = self.settings
        floats = {k: v for k, v in self._weights.items() if v.is_floating_point()}
        self._m: StateDict = {k: torch.zeros_like(v) for k, v in floats.items()}
        self._v: StateDict = {k: torch.full_like(v, s.server_tau**2) for k, v in floats.items()}

    def state(self) -> StrategyState:
        tensors, values = super().state()
        moments = {**{_FIRST + k: v for k, v in self._m.items()}, **{_SECOND + k: v for k, v in self._v.items()}}
        return {**tensors, **moments}, values

    def load_state(self, tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any]) -> None:
        super().load_state(tensors, values)
        self._m = tensors_like(tensors, _FIRST, self._m)
        self._v = tensors_like(tensors, _SECOND, self._v)

    def aggregate(self, rnd: int, replies: Mapping[ClientId, CheckedReply]) -> dict[str, float]:
        before = self._weights
        metrics = super().aggregate(rnd, replies)  # self._weights = FedAvg's average of the clients' models
        s = self.settings
        stepped = dict(self._weights)
        for k, m_prev in self._m.items():
            delta = self._weights[k] - before[k]  # the pseudo-gradient Delta_t
            m = s.server_beta1 * m_prev + (1 - s.server_beta1) * delta
            square = delta * delta
            v_prev = self._v[k]
            if s.server_optimizer == "adam":
                v = s.server_beta2 * v_prev + (1 - s.server_beta2) * square
            elif s.server_optimizer == "yogi":
                v = v_prev - (1 - s.server_beta2) * square * torch.sign(v_prev - square)
            else:  # adagrad
                v = v_prev + square
            self._m[k], self._v[k] = m, v
            stepped[k] = before[k] + s.server_opt_lr * m / (v.sqrt() + s.server_tau)
        self._weights = stepped
        return metrics


_LABELS = {"adam": "FedAdam", "yogi": "FedYogi", "adagrad": "FedAdagrad"}

ALGORITHM = Algorithm(
    name="fedadam",
    label="FedAdam",
    paper="Reddi et al., ICLR 2021, Algorithm 2 (FedAdam, FedYogi, FedAdagrad)",
    settings=FedAdamSettings,
    server=FedAdam,
    client=FedAvgClient(),
    traffic=weights_traffic,
    describe=lambda s: f"{_LABELS[s.server_optimizer]} η={s.server_opt_lr:g}",
    secagg_gap="",
)
