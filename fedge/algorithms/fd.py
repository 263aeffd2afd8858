"""Federated distillation (FD), the DS-FL paper's second benchmark (DS-FL sec. 2.2, eq. 4-7; Jeong et al. 2018).

Clients keep their own models. Each round a client uploads its per-class mean softmax output (C x C, a zero row for a
class it has no sample of; eq. 4). The server averages each class over the clients that hold it (eq. 5) and
broadcasts the result with the number of contributors per class. A client then distills toward the leave-one-out
average of the *other* clients (eq. 6) with CE + gamma * soft-CE (eq. 7).

Rounds are pipelined so each round is one exchange: round 1 is the plain update (eq. 1); in round r > 1 the client
first distills on round r-1's broadcast, then uploads. The order of steps is the paper's: U, P, D, P, D, ...
FD has no global model: a round's accuracy is the mean over its clients of what they measure on their test data.

Under secure aggregation (:mod:`fedge.secagg.parts`) the server needs eq. 5's per-class sums and counts only: each
client masks its C x C outputs (zero rows for absent classes) and a C-vector of per-class holds (1 where it has a
sample of the class, 0 elsewhere; uploaded only then, ``class_holds``), both as sent and unweighted, clipped per value
(probabilities and indicators lie in [0, 1]). The server learns ``S_n = sum_{U3} t_k,n`` and ``|K_n ∩ U3|`` and
broadcasts their quotient and the counts as in the clear. Eq. 6's leave-one-out needs no more: each client subtracts
its own row from ``|K_n| t_g,n`` itself (:func:`fd_leave_one_out`).

A client subtracts its own outputs only from an average that holds them. Each task with a broadcast says whether the
client's upload of the broadcast's source round is in that average (``in_sums``; in the clear too: the server knows
whose replies it averaged, U3 under secure aggregation, and a client whose reply was dropped, refused or vanished in
the protocol does not). The broadcast names its source round, older than ``r - 1`` after rounds without a quorum, so a
client keeps two uploads: its last one and the one the last broadcast it saw averaged (:func:`own_upload_in`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedge.aggregation.average import fd_global_logits, fd_leave_one_out
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
    keep_own_model,
    restore_own_model,
    tensors_like,
    update_message,
)
from fedge.algorithms.fedavg import CrossEntropy
from fedge.config import RunConfig
from fedge.errors import CodecError, ConfigError
from fedge.learning.backend import Backend
from fedge.learning.losses import fd_distillation_loss
from fedge.learning.objectives import Objective, ObjectiveInput
from fedge.secagg.parts import SecurePart
from fedge.types import ClientId
from fedge.wire import fields as wire
from fedge.wire.fields import bounded
from fedge.wire.message import Message

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FDSettings(AlgorithmSettings):
    fd_gamma: float = field(
        default=1.0, metadata=bounded(0.0, 1e3, help="weight gamma of the distillation term, eq. 7")
    )

    def __post_init__(self) -> None:
        if not self.fd_gamma >= 0:
            raise ConfigError(f"fd_gamma must be >= 0, got {self.fd_gamma}")


CLASS_HOLDS = "class_holds"
"""Under secure aggregation, beside ``class_probs``: (C,) 1.0 where the client holds a sample of the class, else 0."""


@dataclass(frozen=True)
class FDTask:
    model_seed: int = field(metadata=bounded(0, 2**31 - 1))  # common initialization of every client's own model
    # Under secure aggregation only (absent in the clear): upload CLASS_HOLDS too (the server cannot read the holders
    # off zero rows it never sees).
    secure: bool | None = None
    # With a broadcast: whether this client's upload of the broadcast's source round is in its average (None: unknown,
    # a server resumed from an older journal; the client then assumes so if it uploaded in that round).
    in_sums: bool | None = None


@dataclass(frozen=True)
class FDBroadcast:
    source_round: int = field(metadata=bounded(0, 2**31 - 1))  # the round whose uploads were averaged


@dataclass(frozen=True)
class FDReport(UpdateReport):
    """The update's numbers plus the client's per-class test counts (FD has no global model to test)."""

    eval_correct: tuple[int, ...] = ()
    eval_total: tuple[int, ...] = ()


@dataclass(frozen=True)
class FDDistillation(Objective):
    """DS-FL eq. 7: CE + gamma * soft-CE to each sample's leave-one-out target; masked rows get CE only."""

    kind = "fd"
    inputs = (
        ObjectiveInput("targets", per_sample=True, shape=("C",)),
        ObjectiveInput("mask", per_sample=True, shape=(), dtype=torch.bool),
    )
    gamma: float = 1.0

    def loss(self, logits: torch.Tensor, y: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return fd_distillation_loss(logits, y, inputs["targets"], gamma=self.gamma, mask=inputs["mask"])


class FederatedDistillation(Strategy[FDSettings]):
    """Server half of FD: per-class averaging of the uploaded per-class outputs."""

    report_type = FDReport

    def __init__(self, config: RunConfig, context: ServerContext) -> None:
        super().__init__(config, context)
        self._global: torch.Tensor | None = None  # (C, C) from the latest round
        self._contributors: torch.Tensor | None = None  # (C,) int32
        self._last_eval: Evaluation | None = None
        self._source: int | None = None  # the round whose uploads _global averages (None: unknown, an old journal)
        self._secure = config.secure_aggregation
        # The clients whose uploads _global averages (U3 under secure aggregation); None: unknown (an older journal).
        self._in_sums: frozenset[ClientId] | None = frozenset()
        self._survivors: Mapping[ClientId, UpdateReport] = {}  # secure: this round's U3 and their reports

    def state(self) -> StrategyState:
        tensors: dict[str, torch.Tensor] = {}
        values: dict[str, Any] = {}
        if self._global is not None and self._contributors is not None:
            tensors.update(global_probs=self._global, contributors=self._contributors)
        if self._last_eval is not None:  # the accuracy a round without a quorum reports again
            tensors["last_eval.per_class"] = torch.from_numpy(self._last_eval.per_class)
            values["last_eval_accuracy"] = self._last_eval.accuracy
        if self._source is not None:
            values["source_round"] = self._source
        if self._in_sums is not None:
            values["in_sums"] = sorted(self._in_sums)
        return tensors, values

    def load_state(self, tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any]) -> None:
        c = self.num_classes
        self._global = self._contributors = self._last_eval = None
        source, in_sums = values.get("source_round"), values.get("in_sums")
        if not (source is None or isinstance(source, int)):
            raise ConfigError("the saved state's source_round must be an integer")
        if not (in_sums is None or (isinstance(in_sums, list) and all(isinstance(c, str) for c in in_sums))):
            raise ConfigError("the saved state's in_sums must be a list of client ids")
        self._source, self._in_sums = source, None if in_sums is None else frozenset(in_sums)
        if "global_probs" in tensors:
            like = {"global_probs": torch.zeros(c, c), "contributors": torch.zeros(c, dtype=torch.int32)}
            restored = tensors_like(tensors, "", like)
            self._global, self._contributors = restored["global_probs"], restored["contributors"]
        if "last_eval_accuracy" in values:
            per_class = tensors_like(tensors, "last_eval.", {"per_class": torch.zeros(c, dtype=torch.float64)})
            self._last_eval = Evaluation(float(values["last_eval_accuracy"]), per_class["per_class"].numpy().copy())

    def reply_tensors(self) -> dict[str, TensorSpec]:
        c = self.num_classes
        holds = {CLASS_HOLDS: ((c,), torch.float32)} if self._secure else {}
        return {"class_probs": ((c, c), torch.float32), **holds}

    def check_reply(self, rnd: int, client: ClientId, reply: Message) -> UpdateReport:
        report = super().check_reply(rnd, client, reply)
        probs = reply.tensors["class_probs"]  # (C, C): probability rows, or zero rows for absent classes
        sums = probs.sum(dim=1)
        slack = 1e-3 + self.num_classes * self.reply_tolerance  # compressed uploads: each entry within its bound
        if bool((probs < 0).any()) or not bool(((sums - 1).abs() < slack).logical_or(sums == 0).all()):
            raise CodecError("class_probs rows must be probability vectors (or zero rows for absent classes)")
        if self._secure and not torch.equal(reply.tensors[CLASS_HOLDS], (sums > 0).to(torch.float32)):
            raise CodecError(f"{CLASS_HOLDS} must be 1 for the classes with a probability row, 0 for the zero rows")
        assert isinstance(report, FDReport)
        for counts in (report.eval_correct, report.eval_total):
            if counts and len(counts) != self.num_classes:
                raise CodecError(f"evaluation counts must have {self.num_classes} entries, got {len(counts)}")
        return report

    def configure(self, rnd: int, clients: Sequence[ClientId]) -> RoundPlan:
        broadcast = None
        if self._global is not None and self._contributors is not None:
            tensors = {"global_probs": self._global, "contributors": self._contributors}
            source = rnd - 1 if self._source is None else self._source  # older than rnd - 1 after a skipped round
            broadcast = self.broadcast(rnd, tensors, FDBroadcast(source_round=source))
        seed, secure, kept = derive_seed(self.config.seed, "model"), self._secure or None, self._in_sums
        told = {c: None if broadcast is None or kept is None else c in kept for c in clients}
        tasks = {c: self.task(rnd, c, FDTask(seed, secure=secure, in_sums=told[c])) for c in clients}
        return RoundPlan(broadcast=broadcast, tasks=tasks)

    def aggregate(self, rnd: int, replies: Mapping[ClientId, CheckedReply]) -> dict[str, float]:
        ordered = [replies[c] for c in sorted(replies)]
        self._source = rnd
        if self._secure:  # one reply standing for the survivors U3: eq. 5's sums
            (stand_in,) = ordered
            self._global, self._contributors = secure_class_average(
                stand_in.update.tensor("class_probs"), stand_in.update.tensor(CLASS_HOLDS), len(self._survivors)
            )
            self._in_sums = frozenset(self._survivors)
            self._last_eval = pooled_local_eval(list(self._survivors.values()), self.num_classes)
            return {}
        probs = [r.update.tensor("class_probs") for r in ordered]
        # A zero row marks a class the client has no sample of (eq. 4): softmax rows are strictly positive.
        counts = [(p.abs().sum(dim=1) > 0).to(torch.int64) for p in probs]
        g, k = fd_global_logits(probs, counts)
        self._global = g.to(torch.float32)
        self._contributors = k.to(torch.int32)
        self._in_sums = frozenset(replies)
        self._last_eval = pooled_local_eval([r.report for r in ordered], self.num_classes)
        return {}

    def secure_parts(self) -> tuple[SecurePart, ...]:
        """Under secure aggregation (:mod:`fedge.secagg.parts`): the per-class outputs and the per-class holds, each
        as sent and summed unweighted (eq. 5's numerators and ``|K_n|``), clipped per value: both lie in [0, 1]."""
        return (
            SecurePart(("class_probs",), relative=False, weighted=False, value_bound=1.0),
            SecurePart((CLASS_HOLDS,), relative=False, weighted=False, value_bound=1.0),
        )

    def secure_shares(self, replies: Sequence[CheckedReply]) -> list[float]:
        """Equal shares (only weighted parts use them; FD's are sums)."""
        return [1.0] * len(replies)

    def secure_survivors(self, rnd: int, reports: Mapping[ClientId, UpdateReport]) -> None:
        """The clients whose uploads are in this round's sums (U3) and their reports (their own test counts)."""
        self._survivors = dict(reports)

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> Evaluation | None:
        # No global model: the accuracy is the mean of what the round's clients measured on their test data.
        return self._last_eval


def secure_class_average(sums: torch.Tensor, holds: torch.Tensor, survivors: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 5 from secure sums: ``(global (C, C) float32, contributors (C,) int32)`` from the survivors' summed
    outputs ``sums`` (C, C) and summed holds ``holds`` (C,). Each hold is 0 or 1, exact in the fixed point, so their
    sum is an integer; it is rounded anyway and kept in ``[0, survivors]``, and the means in [0, 1], so that a client
    encoding other values than an honest one can (anything within the ring's per-value bound) moves no row outside
    the range of an average of probabilities."""
    counts = holds.double().round().clamp(0, survivors)  # (C,)
    mean = (sums.double() / counts.clamp(min=1).unsqueeze(1)).clamp(0, 1)  # (C, C)
    mean = torch.where(counts.unsqueeze(1) > 0, mean, torch.zeros_like(mean))  # rows with |K_n| = 0 stay 0
    return mean.to(torch.float32), counts.to(torch.int32)


def pooled_local_eval(reports: Sequence[UpdateReport], num_classes: int) -> Evaluation | None:
    """Mean over clients of the accuracies their updates report."""
    accs, per_class = [], []
    for report in reports:
        if not isinstance(report, FDReport) or not report.eval_total:
            continue
        correct = np.array(report.eval_correct, dtype=float)
        total = np.array(report.eval_total, dtype=float)
        if correct.shape != (num_classes,) or total.shape != (num_classes,) or total.sum() == 0:
            continue
        accs.append(correct.sum() / total.sum())
        per_class.append(np.where(total > 0, correct / np.maximum(total, 1), np.nan))
    if not accs:
        return None
    stacked = np.stack(per_class)  # (clients, C), NaN where a client's test data lacks the class
    seen = (~np.isnan(stacked)).sum(axis=0)
    mean = np.where(seen > 0, np.nansum(stacked, axis=0) / np.maximum(seen, 1), np.nan)
    return Evaluation(accuracy=float(np.mean(accs)), per_class=mean)


class FDClient(ClientHalf[FDSettings]):
    """Client half: (distill toward the others' per-class outputs,) then upload this client's per-class outputs."""

    settings_type = FDSettings

    def step(
        self, task: Message, broadcast: Message | None, data: ClientData, backend: Backend, store: ClientStore
    ) -> Message:
        training, settings = self.parse(task)
        extra = wire.from_params(FDTask, task.params)  # the secure-aggregation fields are absent in the clear
        restore_own_model(store, backend, extra.model_seed)
        t = training
        if broadcast is None:
            request = t.request(data.x, data.y, CrossEntropy())
        else:
            source = wire.from_params(FDBroadcast, broadcast.params, defaults=False)
            g, k = broadcast.tensor("global_probs"), broadcast.tensor("contributors").to(torch.int64)
            own = own_upload_in(store, source.source_round, extra.in_sums)
            targets, mask = fd_leave_one_out(  # a client absent from that average has nothing of its own to leave out
                g,
                k,
                torch.zeros_like(g) if own is None else own[0],
                torch.zeros_like(k) if own is None else own[1],
                own_included=own is not None,
            )
            inputs = {"targets": targets[data.y], "mask": mask[data.y]}  # (N, C), (N,)
            objective = FDDistillation(gamma=settings.fd_gamma)
            request = t.request(data.x, data.y, objective, inputs)
        stats = backend.train(request)
        probs = F.softmax(backend.logits(data.x), dim=1)  # (N, C)
        class_probs = torch.zeros(data.num_classes, data.num_classes)
        class_probs.index_add_(0, data.y, probs)
        counts = torch.bincount(data.y, minlength=data.num_classes)
        class_probs = class_probs / counts.clamp(min=1).unsqueeze(1)  # eq. 4; absent classes stay zero rows
        keep_own_model(store, backend)
        store[_LAST + "probs"] = class_probs
        store[_LAST + "counts"] = (counts > 0).to(torch.int64)
        store[_LAST + "round"] = torch.tensor(task.round)
        report = FDReport(num_examples=len(data), loss=stats.mean_loss, **local_eval_counts(backend, data))
        holds = {CLASS_HOLDS: (counts > 0).to(torch.float32)} if extra.secure else {}
        return update_message(task, {"class_probs": class_probs, **holds}, report)


_LAST, _KEPT = "uploaded_", "fd.kept_"  # store prefixes (+ probs, counts, round): the last upload; the one averaged


def own_upload_in(
    store: ClientStore, source_round: int, in_sums: bool | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """This client's upload of ``source_round`` (per-class outputs (C, C), holds (C,) int64) when the broadcast average
    of that round holds it (``in_sums``; None: assumed when the client uploaded in that round), else None.

    Kept in the store as the averaged upload: the next broadcast averages this round again (rounds without a quorum
    between) or a later one, so the client needs no other than that and its next upload. A client told that its
    upload is in the average but that no longer has it (its store lost) leaves nothing out."""
    found = None
    for prefix in (_LAST, _KEPT):
        if prefix + "round" in store and int(store[prefix + "round"]) == source_round:
            found = (store[prefix + "probs"], store[prefix + "counts"])
    for name in ("probs", "counts", "round"):  # the last upload is replaced at the end of this step anyway
        store.pop(_KEPT + name, None)
        store.pop(_LAST + name, None)
    if found is None or in_sums is False:
        if in_sums and found is None:
            log.warning(
                "round %d's outputs of this client are in the broadcast average, but it no longer has them (a lost "
                "store): it distills toward an average that holds its own outputs",
                source_round,
            )
        return None
    store[_KEPT + "probs"], store[_KEPT + "counts"], store[_KEPT + "round"] = *found, torch.tensor(source_round)
    return found


def local_eval_counts(backend: Backend, data: ClientData) -> dict[str, tuple[int, ...]]:
    """A client's per-class correct and total counts on its own test data (sent without tensor bytes)."""
    if data.eval_x is None or data.eval_y is None:
        return {}
    preds = backend.logits(data.eval_x).argmax(dim=1)
    correct = torch.bincount(data.eval_y[preds == data.eval_y], minlength=data.num_classes)
    total = torch.bincount(data.eval_y, minlength=data.num_classes)
    return {"eval_correct": tuple(int(v) for v in correct), "eval_total": tuple(int(v) for v in total)}


def fd_traffic(inputs: CostInputs) -> RoundTraffic:
    """C x C per-class outputs each way (eq. 4-5), plus the C per-class client counts eq. 6 needs on the client; under
    secure aggregation each upload also carries the C per-class holds (float32) the server's counts come from."""
    c = inputs.num_classes
    holds = c * 4 if inputs.secure_aggregation else 0
    return RoundTraffic(up_per_client=c * c * 4 + holds, down_broadcast=c * c * 4, protocol_extra_down=c * 4)


ALGORITHM = Algorithm(
    name="fd",
    label="FD",
    paper="Jeong et al. 2018; DS-FL sec. 2.2, eq. 4-7",
    settings=FDSettings,
    server=FederatedDistillation,
    client=FDClient(),
    traffic=fd_traffic,
    exchange="outputs",
    has_global_model=False,
    describe=lambda s: f"γ={s.fd_gamma:g}",
    secagg_gap="",
    dp_gap="FD uploads per-class outputs, not weights",
    objectives=(FDDistillation,),
)
