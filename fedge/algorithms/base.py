"""The round protocol every algorithm implements, written once, and what an algorithm module provides.

A round is: the server half plans it (:meth:`Strategy.configure`: one optional broadcast plus one task per sampled
client), each client half turns (task, broadcast, its data, its runtime, its own stored state) into one update
(:meth:`ClientHalf.step`), and the server half folds the updates in (:meth:`Strategy.aggregate`). Hyperparameters, the
learning rate of the round and the shuffle seeds travel in the task as typed fields (:mod:`fedge.wire.fields`), so a
client needs nothing else and the result does not depend on which transport carried the messages.

An algorithm is one module under :mod:`fedge.algorithms` that defines its settings (a frozen dataclass), its server
half, its client half and its local objective, and exposes them as one :class:`Algorithm` named ``ALGORITHM``.
"""

from __future__ import annotations

import copy
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Literal, TypeVar, cast

import numpy as np
import torch
from torch import nn

from fedge.accounting.cost import CostInputs, RoundTraffic
from fedge.accounting.records import AggregationRecord
from fedge.config import AlgorithmSettings, RunConfig
from fedge.data.augment import PRESETS, Augmentation, preset
from fedge.errors import CodecError, ConfigError
from fedge.learning.backend import Backend
from fedge.learning.metrics import per_class_accuracy
from fedge.learning.objectives import Objective
from fedge.learning.terms import LocalTerm
from fedge.learning.training import SGDSettings, TrainRequest, predict_logits
from fedge.tensors import NUMPY_FLOATS
from fedge.tensors import tensors_like as tensors_like  # the algorithms' load_state reads it beside Strategy
from fedge.types import ClientId, StateDict
from fedge.wire import fields as wire
from fedge.wire.fields import bounded
from fedge.wire.message import BROADCAST, TASK, UPDATE, Message

SettingsT = TypeVar("SettingsT", bound=AlgorithmSettings)
"""An algorithm's settings class: its server and client halves are typed over it."""


def derive_seed(base: int, *words: int | str) -> int:
    """A 31-bit seed from a base seed and a path of words (round numbers, client ids, purposes)."""
    keys = [base & 0xFFFFFFFF] + [w if isinstance(w, int) else zlib.crc32(w.encode()) for w in words]
    return int(np.random.SeedSequence(keys).generate_state(1)[0] & 0x7FFFFFFF)


# --- what travels ---------------------------------------------------------------------------------------------------


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite (no NaN, no +-inf)."""
    if t.dtype in NUMPY_FLOATS and t.device.type == "cpu":
        # numpy's one pass on one thread: torch.isfinite builds three temporaries of the tensor's size (== itself,
        # abs, != inf) and waits for its worker threads, the server's largest cost per reply on a busy machine
        return bool(np.isfinite(t.detach().resolve_neg().resolve_conj().numpy()).all())
    return bool(torch.isfinite(t).all())


@dataclass(frozen=True)
class LocalTraining:
    """The local-training settings of one round, carried by every task."""

    lr: float = field(metadata=bounded(0.0, 1e3))
    momentum: float = field(default=0.0, metadata=bounded(0.0, 0.999999))
    weight_decay: float = field(default=0.0, metadata=bounded(0.0, 1.0))
    epochs: int = field(default=1, metadata=bounded(0, 10_000))
    batch_size: int = field(default=32, metadata=bounded(1, 1_000_000))
    seed: int = field(default=0, metadata=bounded(0, 2**31 - 1))
    augment: str = "none"  # a preset of fedge.data.augment, resolved by each client for its own image size

    def __post_init__(self) -> None:
        if self.augment not in PRESETS:
            raise ConfigError(f"unknown augmentation {self.augment!r}; choose one of {', '.join(PRESETS)}")

    @property
    def sgd(self) -> SGDSettings:
        return SGDSettings(lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)

    def augmentation(self, x: torch.Tensor) -> Augmentation:
        """The batch augmentation for a client whose inputs are ``x``."""
        return preset(self.augment, tuple(x.shape[1:]))

    def request(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        objective: Objective,
        inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> TrainRequest:
        """The local training of these settings on (x, y): one place, so no algorithm forgets the augmentation."""
        return TrainRequest(
            x,
            y,
            objective,
            self.sgd,
            self.epochs,
            self.batch_size,
            self.seed,
            inputs=dict(inputs or {}),
            augment=self.augmentation(x),
        )


@dataclass(frozen=True)
class UpdateReport:
    """The numbers every update reports besides its tensors."""

    num_examples: int = field(metadata=bounded(0, 2**40))
    loss: float | None = None


@dataclass(frozen=True)
class CheckedReply:
    """A reply that passed the server half's rules: its report, parsed and checked once by :meth:`Strategy.
    check_reply`, and the update (decoded when the run compresses). What :meth:`Strategy.aggregate` gets per client."""

    report: UpdateReport
    update: Message


@dataclass(frozen=True)
class RoundPlan:
    """What the server sends in one round."""

    broadcast: Message | None
    tasks: Mapping[ClientId, Message]
    # The task of a client that comes online after sampling, early in the round: a transport whose clients come and go
    # (MQTT) may give it one while the round has fewer than ``cohort`` clients. None: the round takes no latecomers.
    late_task: Callable[[ClientId], Message] | None = None
    cohort: int = 0


@dataclass(frozen=True)
class Evaluation:
    """Test accuracy of the global model (or of the clients' models, for FD)."""

    accuracy: float
    per_class: np.ndarray  # (C,), NaN where the test set has no sample of a class


@dataclass
class ClientData:
    """What a client holds locally: its labeled private data, the shared open set (DS-FL) and optional test data."""

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    open_x: torch.Tensor | None = None
    eval_x: torch.Tensor | None = None
    eval_y: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.y)


ClientStore = MutableMapping[str, torch.Tensor]
"""A client's own state kept across rounds (FD and DS-FL clients keep their models, SCAFFOLD its control variate)."""

TensorSpec = tuple[tuple[int, ...], torch.dtype]
"""(shape, dtype) of a tensor a message must carry."""

StrategyState = tuple[dict[str, torch.Tensor], dict[str, Any]]
"""A server half's state: named tensors (saved as safetensors) and JSON-able values (see :meth:`Strategy.state`)."""


# --- the server half ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerContext:
    """What a server half is built from besides the config."""

    model_factory: Callable[[], nn.Module]
    num_classes: int
    run_id: str = ""
    open_x: torch.Tensor | None = None  # DS-FL's unlabeled open set
    evaluation_device: str = "cpu"  # where the server evaluates the global model (a GPU simulation: "cuda")


class Strategy(ABC, Generic[SettingsT]):
    """The server half of an algorithm. Subclasses hold the global state and change it only in ``aggregate``."""

    report_type: type[UpdateReport] = UpdateReport  # a subclass's own; a wrapper's, the wrapped strategy's
    reply_tolerance: float = 0.0
    """Error per value in [0, 1] that the run's upload compression may add (:mod:`fedge.compression.strategy`): checks
    of probability rows allow it."""

    def __init__(self, config: RunConfig, context: ServerContext) -> None:
        self.config = config
        # RunConfig checked that ``algo`` is an instance of this algorithm's settings class.
        self.settings: SettingsT = cast(SettingsT, config.algo)
        self.name = config.algorithm
        self.model_factory = context.model_factory
        self.num_classes = context.num_classes
        self.run_id = context.run_id
        self.evaluation_device = context.evaluation_device

    @abstractmethod
    def configure(self, rnd: int, clients: Sequence[ClientId]) -> RoundPlan:
        """Plan round ``rnd`` (1-based) for the sampled ``clients``."""

    @abstractmethod
    def aggregate(self, rnd: int, replies: Mapping[ClientId, CheckedReply]) -> dict[str, float]:
        """Fold the replies of round ``rnd`` that :meth:`accept` passed into the global state; return round metrics.
        Each reply's report is the one :meth:`check_reply` parsed (an instance of :attr:`report_type`)."""

    @abstractmethod
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> Evaluation | None:
        """Accuracy after the latest aggregation, or None when there is nothing to evaluate yet.

        May run on another thread while the next round's :meth:`configure` and :meth:`check_reply` run
        (:class:`coordinator.engine.RoundPipeline`), never alongside :meth:`aggregate`: change only scratch state of
        its own (e.g. an evaluation model), nothing those two read."""

    @abstractmethod
    def reply_tensors(self) -> dict[str, TensorSpec]:
        """Name -> (shape, dtype) of the tensors a valid update carries."""

    def wire_reply_tensors(self) -> dict[str, TensorSpec]:
        """Name -> (shape, dtype) of what a valid update carries on the wire (coded parts when compressed)."""
        return self.reply_tensors()

    def global_weights(self) -> StateDict | None:
        """The global model's weights, for algorithms that have one."""
        return None

    def aggregation_record(self, rnd: int) -> AggregationRecord:
        """What :meth:`aggregate` of round ``rnd`` exchanged and decided beyond the replies it was given: nothing for
        an algorithm; a protocol wrapper (secure aggregation) reports its messages, whom it left out and whether it
        gave up. The round engine asks right after :meth:`aggregate`."""
        return AggregationRecord()

    def stop_before(self, rnd: int) -> str:
        """Why the run must stop before round ``rnd`` (a DP run's privacy budget), or "" to go on. The round engine asks
        before each round."""
        return ""

    def state(self) -> StrategyState:
        """Everything :meth:`aggregate` changes, as (tensors, JSON-able values): with :meth:`load_state`, all a run
        needs to continue after its last completed round bit for bit (sampling and seeds derive from (seed, round))."""
        raise NotImplementedError(f"{type(self).__name__} does not save its state, so its runs cannot be resumed")

    def load_state(self, tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any]) -> None:
        """Restore what :meth:`state` returned; ConfigError when it does not fit this strategy."""
        raise NotImplementedError(f"{type(self).__name__} does not restore its state, so its runs cannot be resumed")

    def check_reply(self, rnd: int, client: ClientId, reply: Message) -> UpdateReport:
        """The reply's report when ``reply`` is a valid answer to this round's task for ``client``; else CodecError.

        Checks the envelope (kind, round, sender, run), every tensor's name, shape, dtype and finiteness, and parses
        the reported numbers with their bounds. Subclasses add their own rules (e.g. probability rows).
        """
        if reply.kind != UPDATE:
            raise CodecError(f"expected an {UPDATE!r} message, got {reply.kind!r}")
        if reply.round != rnd:
            raise CodecError(f"reply is for round {reply.round}, the current round is {rnd}")
        if reply.client != client:
            raise CodecError(f"reply names client {reply.client!r}, expected {client!r}")
        if reply.run != self.run_id:
            raise CodecError(f"reply belongs to run {reply.run!r}, not {self.run_id!r}")
        expected = self.reply_tensors()
        extra = set(reply.tensors) - set(expected)
        if extra:
            raise CodecError(f"unexpected tensors {sorted(extra)[:5]}")
        for name, (shape, dtype) in expected.items():
            t = reply.tensor(name)
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise CodecError(f"tensor {name!r} is {t.dtype}{list(t.shape)}, expected {dtype}{list(shape)}")
            if t.is_floating_point() and not all_finite(t):
                raise CodecError(f"tensor {name!r} holds NaN or infinite values")
        return self.report_of(reply)

    def accept(self, rnd: int, client: ClientId, reply: Message) -> CheckedReply:
        """What the round engine calls for each reply: :meth:`check_reply`'s verdict, and the update to aggregate
        (the reply itself here; a compressing wrapper returns it decoded, so nothing is kept aside between the check
        and :meth:`aggregate`)."""
        return CheckedReply(self.check_reply(rnd, client, reply), reply)

    def report_of(self, reply: Message) -> UpdateReport:
        """The numbers ``reply`` reports, parsed with their bounds (CodecError when malformed). Called once per reply,
        by :meth:`check_reply`; everything later reads :attr:`CheckedReply.report`."""
        report: UpdateReport = wire.from_params(self.report_type, reply.params)
        return report

    # Helpers for subclasses.
    def local_training(self, rnd: int, client: ClientId) -> LocalTraining:
        """The round's local-training settings, with a shuffle seed unique to (round, client)."""
        t = self.config.train
        return LocalTraining(
            lr=t.lr_at(rnd),
            momentum=t.momentum,
            weight_decay=t.weight_decay,
            epochs=t.local_epochs,
            batch_size=t.batch_size,
            seed=derive_seed(self.config.seed, "train", rnd, client),
            augment=t.augment,
        )

    def task(self, rnd: int, client: ClientId, *fields: Any) -> Message:
        """A task carrying the round's local training, the algorithm's wire settings and ``fields`` (dataclasses)."""
        params = {"algorithm": self.name}
        for obj in (self.local_training(rnd, client), self.settings, *fields):
            params.update(wire.to_params(obj))
        return Message(TASK, rnd, run=self.run_id, client=client, params=params)

    def broadcast(self, rnd: int, tensors: Mapping[str, torch.Tensor], *fields: Any) -> Message:
        params = {"algorithm": self.name}
        for obj in fields:
            params.update(wire.to_params(obj))
        return Message(BROADCAST, rnd, run=self.run_id, params=params, tensors=tensors)


def evaluate_model(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int, *, device: str = "cpu"
) -> Evaluation:
    """Accuracy and per-class accuracy of ``model`` on (x, y), computed on ``device``.

    On another device than the model's, a copy of the model runs there (``model`` itself is not moved: the strategy
    aggregates into it on the CPU). A GPU simulation evaluates there: on the CPU the server's evaluation of the
    10,000 MNIST test images would take longer than the batched clients' whole round (``benchmarks/executors.py``).
    """
    if torch.device(device) != next(model.parameters()).device:
        model = copy.deepcopy(model).to(device)
    preds = predict_logits(model, x).argmax(dim=1).numpy()
    labels = y.numpy()
    return Evaluation(
        accuracy=float((preds == labels).mean()), per_class=per_class_accuracy(preds, labels, num_classes)
    )


# --- the client half ------------------------------------------------------------------------------------------------


class ClientHalf(ABC, Generic[SettingsT]):
    """The client half of an algorithm: one task (plus the round's broadcast) in, one update out.

    Stateless: whatever a client keeps across rounds lives in its ``store``.
    """

    settings_type: ClassVar[type[AlgorithmSettings]] = AlgorithmSettings

    @abstractmethod
    def step(
        self, task: Message, broadcast: Message | None, data: ClientData, backend: Backend, store: ClientStore
    ) -> Message:
        """The update answering ``task``."""

    def parse(self, task: Message) -> tuple[LocalTraining, SettingsT]:
        """The task's local-training settings and this algorithm's settings, typed (CodecError when malformed)."""
        training = wire.from_params(LocalTraining, task.params, defaults=False)
        return training, cast(SettingsT, wire.from_params(self.settings_type, task.params))


def update_message(task: Message, tensors: Mapping[str, torch.Tensor], report: UpdateReport) -> Message:
    """The reply to ``task``."""
    return Message(UPDATE, task.round, run=task.run, client=task.client, params=wire.to_params(report), tensors=tensors)


_OWN_WEIGHTS = "weights."


def restore_own_model(store: ClientStore, backend: Backend, model_seed: int) -> None:
    """Load the client's own model from its store; on first use, the common initialization of ``model_seed``."""
    own = {k[len(_OWN_WEIGHTS) :]: v for k, v in store.items() if k.startswith(_OWN_WEIGHTS)}
    backend.set_weights(own if own else backend.init_weights(model_seed))


def keep_own_model(store: ClientStore, backend: Backend) -> None:
    """Save the backend's current weights as the client's own model."""
    for k, v in backend.get_weights().items():
        store[_OWN_WEIGHTS + k] = v


# --- the registry entry ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Algorithm(Generic[SettingsT]):
    """An algorithm as the rest of fedge sees it: everything config, CLI, reports, cost tables and roles need."""

    name: str  # the config/CLI value, e.g. "fedntd"
    label: str  # the display name, e.g. "FedNTD"
    paper: str  # where its equations come from
    settings: type[SettingsT]
    server: type[Strategy[SettingsT]]
    client: ClientHalf[SettingsT]
    traffic: Callable[[CostInputs], RoundTraffic]
    exchange: Literal["weights", "outputs"] = "weights"
    needs_open_set: bool = False  # DS-FL: clients and server hold the unlabeled open set
    has_global_model: bool = True  # FD has none: clients report their own accuracy
    hooks: frozenset[str] = frozenset()  # what it needs of a model and runtime beyond logits (training.HOOKS)
    describe: Callable[[SettingsT], str] = field(default=lambda settings: "")  # hyperparameters for report legends
    # The local objectives and terms this module defines, found by kind by fedge.algorithms.catalog (program files,
    # export commands); one declared twice (by two algorithms) must be the same class.
    objectives: tuple[type[Objective], ...] = ()
    terms: tuple[type[LocalTerm], ...] = ()
    # Why secure aggregation (fedge.algorithms.secure_aggregation) cannot run this algorithm yet, for the start-up
    # error; "" when its server half needs nothing but sums of the replies' tensors that fedge.secagg.parts declares
    # (by default the weighted mean of the returned weights).
    secagg_gap: str = "its aggregation is not declared to be a weighted mean of the returned weights"
    # Why DP-FedAvg (fedge.algorithms.differential_privacy) cannot run it: it clips each client's whole contribution
    # to the sums of the declared parts jointly (fedge.privacy.contribution) and noises them, so an algorithm whose
    # server needs more than those sums (a per-client rescaling, per-client state) is refused. None: the same as
    # secagg_gap (an algorithm secure aggregation runs with its default part).
    dp_gap: str | None = None

    @property
    def dp_refusal(self) -> str:
        """Why DP-FedAvg cannot run this algorithm; "" when it can."""
        return self.secagg_gap if self.dp_gap is None else self.dp_gap


def weights_traffic(inputs: CostInputs) -> RoundTraffic:
    """FL: every client uploads its model, the server broadcasts the global model (DS-FL eq. 1-3, Tables I-II)."""
    size = inputs.model_values * 4
    return RoundTraffic(up_per_client=size, down_broadcast=size)
