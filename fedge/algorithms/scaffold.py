"""SCAFFOLD (Karimireddy et al., ICML 2020, Algorithm 1 with option II): FedAvg with control variates that correct
each local step for the client's drift.

Server state: global weights ``x`` and server control variate ``c`` (one value per trainable parameter, zeros at
first). Each round the server broadcasts ``(x, c)``. Client i keeps its own control variate ``c_i`` (zeros at first)
and takes K local steps ``y <- y - lr * (g_i(y) + c - c_i)`` (line 10: the correction ``c - c_i`` is added to every
gradient: the local term :class:`Correction`, the linear term ``<c - c_i, y>`` whose gradient it is), then sets
``c_i+ = c_i - c + (x - y) / (K * lr)`` (line 12, option II) and uploads ``y`` together with ``delta_c = c_i+ - c_i``.
The server moves ``x <- x + lr_g * (avg(y) - x)`` (line 16, averaged as FedAvg does) and
``c <- c + |S|/N * mean(delta_c)`` (line 17).

Local steps here are momentum SGD (FedNTD B.3). Option II's ``(x - y) / (K * lr)`` is the mean update direction for
plain SGD; with momentum m, K steps move the weights by about ``K * lr / (1 - m)`` per unit of gradient, so the
estimate divides by that effective step, ``(1 - m) * (x - y) / (K * lr)`` (for m = 0 it is the paper's formula).
Without this, c_i overshoots by 1/(1 - m) (10x at m = 0.9) and the corrected steps diverge.

The reported local loss includes the linear term's value ``<c - c_i, y>`` (its gradient is what the algorithm needs;
its value depends on where the weights are measured from), as FedDyn's includes ``-<g_k, theta>``.

Under secure aggregation (:mod:`fedge.secagg.parts`) a client masks two parts in one protocol run, each clipped to
the bound on its own: its weighted move ``(a_i / A) clip(y_i - x)`` and its control delta ``clip(delta_c_i)``,
unweighted. The server gets the survivors' weighted mean model (line 16) and ``sum delta_c`` (line 17 is
``c + (1/N) sum_S delta_c``), and nothing of one client.

Traffic: both directions carry the model plus one control variate, twice FedAvg's parameters. A client that restarts
loses ``c_i`` and starts again from zeros, as a newly sampled client would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fedge.aggregation.server_step import Plain, ServerOptimizer
from fedge.algorithms.base import (
    Algorithm,
    CheckedReply,
    ClientStore,
    CostInputs,
    RoundPlan,
    RoundTraffic,
    ServerContext,
    StrategyState,
    TensorSpec,
    tensors_like,
)
from fedge.algorithms.fedavg import FedAvg, FedAvgClient, FedAvgSettings, LocalRound
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.learning.terms import LocalTerm, TermBatch, TermCall
from fedge.learning.training import TrainRequest, TrainStats
from fedge.secagg.parts import SecurePart
from fedge.types import ClientId, StateDict
from fedge.wire.fields import server_only
from fedge.wire.message import Message

CONTROL = "control."  # broadcast: the server control variate c, per trainable parameter
CONTROL_DELTA = "control_delta."  # update: delta_c of the client
_OWN_CONTROL = "scaffold.c_i."  # the client's c_i in its store


@dataclass(frozen=True)
class ScaffoldSettings(FedAvgSettings):
    server_lr: float = field(default=1.0, metadata=server_only("global step size lr_g, Algorithm 1 line 16"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.server_lr > 0:
            raise ConfigError(f"server_lr must be > 0, got {self.server_lr}")


class Scaffold(FedAvg[ScaffoldSettings]):
    """Server half: FedAvg's averaging with a global step size, plus the server control variate."""

    def __init__(self, config: RunConfig, context: ServerContext) -> None:
        super().__init__(config, context)
        self.trainable = tuple(name for name, _ in self._model.named_parameters())
        self._control: StateDict = {k: torch.zeros_like(self._weights[k]) for k in self.trainable}

    def state(self) -> StrategyState:
        tensors, values = super().state()
        return {**tensors, **{CONTROL + k: v for k, v in self._control.items()}}, values

    def load_state(self, tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any]) -> None:
        super().load_state(tensors, values)
        self._control = tensors_like(tensors, CONTROL, self._control)

    def reply_tensors(self) -> dict[str, TensorSpec]:
        out = super().reply_tensors()
        out.update({CONTROL_DELTA + k: (tuple(v.shape), v.dtype) for k, v in self._control.items()})
        return out

    def configure(self, rnd: int, clients: Sequence[ClientId]) -> RoundPlan:
        tensors = {**self._weights, **{CONTROL + k: v for k, v in self._control.items()}}
        return RoundPlan(broadcast=self.broadcast(rnd, tensors), tasks={c: self.task(rnd, c) for c in clients})

    def server_optimizer(self) -> ServerOptimizer:
        return Plain(self.settings.server_lr)  # line 16: x + lr_g * (avg(y) - x)

    def server_step(self, averaged: StateDict, replies: Mapping[ClientId, CheckedReply]) -> StateDict:
        """Line 16 by the server optimizer; line 17 as ``c + (1/N) sum_S delta_c`` (= ``|S|/N mean``): a sum, so
        one reply that carries the sum of several clients' deltas (secure aggregation's) counts as they would."""
        weights = super().server_step(averaged, replies)
        for k in self.trainable:  # line 17
            deltas = [replies[c].update.tensors[CONTROL_DELTA + k] for c in sorted(replies)]
            self._control[k] = self._control[k] + torch.stack(deltas).sum(dim=0) / self.config.num_clients
        return weights

    def secure_parts(self) -> tuple[SecurePart, ...]:
        """Under secure aggregation (:mod:`fedge.secagg.parts`): the model's weighted move, then the control-variate
        deltas as sent, summed unweighted (line 17 needs their sum); each part clipped to the bound on its own."""
        control = tuple(CONTROL_DELTA + k for k in self.trainable)
        return (SecurePart(tuple(self._weights)), SecurePart(control, relative=False, weighted=False))


@dataclass(frozen=True)
class Correction(LocalTerm):
    """``sum <c, w>`` over the trainable parameters: a linear term whose gradient, ``c`` exactly, is added to every
    parameter's gradient (SCAFFOLD Algorithm 1 line 10 with ``c = c - c_i``; FedDyn's ``-<g_k, theta>``)."""

    kind = "correction"
    tensors = ("c",)

    def __call__(self, b: TermBatch) -> torch.Tensor:
        c = b.tensors["c"]
        return sum((c[k] * p).sum() for k, p in b.params.items())  # type: ignore[return-value]


class ScaffoldClient(FedAvgClient[ScaffoldSettings]):
    settings_type = ScaffoldSettings

    def received_weights(self, broadcast: Message) -> StateDict:
        return {k: v for k, v in broadcast.tensors.items() if not k.startswith(CONTROL)}

    def request(self, r: LocalRound[ScaffoldSettings]) -> TrainRequest:
        control, own = _server_control(r.broadcast), _own_control(r.store, r.broadcast)
        request = super().request(r)
        correction = TermCall(Correction(), {"c": {k: control[k] - own[k] for k in control}})  # c - c_i
        return dataclasses.replace(request, terms=(*request.terms, correction))

    def upload(self, r: LocalRound[ScaffoldSettings], weights: StateDict, stats: TrainStats) -> dict[str, torch.Tensor]:
        control, own = _server_control(r.broadcast), _own_control(r.store, r.broadcast)
        deltas: dict[str, torch.Tensor] = {}
        for k, c in control.items():
            if stats.steps == 0:
                new = own[k]  # no step taken: nothing learned about the drift
            else:  # line 12, option II, for momentum-SGD local steps (see the module docstring)
                effective_lr = r.training.lr / (1.0 - r.training.momentum)
                new = own[k] - c + (r.global_weights[k] - weights[k]) / (stats.steps * effective_lr)
            deltas[CONTROL_DELTA + k] = (new - own[k]).contiguous()
            r.store[_OWN_CONTROL + k] = new
        return {**weights, **deltas}


def _server_control(broadcast: Message) -> StateDict:
    """c, by parameter name."""
    return {k[len(CONTROL) :]: v for k, v in broadcast.tensors.items() if k.startswith(CONTROL)}


def _own_control(store: ClientStore, broadcast: Message) -> StateDict:
    """c_i, by parameter name; zeros before this client's first round."""
    return {k: store.get(_OWN_CONTROL + k, torch.zeros_like(c)) for k, c in _server_control(broadcast).items()}


def scaffold_traffic(inputs: CostInputs) -> RoundTraffic:
    """Model plus one control variate (per trainable parameter) in each direction."""
    size = (inputs.model_values + inputs.trainable_values) * 4
    return RoundTraffic(up_per_client=size, down_broadcast=size)


ALGORITHM = Algorithm(
    name="scaffold",
    label="SCAFFOLD",
    paper="Karimireddy et al., ICML 2020, Algorithm 1 (option II)",
    settings=ScaffoldSettings,
    server=Scaffold,
    client=ScaffoldClient(),
    traffic=scaffold_traffic,
    describe=lambda s: f"lr_g={s.server_lr:g}",
    secagg_gap="",
    dp_gap="",  # DP-FedAvg clips [y - x, delta_c] jointly and noises both sums (fedge.privacy.contribution)
    terms=(Correction,),
)
