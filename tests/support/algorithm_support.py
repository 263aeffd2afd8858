"""Two hand-made clients and one round of a registered algorithm, for FedJAX-style exact-number tests.

The model is a bias-free linear layer ``logits = x @ W.T`` (2 features -> 3 classes) whose weights start at values
the tests choose, so every expected number can be derived by hand from the papers' equations. The runtime is
:class:`LinearBackend`, a real :class:`fedge.learning.backend.Backend` running fedge's own training loop on that layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from coordinator.engine import RoundEngine
from coordinator.transport import Exchange, ReplyCheck
from edge_client.client import EdgeClient
from fedge.accounting.records import RoundRecord
from fedge.algorithms.base import ClientData, RoundPlan, ServerContext
from fedge.algorithms.catalog import get_algorithm
from fedge.config import AlgorithmSettings, RunConfig, TrainConfig
from fedge.learning.models import exchanged_state, load_exchanged_state
from fedge.learning.training import TrainRequest, TrainStats, predict_logits, train
from fedge.types import ClientId, StateDict
from fedge.wire.message import Message, decode, encode
from fedge_io.rundir import RunResult
from sim.inprocess import InProcessTransport

NUM_CLASSES = 3
W0 = torch.tensor([[0.2, -0.1], [0.0, 0.3], [-0.2, 0.1]])  # (C, features): the initial global weights

# Client "a" holds two samples of classes 0 and 1, client "b" one sample of class 2.
X_A = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
Y_A = torch.tensor([0, 1])
X_B = torch.tensor([[1.0, 1.0]])
Y_B = torch.tensor([2])


def linear(weights: torch.Tensor = W0) -> nn.Linear:
    layer = nn.Linear(2, NUM_CLASSES, bias=False)
    with torch.no_grad():
        layer.weight.copy_(weights)
    return layer


class Hidden(nn.Module):
    """2 features -> tanh hidden layer of 2 -> 3 classes, bias-free, with fixed weights: a model whose representation
    (the hidden layer) depends on its weights, for losses that compare representations (MOON)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2, bias=False)
        self.outer = nn.Linear(2, NUM_CLASSES, bias=False)
        with torch.no_grad():
            self.inner.weight.copy_(torch.tensor([[0.5, -0.3], [0.2, 0.4]]))
            self.outer.weight.copy_(W0)

    def representation(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(x))

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.outer(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.representation(x))


class LinearBackend:
    """The Backend protocol on :func:`linear` (or another ``model``), trained by
    :func:`fedge.learning.training.train`."""

    runtime = "torch"

    def __init__(self, model: Callable[[], nn.Module] = linear) -> None:
        self.factory = model
        self.model = model()
        self.requests: list[TrainRequest] = []  # every training call, in order, for tests to inspect

    def set_weights(self, state: StateDict) -> None:
        load_exchanged_state(self.model, state)

    def get_weights(self) -> StateDict:
        return exchanged_state(self.model)

    def init_weights(self, seed: int) -> StateDict:
        return exchanged_state(self.factory())

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return predict_logits(self.model, x)

    def train(self, request: TrainRequest) -> TrainStats:
        self.requests.append(request)
        return train(self.model, request)


def config(algorithm: str, settings: AlgorithmSettings | None = None, **train: float) -> RunConfig:
    """Plain full-batch gradient descent by default: lr 0.5, one epoch, no momentum, weight decay or lr decay."""
    t = dict(lr=0.5, momentum=0.0, weight_decay=0.0, lr_decay=1.0, local_epochs=1, batch_size=8) | train
    return RunConfig(
        algorithm=algorithm,
        dataset="synthetic",
        num_clients=2,
        rounds=3,
        train=TrainConfig(**t),  # type: ignore[arg-type]
        algo=settings,
        eval_every=1,
    )


class RecordingTransport(InProcessTransport):
    """The in-process transport, keeping each round's broadcast and accepted replies as they went over the wire."""

    def __init__(self, clients: Sequence[EdgeClient]) -> None:
        super().__init__(clients)
        self.broadcasts: dict[int, Message | None] = {}
        self.replies: dict[int, dict[ClientId, Message]] = {}

    def exchange(self, plan: RoundPlan, check: ReplyCheck) -> Exchange:
        out = super().exchange(plan, check)
        rnd = next(iter(plan.tasks.values())).round
        self.broadcasts[rnd] = decode(encode(plan.broadcast)) if plan.broadcast is not None else None
        self.replies[rnd] = {c: r.update for c, r in out.replies.items()}
        return out


class TwoClients:
    """The server half of ``cfg.algorithm`` and two clients, run round by round through the real engine.

    ``data`` replaces the clients' (x, y), default ``(X_A, Y_A)`` for "a" and ``(X_B, Y_B)`` for "b"; the test set
    (and each client's eval data, with ``eval_data``) is the two clients' data together. ``model`` replaces the
    model factory (default :func:`linear`; :class:`Hidden` has a representation).
    """

    def __init__(
        self,
        cfg: RunConfig,
        *,
        open_x: torch.Tensor | None = None,
        eval_data: bool = False,
        data: Sequence[tuple[torch.Tensor, torch.Tensor]] = ((X_A, Y_A), (X_B, Y_B)),
        model: Callable[[], nn.Module] = linear,
    ) -> None:
        assert len(data) == 2, "two clients"
        spec = get_algorithm(cfg.algorithm)
        self.strategy = spec.server(cfg, ServerContext(model, NUM_CLASSES, run_id="t", open_x=open_x))
        test = (torch.cat([x for x, _ in data]), torch.cat([y for _, y in data]))
        self.clients = [
            EdgeClient(cid, ClientData(x, y, NUM_CLASSES, open_x=open_x), LinearBackend(model))
            for cid, (x, y) in zip(("a", "b"), data, strict=True)
        ]
        if eval_data:
            for c in self.clients:
                c.data.eval_x, c.data.eval_y = test
        self.transport = RecordingTransport(self.clients)
        self.engine = RoundEngine(cfg, self.strategy, self.transport, *test)

    def round(self, rnd: int) -> RoundRecord:
        record = self.engine.run_round(rnd)
        assert record.aggregated and not record.rejections, record.rejections
        return record

    def global_weight(self) -> torch.Tensor:
        weights = self.strategy.global_weights()
        assert weights is not None
        return weights["weight"]

    def backend(self, cid: ClientId) -> LinearBackend:
        """Client ``cid``'s runtime: its model and the training requests it ran."""
        (client,) = [c for c in self.clients if c.client_id == cid]
        assert isinstance(client.backend, LinearBackend)
        return client.backend

    def client_weight(self, cid: ClientId) -> torch.Tensor:
        """The weights client ``cid`` holds now (FD and DS-FL clients keep their own models)."""
        return self.backend(cid).get_weights()["weight"]

    def upload(self, rnd: int, cid: ClientId, name: str) -> torch.Tensor:
        """Tensor ``name`` of client ``cid``'s accepted reply in round ``rnd``, as the server received it."""
        return self.transport.replies[rnd][cid].tensor(name)

    def broadcast(self, rnd: int, name: str) -> torch.Tensor:
        """Tensor ``name`` of round ``rnd``'s broadcast, as the clients received it."""
        message = self.transport.broadcasts[rnd]
        assert message is not None, f"round {rnd} had no broadcast"
        return message.tensor(name)


def ce_gradient(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """d/dW of the mean cross-entropy of ``x @ W.T``: mean over samples of (softmax - onehot) x^T, by hand."""
    p = torch.softmax(x @ w.T, dim=1)  # (N, C)
    onehot = torch.eye(NUM_CLASSES)[y]  # (N, C)
    return (p - onehot).T @ x / len(x)  # (C, features)


def gd(w: torch.Tensor, grads: Sequence[torch.Tensor], lr: float) -> torch.Tensor:
    """``w`` after plain gradient steps with the given gradients."""
    for g in grads:
        w = w - lr * g
    return w


def soft_ce_gradient(w: torch.Tensor, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """d/dW of the mean soft cross-entropy ``-sum_k t_k log softmax(x @ W.T)_k``: mean of (softmax - t) x^T, by hand."""
    p = torch.softmax(x @ w.T, dim=1)  # (N, C)
    return (p - targets).T @ x / len(x)  # (C, features)


def assert_mqtt_run_matches_inprocess(cfg: RunConfig, tmp_path: Path) -> RunResult:
    """Run ``cfg`` in process and over the secured embedded broker (client processes): the same global model to 1e-6
    and no rejected message. Returns the in-process run."""
    from safetensors.torch import load_file

    from sim.laptop import run_over_mqtt
    from sim.run import run_inprocess

    inprocess = run_inprocess(cfg, tmp_path / "inprocess")
    result = run_over_mqtt(cfg, tmp_path / "mqtt", broker=None, round_timeout=60)
    a, b = (load_file(tmp_path / d / "global_model.safetensors") for d in ("inprocess", "mqtt"))
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    assert result.summary["rejected"] == 0
    return inprocess
