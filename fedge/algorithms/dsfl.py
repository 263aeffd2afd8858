"""Distillation-based semi-supervised FL (DS-FL; Itahara et al., IEEE TMC, sec. 2.3 and 3, Algorithm 1).

Every client and the server hold the same unlabeled open set (provisioned once, its cost ComU@I counted apart).
Each round the server picks an index set o_r of the open set; clients update on their private data (eq. 1), predict
softmax outputs on o_r (eq. 9) and upload them; the server aggregates them into global soft labels with SA (mean,
eq. 16) or ERA (softmax of the mean at temperature T, eq. 13-15), distills its global model on them (eq. 11) and
broadcasts them; clients distill on them too (eq. 10).

Under secure aggregation (:mod:`fedge.secagg.parts`) each client masks its soft labels on o_r (as sent, times its
equal share 1/K, each value in [0, 1] within the ring's bound); the server learns their sum over the survivors U3 and
divides by ``|U3| / K``: SA's mean over U3 (eq. 16), which ERA sharpens (eq. 13) and the server distills on, as in
the clear. Its check that each upload is a probability row needs the upload: it runs in the simulator (where the
replies are at hand), not at a coordinator, which sees only the sum; there the encoding's clip of each value to the
ring's bound is what bounds one client's pull.

The index set travels as a seed both sides expand (zero tensor bytes), so the traffic per round is exactly the
paper's: K uploads of |o_r| x C plus one broadcast of |o_r| x C. Rounds are pipelined into one exchange each: the
task of round r carries round r-1's global soft labels, and the client distills on them before its update of round r,
which keeps the paper's order of steps (U, P, D, U, P, D, ...).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedge.aggregation.average import aggregate_era, aggregate_sa
from fedge.aggregation.robust import check_rule, robust_rows
from fedge.algorithms.base import (
    Algorithm,
    AlgorithmSettings,
    CheckedReply,
    ClientData,
    ClientHalf,
    ClientStore,
    CostInputs,
    Evaluation,
    RoundPlan,
    RoundTraffic,
    ServerContext,
    Strategy,
    StrategyState,
    TensorSpec,
    UpdateReport,
    derive_seed,
    evaluate_model,
    keep_own_model,
    restore_own_model,
    tensors_like,
    update_message,
)
from fedge.algorithms.fedavg import CrossEntropy
from fedge.config import RunConfig
from fedge.errors import CodecError, ConfigError
from fedge.learning.backend import Backend
from fedge.learning.losses import soft_cross_entropy
from fedge.learning.metrics import mean_entropy
from fedge.learning.models import exchanged_state
from fedge.learning.objectives import Objective, ObjectiveInput
from fedge.learning.training import SGDSettings, TrainRequest, train
from fedge.secagg.parts import SecurePart
from fedge.types import ClientId
from fedge.wire import fields as wire
from fedge.wire.fields import bounded, server_only
from fedge.wire.message import Message

_SEED = bounded(0, 2**31 - 1)
_MODEL = "model."  # the global model in the server's saved state


@dataclass(frozen=True)
class DSFLSettings(AlgorithmSettings):
    aggregation: str = field(default="era", metadata=server_only("era (eq. 13) or sa (eq. 16)"))
    era_temperature: float = field(default=0.1, metadata=server_only("ERA temperature T, eq. 13"))
    open_per_round: int = field(default=1_000, metadata=bounded(1, 10_000_000, help="|o_r|, open samples per round"))
    distill_epochs: int = field(default=2, metadata=bounded(0, 10_000, help="epochs of distillation, eq. 10-11"))
    distill_lr: float = field(default=0.1, metadata=bounded(0.0, 1e3, help="learning rate of the distillation"))
    distill_batch_size: int = field(default=100, metadata=bounded(1, 1_000_000, help="batch size of the distillation"))
    robust: str = field(
        default="mean",
        metadata=server_only("mean (eq. 16), or median or trimmed_mean of the uploads per sample and class"),
    )
    trim_ratio: float = field(default=0.2, metadata=server_only("share trimmed at each end by trimmed_mean"))
    server_distill: bool = field(default=True, metadata=server_only("the server's global model distills too, eq. 11"))

    def __post_init__(self) -> None:
        if self.aggregation not in ("era", "sa"):
            raise ConfigError(f"aggregation must be era|sa, not {self.aggregation!r}")
        if not self.era_temperature > 0:
            raise ConfigError("era_temperature must be > 0")
        if self.open_per_round < 1:
            raise ConfigError("open_per_round must be >= 1")
        if not (self.distill_epochs >= 0 and self.distill_lr > 0):
            raise ConfigError("distill_epochs >= 0 and distill_lr > 0 required")
        if self.distill_batch_size < 1:
            raise ConfigError("distill_batch_size must be >= 1")
        check_rule(self.robust, self.trim_ratio)


@dataclass(frozen=True)
class DSFLTask:
    model_seed: int = field(metadata=_SEED)  # common initialization of every client's own model
    index_seed: int = field(metadata=_SEED)  # expands to o_r of this round
    open_size: int = field(metadata=bounded(1, 100_000_000))  # the open set the seed indexes into
    distill_seed: int = field(metadata=_SEED)  # batch order of the distillation on the previous round's labels


@dataclass(frozen=True)
class DSFLBroadcast:
    source_round: int = field(metadata=_SEED)  # the round whose uploads these soft labels aggregate
    index_seed: int = field(metadata=_SEED)  # o_r of that round
    open_size: int = field(metadata=bounded(1, 100_000_000))
    open_per_round: int = field(metadata=bounded(1, 10_000_000))


@dataclass(frozen=True)
class SoftTargets(Objective):
    """Cross-entropy to soft labels (DS-FL eq. 10-11)."""

    kind = "soft"
    inputs = (ObjectiveInput("targets", per_sample=True, shape=("C",)),)

    def loss(self, logits: torch.Tensor, y: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return soft_cross_entropy(logits, inputs["targets"])


def open_index_set(open_size: int, per_round: int, seed: int) -> np.ndarray:
    """o_r: ``per_round`` distinct indices into the open set, expanded from a seed identically on every side."""
    if per_round > open_size:
        raise ConfigError(f"open_per_round ({per_round}) exceeds the open set ({open_size} samples)")
    return np.sort(np.random.default_rng(seed).choice(open_size, size=per_round, replace=False))


class DistillationSemiSupervised(Strategy[DSFLSettings]):
    """Server half of DS-FL: aggregate soft labels, distill the global model, broadcast."""

    def __init__(self, config: RunConfig, context: ServerContext) -> None:
        super().__init__(config, context)
        if context.open_x is None:
            raise ConfigError("DS-FL needs an open dataset on the server")
        self.open_x = context.open_x
        self._model = self.model_factory()  # the global model w_g (eq. 11)
        self._soft_labels: torch.Tensor | None = None  # global soft labels of the latest round
        self._soft_round = 0
        if self.settings.open_per_round > len(self.open_x):
            raise ConfigError(
                f"open_per_round ({self.settings.open_per_round}) exceeds the open set ({len(self.open_x)} samples)"
            )

    def index_seed(self, rnd: int) -> int:
        return derive_seed(self.config.seed, "open-index", rnd)

    def reply_tensors(self) -> dict[str, TensorSpec]:
        return {"soft_labels": ((self.settings.open_per_round, self.num_classes), torch.float32)}

    def check_reply(self, rnd: int, client: ClientId, reply: Message) -> UpdateReport:
        report = super().check_reply(rnd, client, reply)
        probs = reply.tensors["soft_labels"]  # (|o_r|, C): softmax outputs, eq. 9
        slack = 1e-3 + self.num_classes * self.reply_tolerance  # compressed uploads: each entry within its bound
        if bool((probs < 0).any()) or not bool(((probs.sum(dim=1) - 1).abs() < slack).all()):
            raise CodecError("soft_labels rows must be probability vectors (non-negative, summing to 1)")
        return report

    def global_weights(self) -> dict[str, torch.Tensor]:
        return exchanged_state(self._model)

    def state(self) -> StrategyState:
        tensors = {_MODEL + k: v for k, v in self._model.state_dict().items()}  # all of it, num_batches_tracked too
        if self._soft_labels is not None:
            tensors["soft_labels"] = self._soft_labels
        return tensors, {"soft_round": self._soft_round}

    def load_state(self, tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any]) -> None:
        self._model.load_state_dict(tensors_like(tensors, _MODEL, self._model.state_dict()))
        self._soft_labels, self._soft_round = None, int(values.get("soft_round", 0))
        if "soft_labels" in tensors:
            like = {"soft_labels": torch.zeros(self.settings.open_per_round, self.num_classes)}
            self._soft_labels = tensors_like(tensors, "", like)["soft_labels"]

    def configure(self, rnd: int, clients: Sequence[ClientId]) -> RoundPlan:
        s = self.settings
        broadcast = None
        if self._soft_labels is not None:
            source = DSFLBroadcast(
                source_round=self._soft_round,
                index_seed=self.index_seed(self._soft_round),
                open_size=len(self.open_x),
                open_per_round=s.open_per_round,
            )
            broadcast = self.broadcast(rnd, {"soft_labels": self._soft_labels}, source)
        task = DSFLTask(
            model_seed=derive_seed(self.config.seed, "model"),
            index_seed=self.index_seed(rnd),
            open_size=len(self.open_x),
            distill_seed=derive_seed(self.config.seed, "distill", rnd),
        )
        return RoundPlan(broadcast=broadcast, tasks={c: self.task(rnd, c, task) for c in clients})

    def aggregate(self, rnd: int, replies: Mapping[ClientId, CheckedReply]) -> dict[str, float]:
        s = self.settings
        uploads = [replies[c].update.tensor("soft_labels") for c in sorted(replies)]
        if s.robust != "mean":
            # Median or trimmed mean per sample and class, rows renormalized: it takes the place of eq. 16's mean,
            # which ERA (eq. 13) then sharpens, so a few confidently wrong uploads cannot set the labels.
            uploads = [robust_rows(uploads, rule=s.robust, trim_ratio=s.trim_ratio)]
        soft = (
            aggregate_era(uploads, temperature=s.era_temperature) if s.aggregation == "era" else aggregate_sa(uploads)
        )
        self._soft_labels, self._soft_round = soft.to(torch.float32).contiguous(), rnd
        if s.server_distill and s.distill_epochs > 0:
            idx = torch.from_numpy(open_index_set(len(self.open_x), s.open_per_round, self.index_seed(rnd)))
            x = self.open_x[idx]
            sgd = SGDSettings(s.distill_lr, self.config.train.momentum, self.config.train.weight_decay)
            request = TrainRequest(
                x,
                torch.zeros(len(x), dtype=torch.long),  # unused by the soft-label loss
                SoftTargets(),
                sgd,
                s.distill_epochs,
                s.distill_batch_size,
                derive_seed(self.config.seed, "server-distill", rnd),
                inputs={"targets": self._soft_labels},
            )
            train(self._model, request)
        return {"global_logit_entropy": float(mean_entropy(self._soft_labels.numpy()))}

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> Evaluation:
        return evaluate_model(self._model, x, y, self.num_classes, device=self.evaluation_device)

    def secure_parts(self) -> tuple[SecurePart, ...]:
        """Under secure aggregation (:mod:`fedge.secagg.parts`): the soft labels as sent, each weighted by the
        client's equal share (eq. 16 is an unweighted mean), clipped per value (they are probabilities, in [0, 1])."""
        return (SecurePart(("soft_labels",), relative=False, weighted=True, value_bound=1.0),)

    def secure_shares(self, replies: Sequence[CheckedReply]) -> list[float]:
        """Equal shares: the survivors' secure sum over their count is SA's mean (eq. 16), which ERA sharpens."""
        return [1.0] * len(replies)


class DSFLClient(ClientHalf[DSFLSettings]):
    """Client half: distill on the previous round's global soft labels, update on private data, predict on o_r."""

    settings_type = DSFLSettings

    def step(
        self, task: Message, broadcast: Message | None, data: ClientData, backend: Backend, store: ClientStore
    ) -> Message:
        training, settings = self.parse(task)
        extra = wire.from_params(DSFLTask, task.params, defaults=False)
        if data.open_x is None:
            raise ConfigError("DS-FL needs the open dataset on the client (provision it with the client's data)")
        if extra.open_size != len(data.open_x):
            raise ConfigError(
                f"the coordinator's open set has {extra.open_size} samples, this client's has {len(data.open_x)}"
            )
        restore_own_model(store, backend, extra.model_seed)
        if broadcast is not None:  # eq. 10 for the previous round
            source = wire.from_params(DSFLBroadcast, broadcast.params, defaults=False)
            if source.open_size != len(data.open_x):
                raise CodecError(
                    f"broadcast indexes an open set of {source.open_size}, this client's has {len(data.open_x)}"
                )
            idx = open_index_set(source.open_size, source.open_per_round, source.index_seed)
            x = data.open_x[torch.from_numpy(idx)]
            sgd = SGDSettings(settings.distill_lr, training.momentum, training.weight_decay)
            targets = broadcast.tensor("soft_labels")
            backend.train(
                TrainRequest(
                    x,
                    torch.zeros(len(x), dtype=torch.long),  # unused by the soft-label loss
                    SoftTargets(),
                    sgd,
                    settings.distill_epochs,
                    settings.distill_batch_size,
                    extra.distill_seed,
                    inputs={"targets": targets},
                )
            )
        stats = backend.train(training.request(data.x, data.y, CrossEntropy()))
        idx = open_index_set(extra.open_size, settings.open_per_round, extra.index_seed)
        probs = torch.softmax(backend.logits(data.open_x[torch.from_numpy(idx)]), dim=1)  # eq. 9, (|o_r|, C)
        keep_own_model(store, backend)
        report = UpdateReport(num_examples=len(data), loss=stats.mean_loss)
        return update_message(task, {"soft_labels": probs.to(torch.float32).contiguous()}, report)


def dsfl_traffic(inputs: CostInputs) -> RoundTraffic:
    """|o_r| x C outputs each way (eq. 9, 13); the index set travels as a seed and adds no tensor bytes."""
    size = inputs.open_per_round * inputs.num_classes * 4
    return RoundTraffic(up_per_client=size, down_broadcast=size)


ALGORITHM = Algorithm(
    name="dsfl",
    label="DS-FL",
    paper="Itahara et al., IEEE TMC, sec. 2.3 and 3, Algorithm 1",
    settings=DSFLSettings,
    server=DistillationSemiSupervised,
    client=DSFLClient(),
    traffic=dsfl_traffic,
    exchange="outputs",
    needs_open_set=True,
    describe=lambda s: (f"T={s.era_temperature:g}, " if s.aggregation == "era" else "") + f"|o_r|={s.open_per_round}",
    secagg_gap="",
    dp_gap="DS-FL uploads soft labels, not weights",
    objectives=(SoftTargets,),
)
