"""FedAvg (McMahan et al. 2017; FedNTD eq. 2; DS-FL eq. 1-3): broadcast the global weights, train locally with
cross-entropy, average the returned weights by data size.

This module also holds the weight-exchange flow that FedNTD, FedLSD, FedCAD, FedProx and SCAFFOLD reuse: their
modules subclass :class:`FedAvgClient` and override one hook (:meth:`FedAvgClient.objective` for a different loss,
:meth:`FedAvgClient.request` for a different training request, :meth:`FedAvgClient.report` for more reported numbers),
as Flower's FedProx overrides one method. The server half is one flow too: :meth:`FedAvg.aggregate` averages, then
:meth:`FedAvg.server_step` moves the model by the strategy's server optimizer (:mod:`fedge.aggregation.server_step`):
FedAdam overrides :meth:`FedAvg.server_optimizer` only, SCAFFOLD and FedDyn :meth:`FedAvg.server_step` to update their
own server state around it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import torch
import torch.nn.functional as F

from fedge.accounting.records import AggregationRecord, Drop
from fedge.aggregation.average import weighted_average
from fedge.aggregation.robust import (
    WEIGHT_RULES,
    UpdateNormHistory,
    check_rule,
    robust_average,
    state_norm,
    update_norm,
)
from fedge.aggregation.server_step import Plain, ServerOptimizer
from fedge.algorithms.base import (
    Algorithm,
    AlgorithmSettings,
    CheckedReply,
    ClientData,
    ClientHalf,
    ClientStore,
    Evaluation,
    LocalTraining,
    RoundPlan,
    ServerContext,
    Strategy,
    StrategyState,
    TensorSpec,
    UpdateReport,
    derive_seed,
    evaluate_model,
    tensors_like,
    update_message,
    weights_traffic,
)
from fedge.config import RunConfig
from fedge.errors import CodecError, ConfigError
from fedge.learning.backend import Backend
from fedge.learning.models import exchanged_state, load_exchanged_state
from fedge.learning.objectives import Objective
from fedge.learning.training import TrainRequest, TrainStats
from fedge.types import ClientId, StateDict
from fedge.wire.fields import server_only
from fedge.wire.message import Message

_WEIGHTS = "weights."  # the global weights in the server's saved state


@dataclass(frozen=True)
class FedAvgSettings(AlgorithmSettings):
    """How the server averages (all server-only): by data size (FedNTD eq. 2) or uniformly (FedNTD Algorithm 1), or
    robustly (:mod:`fedge.aggregation.robust`), and which updates it refuses outright."""

    weighting: str = field(
        default="weighted", metadata=server_only("aggregation: weighted (by data size, eq. 2) or uniform")
    )
    robust: str = field(
        default="mean",
        metadata=server_only(
            "mean (FedAvg), or coordinate-wise median or trimmed_mean of the updates, or flame (the majority cluster "
            "by cosine distance, clipped to the median update norm, averaged)"
        ),
    )
    trim_ratio: float = field(default=0.2, metadata=server_only("share trimmed at each end by trimmed_mean"))
    clip_factor: float = field(
        default=0.0,
        metadata=server_only(
            "clip each update to this many times the round's median update norm (0: off; default 0 in fedge sim, "
            "2 over a broker)"
        ),
    )
    max_update_ratio: float = field(
        default=10.0,
        metadata=server_only(
            "reject an update whose norm exceeds this many times the recent rounds' median update norm (the initial "
            "model's norm at arrival in round 1, then round 1's own median at aggregation; 0: off)"
        ),
    )
    noise_factor: float = field(
        default=0.0,
        metadata=server_only(
            "Gaussian noise added to the aggregate, this many times the round's median update norm (FLAME's lambda, "
            "0.001 in its paper; 0: none)"
        ),
    )

    def __post_init__(self) -> None:
        if self.weighting not in ("weighted", "uniform"):
            raise ConfigError(f"weighting must be weighted|uniform, not {self.weighting!r}")
        check_rule(self.robust, self.trim_ratio, WEIGHT_RULES)
        if not (self.clip_factor >= 0 and self.max_update_ratio >= 0 and self.noise_factor >= 0):
            raise ConfigError("clip_factor, max_update_ratio and noise_factor must be >= 0")


@dataclass(frozen=True)
class CrossEntropy(Objective):
    """Cross-entropy on the local labels (FedAvg; DS-FL eq. 1-2)."""

    kind = "ce"

    def loss(self, logits: torch.Tensor, y: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(logits, y)


FedAvgSettingsT = TypeVar("FedAvgSettingsT", bound=FedAvgSettings)
"""The settings of FedAvg or of an algorithm built on its flow (FedProx, FedNTD, SCAFFOLD, ...)."""


class FedAvg(Strategy[FedAvgSettingsT]):
    """Server half of the weight-exchange family: broadcast the global weights, average what comes back."""

    def __init__(self, config: RunConfig, context: ServerContext) -> None:
        super().__init__(config, context)
        self._model = self.model_factory()  # scratch module for evaluation
        self._weights: StateDict = exchanged_state(self._model)
        # The update bound's reference: before any round's median, the initial model's norm (no client set it) at
        # arrival; such a round is judged again at aggregation against its own median (calibrated).
        self._norms = UpdateNormHistory()
        self._initial_norm = max(state_norm(self._weights), 1.0)
        # Rounds judged against that fallback (round 1 of a fresh run): re-judged at aggregation against their own
        # median update norm, and who was left out then (handed to the round engine once).
        self._uncalibrated: set[int] = set()
        self._refused: dict[int, tuple[Drop, ...]] = {}
        self._optimizer = self.server_optimizer()
        self._measured_from: StateDict | None = None  # the model the update bound measures from, if not the current

    def global_weights(self) -> StateDict:
        return self._weights

    def apply_average(self, averaged: Mapping[str, torch.Tensor]) -> None:
        """Move the global model by this strategy's server optimizer to ``averaged``, a mean taken outside
        :meth:`aggregate`: FedBuff's buffered step (:mod:`fedge.aggregation.fedbuff`, driven by ``sim/fedbuff.py``),
        for a strategy whose :meth:`server_step` needs no replies. ConfigError when the tensors do not fit the
        model's."""
        self._weights = self._optimizer.step(self._weights, tensors_like(averaged, "", self._weights))

    def state(self) -> StrategyState:
        tensors = {**{_WEIGHTS + k: v for k, v in self._weights.items()}, **self._optimizer.state()}
        # Rounds judged without a median: FedBuff's buffer carries their updates across a kill, to be judged again at
        # the step (refused_moves); a synchronous round's are judged again when the round is played again.
        return tensors, {"update_norm_medians": list(self._norms.medians), "uncalibrated": sorted(self._uncalibrated)}

    def load_state(self, tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any]) -> None:
        self._weights = tensors_like(tensors, _WEIGHTS, self._weights)
        self._optimizer.load_state(tensors)
        medians = values.get("update_norm_medians", [])
        if not (isinstance(medians, list) and all(isinstance(m, float) and math.isfinite(m) for m in medians)):
            raise ConfigError("the saved state's update_norm_medians must be a list of finite numbers")
        self._norms = UpdateNormHistory(medians=medians[-self._norms.window :])
        uncalibrated = values.get("uncalibrated", [])
        if not (isinstance(uncalibrated, list) and all(type(r) is int and r > 0 for r in uncalibrated)):
            raise ConfigError("the saved state's uncalibrated rounds must be a list of round numbers")
        self._uncalibrated = set(uncalibrated)

    def reply_tensors(self) -> dict[str, TensorSpec]:
        return {k: (tuple(v.shape), v.dtype) for k, v in self._weights.items()}

    def check_reply(self, rnd: int, client: ClientId, reply: Message) -> UpdateReport:
        """Also refuses an update that moves the model absurdly far (finite values near 3e38, a scaled model).

        The bound is ``max_update_ratio`` x a reference no single client can inflate (:class:`UpdateNormHistory`),
        not the global model's norm: an accepted update that grew the model would raise that bound for the attacker
        and push every honest update of the moved model above it.
        """
        report = super().check_reply(rnd, client, reply)
        ratio = self.settings.max_update_ratio
        if ratio > 0:
            reference = self._norms.reference(rnd, self._initial_norm)
            if not self._norms.medians:
                self._uncalibrated.add(rnd)
            base = self._weights if self._measured_from is None else self._measured_from
            moved = update_norm({k: reply.tensors[k] for k in self._weights}, base)
            self._norms.observe(rnd, client, moved)
            if not moved <= ratio * reference:  # also catches an overflow to inf
                raise CodecError(
                    f"the update moves the model by {moved:.3g}, more than {ratio:g} x the reference update norm "
                    f"({reference:.3g}, the recent rounds' median); refused"
                )
        return report

    def accept_from(self, base: StateDict, rnd: int, client: ClientId, reply: Message) -> CheckedReply:
        """:meth:`accept`, with the update bound measuring the reply's move from ``base``, the model its task sent,
        rather than from the current one: FedBuff over MQTT judges a reply when it arrives, steps after its task."""
        self._measured_from = base
        try:
            return self.accept(rnd, client, reply)
        finally:
            self._measured_from = None

    def configure(self, rnd: int, clients: Sequence[ClientId]) -> RoundPlan:
        return RoundPlan(broadcast=self.broadcast(rnd, self._weights), tasks={c: self.task(rnd, c) for c in clients})

    def averaging_weights(self, replies: Sequence[CheckedReply]) -> list[float]:
        """Each reply's share of the average: its data size (eq. 2), or equal shares."""
        if self.settings.weighting == "uniform":
            return [1.0] * len(replies)
        return [float(r.report.num_examples) for r in replies]

    def calibrated(self, rnd: int, replies: Mapping[ClientId, CheckedReply]) -> dict[ClientId, CheckedReply]:
        """``replies`` less those of a round judged without history (round 1) that the round's own median would
        refuse: more than ``max_update_ratio`` x the median update norm of the round's replies, a reference the
        honest majority sets and a minority cannot move. So nothing passes in round 1 that would be refused in
        round 2. The refused become drops of the round (:meth:`aggregation_record`)."""
        if not self._calibrating(rnd, len(replies)):
            return dict(replies)
        norms = {
            c: update_norm({k: r.update.tensors[k] for k in self._weights}, self._weights) for c, r in replies.items()
        }
        self._refused[rnd] = self._refusals(rnd, norms)
        refused = {d.client for d in self._refused[rnd]}
        return {c: r for c, r in replies.items() if c not in refused}

    def refused_moves(self, rnd: int, norms: Mapping[ClientId, float]) -> tuple[Drop, ...]:
        """:meth:`calibrated` for updates aggregated outside :meth:`aggregate` (FedBuff's buffer): given the norms of
        updates to round ``rnd``'s tasks (each measured from the model its task sent), those round ``rnd``'s own median
        refuses, as drops, when ``rnd`` was judged without history; () otherwise, and for ``rnd`` from then on."""
        return self._refusals(rnd, norms) if self._calibrating(rnd, len(norms)) else ()

    def _calibrating(self, rnd: int, voters: int) -> bool:
        """Whether round ``rnd``'s replies, ``voters`` of them, are judged again by their own median (once)."""
        due = rnd in self._uncalibrated and self.settings.max_update_ratio > 0 and voters >= self._norms.min_voters
        self._uncalibrated.discard(rnd)
        return due

    def _refusals(self, rnd: int, norms: Mapping[ClientId, float]) -> tuple[Drop, ...]:
        ratio = self.settings.max_update_ratio
        median = statistics.median(norms.values())
        return tuple(
            Drop(
                c,
                f"refused: the update moves the model by {norms[c]:.3g}, more than {ratio:g} x the round's median "
                f"update norm ({median:.3g}; round {rnd} has no earlier round to judge by)",
            )
            for c in sorted(norms)
            if not norms[c] <= ratio * median
        )

    def aggregation_record(self, rnd: int) -> AggregationRecord:
        """The clients :meth:`calibrated` left out of round ``rnd``, as drops."""
        return AggregationRecord(drops=self._refused.pop(rnd, ()))

    def noise_generator(self, rnd: int) -> torch.Generator:
        """The generator of round ``rnd``'s aggregation noise, from (seed, round): a resumed run draws the same."""
        return torch.Generator().manual_seed(derive_seed(self.config.seed, "aggregation-noise", rnd))

    def aggregate(self, rnd: int, replies: Mapping[ClientId, CheckedReply]) -> dict[str, float]:
        replies = self.calibrated(rnd, replies)
        ordered = [replies[c] for c in sorted(replies)]  # order-independent result, whatever arrived first
        states = [{k: r.update.tensors[k] for k in self._weights} for r in ordered]
        s = self.settings
        if s.robust == "mean" and s.clip_factor == 0 and s.noise_factor == 0:
            averaged = weighted_average(states, self.averaging_weights(ordered))
        else:
            averaged = robust_average(
                states,
                self.averaging_weights(ordered),
                self._weights,
                rule=s.robust,
                trim_ratio=s.trim_ratio,
                clip_factor=s.clip_factor,
                noise_factor=s.noise_factor,
                generator=self.noise_generator(rnd),
            )
        self._weights = self.server_step(averaged, replies)
        losses = [loss for r in ordered if (loss := r.report.loss) is not None]
        return {"mean_local_loss": sum(losses) / len(losses)} if losses else {}

    def server_optimizer(self) -> ServerOptimizer:
        """The optimizer of :meth:`server_step`, built once with the strategy: FedAvg's is the average itself."""
        return Plain()

    def server_step(self, averaged: StateDict, replies: Mapping[ClientId, CheckedReply]) -> StateDict:
        """The next global weights from the current ones (``self._weights``) and the round's ``averaged`` model: the
        server optimizer's step. An algorithm with server state of its own (SCAFFOLD's control variates, FedDyn's
        ``h``) overrides this to update it from the aggregated ``replies`` around that step."""
        return self._optimizer.step(self._weights, averaged)

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> Evaluation:
        load_exchanged_state(self._model, self._weights)
        return evaluate_model(self._model, x, y, self.num_classes, device=self.evaluation_device)


@dataclass(frozen=True)
class LocalRound(Generic[FedAvgSettingsT]):
    """Everything one client's round works with, handed to the hooks of :class:`FedAvgClient`."""

    training: LocalTraining
    settings: FedAvgSettingsT  # the algorithm's settings, as the task carried them
    data: ClientData
    backend: Backend  # holds the received global weights until training starts
    store: ClientStore
    broadcast: Message
    global_weights: StateDict
    task: Message  # the round's task, for an algorithm's own fields (FedCurv's under secure aggregation)


class FedAvgClient(ClientHalf[FedAvgSettingsT]):
    """Client half: start from the broadcast weights, train on the local objective, return the new weights."""

    settings_type: ClassVar[type[AlgorithmSettings]] = FedAvgSettings

    def step(
        self, task: Message, broadcast: Message | None, data: ClientData, backend: Backend, store: ClientStore
    ) -> Message:
        training, settings = self.parse(task)
        if broadcast is None:
            raise CodecError("a weight-exchange task needs the round's broadcast of global weights")
        global_weights = self.received_weights(broadcast)
        backend.set_weights(global_weights)
        r = LocalRound(training, settings, data, backend, store, broadcast, global_weights, task)
        stats = backend.train(self.request(r))
        tensors = self.upload(r, backend.get_weights(), stats)
        return update_message(task, tensors, self.report(r, stats))

    # --- hooks ---------------------------------------------------------------------------------------------------
    def objective(self, r: LocalRound[FedAvgSettingsT]) -> tuple[Objective, dict[str, torch.Tensor]]:
        """The local loss and its inputs; ``r.backend`` holds the received global weights (the teacher, if any)."""
        return CrossEntropy(), {}

    def request(self, r: LocalRound[FedAvgSettingsT]) -> TrainRequest:
        """The local training this client runs this round."""
        objective, inputs = self.objective(r)
        t = r.training
        request = t.request(r.data.x, r.data.y, objective, inputs)
        if any(spec.name == "teacher" for spec in objective.inputs):
            # The received global model (r.backend, before training) sees the augmented batches the student sees.
            request = request.with_batch_logits("teacher", r.backend.logits)
        return request

    def received_weights(self, broadcast: Message) -> StateDict:
        """The global weights in the round's broadcast."""
        return dict(broadcast.tensors)

    def upload(self, r: LocalRound[FedAvgSettingsT], weights: StateDict, stats: TrainStats) -> dict[str, torch.Tensor]:
        """The tensors of the update, from the weights after local training."""
        return weights

    def report(self, r: LocalRound[FedAvgSettingsT], stats: TrainStats) -> UpdateReport:
        """The numbers the update reports besides its tensors (an instance of the server half's ``report_type``)."""
        return UpdateReport(num_examples=len(r.data), loss=stats.mean_loss)


ALGORITHM = Algorithm(
    name="fedavg",
    label="FedAvg",
    paper="McMahan et al. 2017; FedNTD eq. 2; DS-FL eq. 1-3",
    settings=FedAvgSettings,
    server=FedAvg,
    client=FedAvgClient[FedAvgSettings](),
    traffic=weights_traffic,
    secagg_gap="",
    objectives=(CrossEntropy,),
)
