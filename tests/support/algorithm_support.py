"""Two hand-made clients and one round of a registered algorithm, for FedJAX-style exact-number tests.

The model is a bias-free linear layer ``logits = x @ W.T`` (2 features -> 3 classes) whose weights start at values
the tests choose, so every expected number can be derived by hand from the papers' equations. The runtime is
:class:`LinearBackend`, a real :class:`fedge.backend.Backend` running fedge's own training loop on that layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from coordinator.engine import RoundEngine
from edge_client.client import EdgeClient
from fedge.algorithms import get_algorithm
from fedge.algorithms.base import AlgorithmSettings, ClientData, ServerContext
from fedge.config import RunConfig, TrainConfig
from fedge.models import exchanged_state, load_exchanged_state
from fedge.records import RoundRecord
from fedge.training import TrainRequest, TrainStats, predict_logits, train
from fedge.types import StateDict
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


class LinearBackend:
    """The Backend protocol on :func:`linear`, trained by :func:`fedge.training.train`."""

    runtime = "torch"

    def __init__(self) -> None:
        self.model = linear()

    def set_weights(self, state: StateDict) -> None:
        load_exchanged_state(self.model, state)

    def get_weights(self) -> StateDict:
        return exchanged_state(self.model)

    def init_weights(self, seed: int) -> StateDict:
        return exchanged_state(linear())

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return predict_logits(self.model, x)

    def train(self, request: TrainRequest) -> TrainStats:
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


class TwoClients:
    """The server half of ``cfg.algorithm`` and two clients, run round by round through the real engine."""

    def __init__(self, cfg: RunConfig, *, open_x: torch.Tensor | None = None, eval_data: bool = False) -> None:
        spec = get_algorithm(cfg.algorithm)
        self.strategy = spec.server(cfg, ServerContext(linear, NUM_CLASSES, run_id="t", open_x=open_x))
        test = (torch.cat([X_A, X_B]), torch.cat([Y_A, Y_B]))
        self.clients = [
            EdgeClient(cid, ClientData(x, y, NUM_CLASSES, open_x=open_x), LinearBackend())
            for cid, x, y in (("a", X_A, Y_A), ("b", X_B, Y_B))
        ]
        if eval_data:
            for c in self.clients:
                c.data.eval_x, c.data.eval_y = test
        self.engine = RoundEngine(cfg, self.strategy, InProcessTransport(self.clients), *test)

    def round(self, rnd: int) -> RoundRecord:
        record = self.engine.run_round(rnd)
        assert record.aggregated and not record.rejections, record.rejections
        return record

    def global_weight(self) -> torch.Tensor:
        weights = self.strategy.global_weights()
        assert weights is not None
        return weights["weight"]


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
