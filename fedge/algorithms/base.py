"""The round protocol every algorithm implements, written once.

A round is: the server half plans it (:meth:`Strategy.configure`: one optional broadcast plus one task per sampled
client), each client half turns (task, broadcast, its data, its runtime, its own stored state) into one update
(:data:`ClientStep`), and the server half folds the updates in (:meth:`Strategy.aggregate`). Hyperparameters, the
learning rate of the round and the shuffle seeds travel in the task, so a client needs nothing else and the result
does not depend on which transport carried the messages.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedge.backend import Backend
from fedge.config import RunConfig
from fedge.errors import CodecError
from fedge.messages import BROADCAST, TASK, UPDATE, Message, format_float
from fedge.metrics import per_class_accuracy
from fedge.training import SGDSettings, predict_logits
from fedge.types import ClientId


def derive_seed(base: int, *words: int | str) -> int:
    """A 31-bit seed from a base seed and a path of words (round numbers, client ids, purposes)."""
    keys = [base & 0xFFFFFFFF] + [w if isinstance(w, int) else zlib.crc32(w.encode()) for w in words]
    return int(np.random.SeedSequence(keys).generate_state(1)[0] & 0x7FFFFFFF)


@dataclass(frozen=True)
class RoundPlan:
    """What the server sends in one round."""

    broadcast: Message | None
    tasks: Mapping[ClientId, Message]


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
"""A client's own state kept across rounds (FD and DS-FL clients keep their models)."""

ClientStep = Callable[[Message, "Message | None", ClientData, Backend, ClientStore], Message]
"""(task, broadcast, data, backend, store) -> update."""


class Strategy(ABC):
    """The server half of an algorithm. Subclasses hold the global state and change it only in ``aggregate``."""

    name: str

    def __init__(
        self, config: RunConfig, model_factory: Callable[[], nn.Module], num_classes: int, run_id: str = ""
    ) -> None:
        self.config = config
        self.model_factory = model_factory
        self.num_classes = num_classes
        self.run_id = run_id

    @abstractmethod
    def configure(self, rnd: int, clients: Sequence[ClientId]) -> RoundPlan:
        """Plan round ``rnd`` (1-based) for the sampled ``clients``."""

    @abstractmethod
    def aggregate(self, rnd: int, replies: Mapping[ClientId, Message]) -> dict[str, float]:
        """Fold the replies of round ``rnd`` into the global state; return round metrics (e.g. logit entropy)."""

    @abstractmethod
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> Evaluation | None:
        """Accuracy after the latest aggregation, or None when there is nothing to evaluate yet."""

    def global_weights(self) -> dict[str, torch.Tensor] | None:
        """The global model's weights, for algorithms that have one."""
        return None

    def validate_reply(self, rnd: int, client: ClientId, reply: Message) -> None:
        """Raise CodecError when ``reply`` cannot be a valid answer to this round's task for ``client``."""
        if reply.kind != UPDATE:
            raise CodecError(f"expected an {UPDATE!r} message, got {reply.kind!r}")
        if reply.round != rnd:
            raise CodecError(f"reply is for round {reply.round}, the current round is {rnd}")
        if reply.client != client:
            raise CodecError(f"reply names client {reply.client!r}, expected {client!r}")
        if reply.run != self.run_id:
            raise CodecError(f"reply belongs to run {reply.run!r}, not {self.run_id!r}")
        for name, (shape, dtype) in self.expected_reply_tensors().items():
            t = reply.tensor(name)
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise CodecError(f"tensor {name!r} is {t.dtype}{list(t.shape)}, expected {dtype}{list(shape)}")
        extra = set(reply.tensors) - set(self.expected_reply_tensors())
        if extra:
            raise CodecError(f"unexpected tensors {sorted(extra)}")
        if reply.int_param("num_examples") < 0:
            raise CodecError("num_examples must be >= 0")
        # Optional numbers that aggregation parses later: a malformed one must be rejected here, not crash there.
        if "loss" in reply.params:
            reply.float_param("loss")
        for key in ("eval_correct", "eval_total"):
            counts = reply.params.get(key)
            if counts is not None and not (
                len(counts.split(",")) == self.num_classes and all(v.isdigit() for v in counts.split(","))
            ):
                raise CodecError(f"{key} must be {self.num_classes} comma-separated counts, got {counts[:80]!r}")

    @abstractmethod
    def expected_reply_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of the tensors a valid update carries."""

    # Helpers for subclasses.
    def task(self, rnd: int, client: ClientId, **params: str) -> Message:
        """A task with the local-training settings of round ``rnd`` and a shuffle seed unique to (round, client)."""
        t = self.config.train
        common = {
            "algorithm": self.name,
            "lr": format_float(t.lr_at(rnd)),
            "momentum": format_float(t.momentum),
            "weight_decay": format_float(t.weight_decay),
            "epochs": str(t.local_epochs),
            "batch_size": str(t.batch_size),
            "seed": str(derive_seed(self.config.seed, "train", rnd, client)),
        }
        return Message(TASK, rnd, run=self.run_id, client=client, params={**common, **params})

    def broadcast(self, rnd: int, tensors: Mapping[str, torch.Tensor], **params: str) -> Message:
        return Message(BROADCAST, rnd, run=self.run_id, params={"algorithm": self.name, **params}, tensors=tensors)


def sgd_from_task(task: Message, *, lr_key: str = "lr") -> SGDSettings:
    """The optimizer settings a task asks for."""
    return SGDSettings(
        lr=task.float_param(lr_key),
        momentum=task.float_param("momentum", 0.0),
        weight_decay=task.float_param("weight_decay", 0.0),
    )


def evaluate_model(model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int) -> Evaluation:
    """Accuracy and per-class accuracy of ``model`` on (x, y)."""
    preds = predict_logits(model, x).argmax(dim=1).numpy()
    labels = y.numpy()
    return Evaluation(
        accuracy=float((preds == labels).mean()), per_class=per_class_accuracy(preds, labels, num_classes)
    )


def update_message(task: Message, tensors: Mapping[str, torch.Tensor], **params: str) -> Message:
    """The reply to ``task``."""
    return Message(UPDATE, task.round, run=task.run, client=task.client, params=params, tensors=dict(tensors))


def local_eval_params(backend: Backend, data: ClientData) -> dict[str, str]:
    """A client's accuracy on its own test data, as per-class counts in strings (sent without tensor bytes)."""
    if data.eval_x is None or data.eval_y is None:
        return {}
    preds = backend.logits(data.eval_x).argmax(dim=1)
    correct = torch.bincount(data.eval_y[preds == data.eval_y], minlength=data.num_classes)
    total = torch.bincount(data.eval_y, minlength=data.num_classes)
    return {
        "eval_correct": ",".join(str(int(v)) for v in correct),
        "eval_total": ",".join(str(int(v)) for v in total),
    }


def pooled_local_eval(replies: Mapping[ClientId, Message], num_classes: int) -> Evaluation | None:
    """Mean over clients of the accuracies their updates report (FD has no global model to test)."""
    accs, per_class = [], []
    for reply in replies.values():
        if "eval_correct" not in reply.params:
            continue
        correct = np.array([int(v) for v in reply.params["eval_correct"].split(",")], dtype=float)
        total = np.array([int(v) for v in reply.param("eval_total").split(",")], dtype=float)
        if correct.shape != (num_classes,) or total.shape != (num_classes,) or total.sum() == 0:
            continue
        accs.append(correct.sum() / total.sum())
        with np.errstate(invalid="ignore", divide="ignore"):
            per_class.append(np.where(total > 0, correct / np.maximum(total, 1), np.nan))
    if not accs:
        return None
    stacked = np.stack(per_class)  # (clients, C), NaN where a client's test data lacks the class
    seen = (~np.isnan(stacked)).sum(axis=0)
    mean = np.where(seen > 0, np.nansum(stacked, axis=0) / np.maximum(seen, 1), np.nan)
    return Evaluation(accuracy=float(np.mean(accs)), per_class=mean)


_OWN_WEIGHTS = "weights."


def restore_own_model(store: ClientStore, backend: Backend, model_seed: int) -> None:
    """Load the client's own model from its store; on first use, the common initialization of ``model_seed``."""
    own = {k[len(_OWN_WEIGHTS) :]: v for k, v in store.items() if k.startswith(_OWN_WEIGHTS)}
    backend.set_weights(own if own else backend.init_weights(model_seed))


def keep_own_model(store: ClientStore, backend: Backend) -> None:
    """Save the backend's current weights as the client's own model."""
    for k, v in backend.get_weights().items():
        store[_OWN_WEIGHTS + k] = v
