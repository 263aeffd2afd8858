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

Under secure aggregation (:mod:`fedge.secagg.parts`) each client scales its own clipped move ``y_i - x`` by its
share ``(p_i / a_i) / Z`` (``Z = sum_i p_i / a_i`` over the round's replies; the server sends it with the share
delivery) before masking. The server learns ``S = sum_{U3} (p_i / a_i)(y_i - x) / Z`` over the survivors U3 and
steps ``x <- x + S Z tau_eff / P`` (``tau_eff``, ``P = sum p_i`` over U3): the step above over U3, from the sum alone
(:meth:`FedNova.secure_shares`, :meth:`FedNova.secure_scale`).

The step count is the client's report (:class:`FedNovaReport`); a peer's claim is bounded by what its declared data
size allows (``epochs * ceil(n_i / B)`` steps), so it cannot buy itself a larger share by under-reporting beyond that.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
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

    def report_of(self, reply: Message) -> UpdateReport:
        """Also bounds the step count by the declared data size (a remote party's report under secure aggregation,
        whose update the server never sees, is parsed here too)."""
        report = super().report_of(reply)
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

    def secure_shares(self, replies: Sequence[CheckedReply]) -> list[float]:
        """Under secure aggregation, each client's share before normalization: ``p_i / a_i``. The client scales its
        own clipped move ``y_i - x`` by it, so the secure sum is ``sum_i p_i (y_i - x) / a_i = -sum_i p_i d_i`` up to
        one constant (:meth:`secure_scale` restores it); its step count is in its report, in the clear."""
        momentum = self.config.train.momentum
        weights = self.averaging_weights(replies)
        return [p / accumulation_norm(self._steps(r), momentum) for p, r in zip(weights, replies, strict=True)]

    def secure_scale(self, survivors: Sequence[CheckedReply]) -> tuple[float, dict[str, float]]:
        """The factor on the survivors' secure mean ``sum (p_i/a_i) (y_i - x) / sum (p_i/a_i)`` that makes it
        FedNova's step ``tau_eff sum (p_i/P) (y_i - x) / a_i``: ``tau_eff sum (p_i/a_i) / P`` (P = sum p_i, all
        over the survivors); and tau_eff as the plaintext round reports it."""
        momentum = self.config.train.momentum
        weights = self.averaging_weights(survivors)
        norms = [accumulation_norm(self._steps(r), momentum) for r in survivors]
        total = sum(weights)
        tau_eff = sum(p / total * a for p, a in zip(weights, norms, strict=True))
        inverse = sum(p / a for p, a in zip(weights, norms, strict=True))
        return tau_eff * inverse / total, {"fednova_tau_eff": tau_eff}

    @staticmethod
    def _steps(reply: CheckedReply) -> int:
        report = reply.report
        assert isinstance(report, FedNovaReport)  # check_reply parsed it as report_type
        return report.local_steps

    def _rescaled(self, reply: CheckedReply, scale: float) -> CheckedReply:
        """``reply`` with its floating-point weights moved to ``x - scale * (x - y)``."""
        if scale == 1.0:  # equal step counts (or one reply, secure aggregation's): FedAvg, bit for bit
            return reply
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
    secagg_gap="",
    dp_gap="FedNova's step multiplies the normalised moves by tau_eff, the sampled cohort's mean step count: a second "
    "statistic of the clients' data (each step count follows from its data size) that no clip of the move bounds, "
    "and a public step count in its place would drop FedNova's normalisation (docs/privacy.md)",
)
