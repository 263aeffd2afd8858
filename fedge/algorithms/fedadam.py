"""FedAdam, FedYogi and FedAdagrad (Reddi et al., ICLR 2021, "Adaptive Federated Optimization", Algorithm 2) and
FedAvgM (Hsu, Qi and Brown 2019, Sec. 3): FedAvg's clients, and a server that treats the averaged update as a
pseudo-gradient for an optimizer of its own.

Each round the clients train from the global weights ``x_t`` exactly as in FedAvg. The server averages their models as
FedAvg does (by data size, or robustly) and takes the difference ``Delta_t = avg(x_i) - x_t``. Then, per value:

    m_t = beta1 * m_{t-1} + (1 - beta1) * Delta_t
    v_t = beta2 * v_{t-1} + (1 - beta2) * Delta_t^2                              (FedAdam)
    v_t = v_{t-1} - (1 - beta2) * Delta_t^2 * sign(v_{t-1} - Delta_t^2)           (FedYogi)
    v_t = v_{t-1} + Delta_t^2                                                     (FedAdagrad)
    x_{t+1} = x_t + eta * m_t / (sqrt(v_t) + tau)

with ``m_{-1} = 0`` and ``v_{-1} = tau^2`` (the paper's ``v_{-1} >= tau^2``) and, as in the paper, no bias correction
(why these are not ``torch.optim``'s Adam and Adagrad: :mod:`fedge.aggregation.server_step`). Defaults are the
paper's: beta1 = 0.9, beta2 = 0.99, tau = 1e-3; eta is the run's to tune (the paper searches 10^-3 .. 10^0.5).
``momentum`` is FedAvgM, heavy-ball momentum beta1 on the pseudo-gradient ``g_t = -Delta_t`` (``torch.optim.SGD``):
``v_t = beta1 * v_{t-1} + g_t``, ``x_{t+1} = x_t - eta * v_t`` (Hsu et al. use eta = 1, beta = 0.9).
Integer buffers (batch-norm counters) take FedAvg's average unchanged. The optimizer's state (``m`` and ``v``, or the
momentum) is the server's, saved in the journal, so a resumed run continues the same optimizer.

Traffic is FedAvg's: the optimizer lives on the server only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fedge.aggregation.server_step import ADAPTIVE, Adaptive, Momentum, ServerOptimizer
from fedge.algorithms.base import Algorithm, weights_traffic
from fedge.algorithms.fedavg import FedAvg, FedAvgClient, FedAvgSettings
from fedge.errors import ConfigError
from fedge.wire.fields import server_only

SERVER_OPTIMIZERS = (*ADAPTIVE, "momentum")
_BETA2, _TAU = 0.99, 1e-3  # the paper's defaults


@dataclass(frozen=True)
class FedAdamSettings(FedAvgSettings):
    server_optimizer: str = field(
        default="adam",
        metadata=server_only(
            "adam (FedAdam), yogi (FedYogi) or adagrad (FedAdagrad), Reddi et al. Alg. 2; or momentum (FedAvgM)"
        ),
    )
    server_opt_lr: float = field(default=0.03, metadata=server_only("server step size eta of the server optimizer"))
    server_beta1: float = field(
        default=0.9, metadata=server_only("first-moment decay beta1 (with momentum: the momentum beta)")
    )
    server_beta2: float = field(default=_BETA2, metadata=server_only("second-moment decay beta2 (adam, yogi)"))
    server_tau: float = field(
        default=_TAU, metadata=server_only("adaptivity tau: eta * m / (sqrt(v) + tau) (adam, yogi, adagrad)")
    )

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
        if self.server_optimizer == "momentum" and (self.server_beta2, self.server_tau) != (_BETA2, _TAU):
            raise ConfigError(
                "server_beta2 and server_tau set an adaptive optimizer's second moment; the momentum server optimizer "
                "has none: leave them at their defaults, or choose adam, yogi or adagrad"
            )
        if self.server_optimizer == "adagrad" and self.server_beta2 != _BETA2:
            raise ConfigError(
                f"server_beta2 {self.server_beta2:g} decays adam's and yogi's second moment; adagrad (FedAdagrad, "
                "Reddi et al. Alg. 2) sums every squared update, v_t = v_{t-1} + Delta_t^2, with no decay to set: "
                f"leave server_beta2 at its default ({_BETA2:g}), or choose adam or yogi"
            )


class FedAdam(FedAvg[FedAdamSettings]):
    """Server half: FedAvg's average, then one step of the server optimizer along it."""

    def server_optimizer(self) -> ServerOptimizer:
        s = self.settings
        if s.server_optimizer == "momentum":
            return Momentum(self._weights, lr=s.server_opt_lr, momentum=s.server_beta1)
        return Adaptive(
            s.server_optimizer,
            self._weights,
            lr=s.server_opt_lr,
            beta1=s.server_beta1,
            beta2=s.server_beta2,
            tau=s.server_tau,
        )


_LABELS = {"adam": "FedAdam", "yogi": "FedYogi", "adagrad": "FedAdagrad", "momentum": "FedAvgM"}

ALGORITHM = Algorithm(
    name="fedadam",
    label="FedAdam",
    paper="Reddi et al., ICLR 2021, Algorithm 2 (FedAdam, FedYogi, FedAdagrad); Hsu et al. 2019 (FedAvgM)",
    settings=FedAdamSettings,
    server=FedAdam,
    client=FedAvgClient(),
    traffic=weights_traffic,
    describe=lambda s: f"{_LABELS[s.server_optimizer]} η={s.server_opt_lr:g}",
    secagg_gap="",
)
