"""Federated distillation (FD), the DS-FL paper's second benchmark (DS-FL sec. 2.2, eq. 4-7; Jeong et al. 2018).

Clients keep their own models. Each round a client uploads its per-class mean softmax output (C x C, a zero row for a
class it has no sample of; eq. 4). The server averages each class over the clients that hold it (eq. 5) and
broadcasts the result with the number of contributors per class. A client then distills toward the leave-one-out
average of the *other* clients (eq. 6) with CE + gamma * soft-CE (eq. 7).

Rounds are pipelined so each round is one exchange: round 1 is the plain update (eq. 1); in round r > 1 the client
first distills on round r-1's broadcast, then uploads. The order of steps is the paper's: U, P, D, P, D, ...
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from fedge.aggregation import fd_global_logits, fd_leave_one_out
from fedge.algorithms.base import (
    ClientData,
    ClientStore,
    Evaluation,
    RoundPlan,
    Strategy,
    derive_seed,
    keep_own_model,
    local_eval_params,
    pooled_local_eval,
    restore_own_model,
    sgd_from_task,
    update_message,
)
from fedge.backend import Backend
from fedge.config import RunConfig
from fedge.messages import Message, format_float
from fedge.training import Objective
from fedge.types import ClientId


class FederatedDistillation(Strategy):
    """Server half of FD: per-class averaging of the uploaded per-class outputs."""

    name = "fd"

    def __init__(
        self, config: RunConfig, model_factory: Callable[[], nn.Module], num_classes: int, run_id: str = ""
    ) -> None:
        super().__init__(config, model_factory, num_classes, run_id)
        self._global: torch.Tensor | None = None  # (C, C) from the latest round
        self._contributors: torch.Tensor | None = None  # (C,) int32
        self._last_eval: Evaluation | None = None

    def expected_reply_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        c = self.num_classes
        return {"class_probs": ((c, c), torch.float32)}

    def configure(self, rnd: int, clients: Sequence[ClientId]) -> RoundPlan:
        broadcast = None
        if self._global is not None and self._contributors is not None:
            broadcast = self.broadcast(
                rnd, {"global_probs": self._global, "contributors": self._contributors}, source_round=str(rnd - 1)
            )
        params = {
            "fd_gamma": format_float(self.config.algo.fd_gamma),
            "model_seed": str(derive_seed(self.config.seed, "model")),
        }
        return RoundPlan(broadcast=broadcast, tasks={c: self.task(rnd, c, **params) for c in clients})

    def aggregate(self, rnd: int, replies: Mapping[ClientId, Message]) -> dict[str, float]:
        ordered = [replies[c] for c in sorted(replies)]
        probs = [r.tensor("class_probs") for r in ordered]
        # A zero row marks a class the client has no sample of (eq. 4): softmax rows are strictly positive.
        counts = [(p.abs().sum(dim=1) > 0).to(torch.int64) for p in probs]
        g, k = fd_global_logits(probs, counts)
        self._global = g.to(torch.float32)
        self._contributors = k.to(torch.int32)
        self._last_eval = pooled_local_eval(replies, self.num_classes)
        return {}

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> Evaluation | None:
        # No global model: the accuracy is the mean of what the round's clients measured on their test data.
        return self._last_eval


def client_step(
    task: Message, broadcast: Message | None, data: ClientData, backend: Backend, store: ClientStore
) -> Message:
    """Client half: (distill toward the others' per-class outputs,) then upload this client's per-class outputs."""
    restore_own_model(store, backend, task.int_param("model_seed"))
    sgd = sgd_from_task(task)
    epochs, batch, seed = task.int_param("epochs"), task.int_param("batch_size"), task.int_param("seed")
    if broadcast is None:
        backend.train(data.x, data.y, Objective("ce"), sgd, epochs=epochs, batch_size=batch, seed=seed)
    else:
        g, k = broadcast.tensor("global_probs"), broadcast.tensor("contributors").to(torch.int64)
        own_round = int(store["uploaded_round"]) if "uploaded_round" in store else -1
        targets, mask = fd_leave_one_out(  # a client absent from that round has nothing of its own to leave out
            g,
            k,
            store.get("uploaded_probs", torch.zeros_like(g)),
            store.get("uploaded_counts", torch.zeros_like(k)),
            own_included=own_round == int(broadcast.param("source_round")),
        )
        aux, aux_mask = targets[data.y], mask[data.y]
        objective = Objective("fd", gamma=task.float_param("fd_gamma"))
        backend.train(
            data.x, data.y, objective, sgd, epochs=epochs, batch_size=batch, seed=seed, aux=aux, aux_mask=aux_mask
        )
    probs = torch.softmax(backend.logits(data.x), dim=1)
    class_probs = torch.zeros(data.num_classes, data.num_classes)
    class_probs.index_add_(0, data.y, probs)
    counts = torch.bincount(data.y, minlength=data.num_classes)
    class_probs = class_probs / counts.clamp(min=1).unsqueeze(1)  # eq. 4; absent classes stay zero rows
    keep_own_model(store, backend)
    store["uploaded_probs"] = class_probs
    store["uploaded_counts"] = (counts > 0).to(torch.int64)
    store["uploaded_round"] = torch.tensor(task.round)
    return update_message(
        task, {"class_probs": class_probs}, num_examples=str(len(data)), **local_eval_params(backend, data)
    )
