"""FedNova (Wang et al., NeurIPS 2020, "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
Optimization"): FedAvg whose server normalizes each client's update by how much local work produced it.

Client i runs tau_i local steps of momentum SGD (rho = the run's momentum) from the global weights x and returns y_i
with its step count. Its normalized update is ``d_i = (x - y_i) / a_i`` where ``a_i`` is the l1 norm of the
accumulation vector of its local solver (paper, Section 4 and Appendix for momentum):

    a_i = tau_i                                                    plain SGD (rho = 0)
    a_i = (tau_i - rho * (1 - rho^tau_i) / (1 - rho)) / (1 - rho)     momentum SGD

and the server steps ``x <- x - tau_eff * sum_i p_i d_i`` with ``tau_eff = sum_i p_i a_i`` and ``p_i`` the averaging
weights (data sizes, or uniform). With equal ``a_i`` this is FedAvg exactly. It is computed as FedAvg's average of the
rescaled models ``z_i = x - (tau_eff / a_i) (x - y_i)``, so the robust rules and clipping of
:mod:`fedge.aggregation.robust` apply to the normalized updates as they do to FedAvg's.

The step count is the client's report (:class:`FedNovaReport`); a peer's claim is bounded by what its declared data
size allows (``epochs * ceil(n_i / B)`` steps), so it cannot buy itself a larger share by under-reporting beyond that.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from fedge.algorithms.base import Algorithm, CheckedReply, UpdateReport, weights_traffic
from fedge.algorithms.fedavg import FedAvg, FedAvgClient, FedAvgSettings, LocalRound
from fedge.errors import CodecError
from fedge.learning.training import TrainStats
from fedge.types import ClientId
from fedge.wire.fields import bounded
from fedge.wire.message import Message


@dataclass(frozen=True)
class FedNovaSettings(FedAvgSettings):
    """FedAvg's (the server's averaging rules); the normalization needs no setting of its own."""


@dataclass(frozen=True)
class FedNovaReport(UpdateReport):
    local_steps: int = field(default=0, metadata=bounded(0, 10**9))


def accumulation_norm(steps: int, momentum: float) -> float:
    """``a_i``: the l1 norm of the local solver's accumulation vector after ``steps`` steps of momentum SGD."""
    if momentum == 0:
        return float(steps)
    rho = momentum
    return (steps - rho * (1 - rho**steps) / (1 - rho)) / (1 - rho)


class FedNova(FedAvg[FedNovaSettings]):
    """Server half: FedAvg's average of the clients' updates, each rescaled to the run's effective step count."""

    report_type = FedNovaReport

    def check_reply(self, rnd: int, client: ClientId, reply: Message) -> UpdateReport:
        report = super().check_reply(rnd, client, reply)
        assert isinstance(report, FedNovaReport)
        t = self.config.train
        most = t.local_epochs * math.ceil(report.num_examples / t.batch_size)
        if not 1 <= report.local_steps <= most:
            raise CodecError(
                f"the update reports {report.local_steps} local steps; {report.num_examples} examples in "
                f"{t.local_epochs} epochs of batch {t.batch_size} allow 1 to {most}"
            )
        return report

    def aggregate(self, rnd: int, replies: Mapping[ClientId, CheckedReply]) -> dict[str, float]:
        clients = sorted(replies)
        shares = self.averaging_weights([replies[c] for c in clients])
        total = sum(shares)
        momentum = self.config.train.momentum
        norms = [accumulation_norm(self._steps(replies[c]), momentum) for c in clients]
        tau_eff = sum(s / total * a for s, a in zip(shares, norms, strict=True))
        rescaled = {c: self._rescaled(replies[c], tau_eff / a) for c, a in zip(clients, norms, strict=True)}
        metrics = super().aggregate(rnd, rescaled)
        return {**metrics, "fednova_tau_eff": tau_eff}

    @staticmethod
    def _steps(reply: CheckedReply) -> int:
        report = reply.report
        assert isinstance(report, FedNovaReport)  # check_reply parsed it as report_type
        return report.local_steps

    def _rescaled(self, reply: CheckedReply, scale: float) -> CheckedReply:
        """``reply`` with its floating-point weights moved to ``x - scale * (x - y)``."""
        x = self._weights
        update = reply.update
        tensors = {
            k: (x[k] - scale * (x[k] - y)) if y.is_floating_point() else y for k, y in update.tensors.items() if k in x
        }
        return dataclasses.replace(reply, update=dataclasses.replace(update, tensors=tensors))


class FedNovaClient(FedAvgClient[FedNovaSettings]):
    """FedAvg's local training; the update also reports how many steps it took."""

    settings_type = FedNovaSettings

    def report(self, r: LocalRound[FedNovaSettings], stats: TrainStats) -> UpdateReport:
        return FedNovaReport(num_examples=len(r.data), loss=stats.mean_loss, local_steps=stats.steps)


ALGORITHM = Algorithm(
    name="fednova",
    label="FedNova",
    paper="Wang et al., NeurIPS 2020, Section 4 (normalized averaging)",
    settings=FedNovaSettings,
    server=FedNova,
    client=FedNovaClient(),
    traffic=weights_traffic,
    secagg_gap="FedNova rescales each client's update by that client's own step count before averaging; under secure "
    "aggregation each client would have to scale its own delta first, which is not built yet",
)
