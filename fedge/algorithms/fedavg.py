"""Weight-exchange algorithms: FedAvg, FedNTD, FedLSD and FedCAD.

They share the round flow (broadcast the global weights, train locally, average the weights) and differ only in the
local objective:
- FedAvg: cross-entropy; aggregation weighted by data size (McMahan et al.; FedNTD eq. 2; DS-FL eq. 1-3).
- FedNTD: CE + beta * tau^2 * not-true KL to the received global model, frozen (FedNTD eq. 10-11, Algorithm 1).
- FedLSD: (1 - w) CE + w * soft-CE to the global model, constant w (FedCAD eq. 1-2 with alpha_y = w).
- FedCAD: the same with class-wise weights alpha_y from the global model's reliability on the local data (FedCAD eq. 3).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from fedge.aggregation import weighted_average
from fedge.algorithms.base import (
    ClientData,
    ClientStore,
    Evaluation,
    RoundPlan,
    Strategy,
    evaluate_model,
    sgd_from_task,
    update_message,
)
from fedge.backend import Backend
from fedge.config import RunConfig
from fedge.losses import fedcad_class_weights
from fedge.messages import Message, format_float
from fedge.models import exchanged_state, load_exchanged_state
from fedge.training import Objective
from fedge.types import ClientId, StateDict

OBJECTIVE_OF = {"fedavg": "ce", "fedntd": "ntd", "fedlsd": "lsd", "fedcad": "cad"}


class WeightAveraging(Strategy):
    """Server half of FedAvg / FedNTD / FedLSD / FedCAD."""

    def __init__(
        self, config: RunConfig, model_factory: Callable[[], nn.Module], num_classes: int, run_id: str = ""
    ) -> None:
        super().__init__(config, model_factory, num_classes, run_id)
        self.name = self.config.algorithm
        self._model = self.model_factory()  # scratch module for evaluation
        self._weights: StateDict = exchanged_state(self._model)

    def global_weights(self) -> StateDict:
        return self._weights

    def expected_reply_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(v.shape), v.dtype) for k, v in self._weights.items()}

    def configure(self, rnd: int, clients: Sequence[ClientId]) -> RoundPlan:
        a = self.config.algo
        params = {
            "objective": OBJECTIVE_OF[self.name],
            "ntd_tau": format_float(a.ntd_tau),
            "ntd_beta": format_float(a.ntd_beta),
            "kd_tau": format_float(a.kd_tau),
            "lsd_weight": format_float(a.lsd_weight),
            "cad_beta": format_float(a.cad_beta),
            "cad_gamma": format_float(a.cad_gamma),
        }
        return RoundPlan(
            broadcast=self.broadcast(rnd, self._weights),
            tasks={c: self.task(rnd, c, **params) for c in clients},
        )

    def aggregate(self, rnd: int, replies: Mapping[ClientId, Message]) -> dict[str, float]:
        ordered = [replies[c] for c in sorted(replies)]  # order-independent result, whatever arrived first
        if self.config.algo.weighting == "uniform":
            weights = [1.0] * len(ordered)
        else:
            weights = [float(r.int_param("num_examples")) for r in ordered]
        self._weights = weighted_average([dict(r.tensors) for r in ordered], weights)
        return {"mean_local_loss": sum(float(r.param("loss", "nan")) for r in ordered) / max(len(ordered), 1)}

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> Evaluation:
        load_exchanged_state(self._model, self._weights)
        return evaluate_model(self._model, x, y, self.num_classes)


def client_step(
    task: Message, broadcast: Message | None, data: ClientData, backend: Backend, store: ClientStore
) -> Message:
    """Client half: start from the broadcast weights, train on the local objective, return the new weights."""
    if broadcast is None:
        raise ValueError("a weight-exchange task needs the round's broadcast of global weights")
    backend.set_weights(dict(broadcast.tensors))
    kind = task.param("objective")
    aux = None
    class_weights = None
    tau, beta = 1.0, 1.0
    if kind == "ntd":
        tau, beta = task.float_param("ntd_tau"), task.float_param("ntd_beta")
    elif kind in ("lsd", "cad", "kd"):
        tau = task.float_param("kd_tau")
    if kind in ("ntd", "kd", "lsd", "cad"):
        aux = backend.logits(data.x)  # teacher = the received global model, frozen: its logits are fixed all round
    if kind == "lsd":
        class_weights = torch.full((data.num_classes,), task.float_param("lsd_weight"))
    elif kind == "cad":
        assert aux is not None
        class_weights = fedcad_class_weights(
            aux,
            data.y,
            data.num_classes,
            beta=task.float_param("cad_beta"),
            gamma=task.float_param("cad_gamma"),
            tau=tau,
        )
    objective = Objective(kind, tau=tau, beta=beta, class_weights=class_weights)
    stats = backend.train(
        data.x,
        data.y,
        objective,
        sgd_from_task(task),
        epochs=task.int_param("epochs"),
        batch_size=task.int_param("batch_size"),
        seed=task.int_param("seed"),
        aux=aux,
    )
    return update_message(task, backend.get_weights(), num_examples=str(len(data)), loss=format_float(stats.mean_loss))
