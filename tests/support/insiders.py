"""Admitted attackers: a fleet member with a real device bundle that answers every task with a crafted update.

Each attacker is an :class:`EdgeClient` subclass, so the same code attacks an in-process run and a run over a broker
(wrapped in :class:`edge_client.mqtt.MqttEdgeClient`). It computes the honest update first, as its device would,
and derives the attack from it and from the broadcast it received:

- ``replacement``: DS-FL eq. 19 toward a model whose output rows are rotated by one class (it answers c + 1 where
  the global model answers c), shrunk to 0.95 x the update bound as the attacker can know it: ``max_update_ratio``
  x the broadcast model's norm in round 1 (the coordinator's reference before any round), then x its own honest
  update's norm (its estimate of the round's median).
- ``sign_flip``: the honest update reversed and stretched to the bound.
- ``rehello``: a new hello claiming 2^40 samples, then an all-zero model claiming 2^40 examples (MQTT only).
- ``int8_offset``: +5 on every value of the output layer's bias, coded like every upload of the run (int8).
- ``label_rotation``: an honestly trained update on labels rotated by one class.
- ``confident_wrong`` (DS-FL): valid probability rows, each all on the class after the one its model predicts.

:class:`Scaled` is an attacker of a set size instead (a multiple of its honest update's norm), to test the update
bound itself; :func:`refused` says whom a round refused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from coordinator.engine import RoundEngine
from edge_client.client import EdgeClient
from fedge.accounting.records import RoundRecord
from fedge.aggregation.robust import state_norm, update_norm
from fedge.algorithms.base import ClientData, UpdateReport
from fedge.algorithms.catalog import ALGORITHMS
from fedge.algorithms.dsfl import DSFLSettings
from fedge.compression.strategy import decode_broadcast, encode_update
from fedge.config import RunConfig, TrainConfig
from fedge.learning.backend import Backend, TorchBackend
from fedge.types import StateDict
from fedge.wire import fields as wire
from fedge.wire.message import Message
from fedge_io.experiment import prepare
from sim.inprocess import InProcessTransport

ATTACKS = ("replacement", "sign_flip", "rehello", "int8_offset", "label_rotation", "confident_wrong")
OUTPUT_LAYER = "layers.2."  # tiny_mlp's last Linear
HUGE = 2**40


class Insider(EdgeClient):
    """An admitted client running ``attack`` every round; ``bound_ratio`` is the server's ``max_update_ratio``."""

    def __init__(self, honest: EdgeClient, attack: str, bound_ratio: float = 10.0) -> None:
        super().__init__(honest.client_id, honest.data, honest.backend)
        d = honest.data
        self.honest_data = d
        self.rotated_data = ClientData(d.x, (d.y + 1) % d.num_classes, d.num_classes, d.open_x)
        self.attack, self.bound_ratio = attack, bound_ratio  # the attack may change between runs
        self.rehello: Callable[[int], None] | None = None  # publishes a hello with this dataset size (MQTT)
        self.reset: Callable[[], None] | None = None  # publishes its true hello again (MQTT)

    def handle(self, task: Message, broadcast: Message | None, backend: Backend | None = None) -> Message:
        assert self.attack in ATTACKS, self.attack
        backend = backend or self.backend
        self.data = self.rotated_data if self.attack == "label_rotation" else self.honest_data
        if self.attack == "label_rotation":
            return super().handle(task, broadcast, backend)
        if self.attack == "confident_wrong":
            update = super().handle(task, broadcast, backend)
            probs = update.tensor("soft_labels")
            wrong = torch.nn.functional.one_hot((probs.argmax(dim=1) + 1) % probs.shape[1], probs.shape[1])
            tensors = {"soft_labels": wrong.to(probs.dtype).contiguous()}
            return Message(
                update.kind, update.round, update.run, update.client, update.params, tensors, update.transport
            )
        assert broadcast is not None, "a weight-exchange run"
        plain = decode_broadcast(broadcast)
        w_g: StateDict = dict(plain.tensors)
        update = ALGORITHMS[task.param("algorithm")].client.step(task, plain, self.data, backend, self.store)
        honest = dict(update.tensors)
        own = update_norm(honest, w_g)
        bound = self.bound_ratio * (max(state_norm(w_g), 1.0) if task.round == 1 else own)
        if self.attack == "replacement":
            w_x = {n: v.roll(1, dims=0) if n.startswith(OUTPUT_LAYER) else v for n, v in w_g.items()}
            boost = 0.95 * bound / max(update_norm(w_x, w_g), 1e-12)
            tensors = {n: w_g[n] + boost * (w_x[n] - w_g[n]) for n in w_g}
        elif self.attack == "sign_flip":
            tensors = {n: w_g[n] - (0.999 * bound / max(own, 1e-12)) * (honest[n] - w_g[n]) for n in w_g}
        elif self.attack == "int8_offset":
            tensors = {n: v + 5.0 if n == OUTPUT_LAYER + "bias" else v for n, v in honest.items()}
        else:  # rehello
            assert self.rehello is not None, "the re-hello attack needs a broker"
            self.rehello(HUGE)
            tensors = {n: torch.zeros_like(v) for n, v in w_g.items()}
        report = UpdateReport(num_examples=HUGE if self.attack == "rehello" else len(self.data), loss=0.1)
        crafted = Message(
            update.kind,
            update.round,
            update.run,
            update.client,
            {**update.params, **wire.to_params(report)},
            {n: t.contiguous() for n, t in tensors.items()},
            update.transport,
        )
        return encode_update(task, crafted, plain, self.store)


class Scaled(EdgeClient):
    """Answers every task with ``w_g + d``, where d points along ``attack`` and is ``times`` its honest update's
    norm: a sign flip, a replacement toward the output layer rotated by one class, or toward the zero model."""

    def __init__(self, honest: EdgeClient, attack: str, times: float) -> None:
        super().__init__(honest.client_id, honest.data, honest.backend)
        self.attack, self.times = attack, times

    def handle(self, task: Message, broadcast: Message | None, backend: Backend | None = None) -> Message:
        assert broadcast is not None
        plain = decode_broadcast(broadcast)
        w_g = dict(plain.tensors)
        update = ALGORITHMS[task.param("algorithm")].client.step(
            task, plain, self.data, backend or self.backend, self.store
        )
        honest = dict(update.tensors)
        if self.attack == "sign_flip":
            direction = {n: w_g[n] - honest[n] for n in w_g}
        elif self.attack == "replacement":
            direction = {n: v.roll(1, dims=0) - v if n.startswith(OUTPUT_LAYER) else 0 * v for n, v in w_g.items()}
        else:  # zero model
            direction = {n: -v for n, v in w_g.items()}
        scale = self.times * update_norm(honest, w_g) / update_norm({n: w_g[n] + d for n, d in direction.items()}, w_g)
        tensors = {n: (w_g[n] + scale * d).contiguous() for n, d in direction.items()}
        crafted = Message(
            update.kind, update.round, update.run, update.client, update.params, tensors, update.transport
        )
        return encode_update(task, crafted, plain, self.store)


def refused(record: RoundRecord) -> set[str]:
    """Clients refused in the round: at arrival (a rejection) or at aggregation (a drop that says refused)."""
    return {r.client for r in record.rejections if "refused" in r.detail} | {
        d.client for d in record.drops if d.reason.startswith("refused")
    }


class Absent(EdgeClient):
    """A client whose every answer is an error: the round aggregates without it (quorum permitting)."""

    def handle(self, task: Message, broadcast: Message | None, backend: Backend | None = None) -> Message:
        raise ValueError("absent")


def dsfl_accuracies(
    robust: str, attackers: int, rounds: int = 10, seed: int = 0, aggregation: str = "era", absent: int = 0
) -> list[float]:
    """DS-FL on digits (tiny_mlp, IID, 10 clients, ERA or SA): the accuracy after each round, in process through the
    coordinator's round engine (quorum 0.5, as a deployment's), the first ``attackers`` clients uploading confidently
    wrong rows. ``absent``: the first clients (after the attackers) never answer, so every round aggregates the
    others only: leaving out all of ``absent`` honest uploads is the best a filter of as many liars could do."""
    config = RunConfig(
        algorithm="dsfl",
        dataset="digits",
        model="tiny_mlp",
        num_clients=10,
        rounds=rounds,
        seed=seed,
        partition="iid",
        min_replies=0.5,
        train=TrainConfig(local_epochs=2, lr=0.1),
        algo=DSFLSettings(robust=robust, open_per_round=300, aggregation=aggregation),
    )
    exp = prepare(config)
    open_x = exp.open_x()
    backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes)
    clients: list[EdgeClient] = [EdgeClient(c, exp.client_data(c, open_x), backend) for c in sorted(exp.parts)]
    clients[:attackers] = [Insider(c, "confident_wrong") for c in clients[:attackers]]
    gone = slice(attackers, attackers + absent)
    clients[gone] = [Absent(c.client_id, c.data, c.backend) for c in clients[gone]]
    test_x, test_y = exp.test_tensors()
    history = RoundEngine(exp.config, exp.strategy("dsfl"), InProcessTransport(clients), test_x, test_y).run()
    return [float(r.accuracy or 0.0) for r in history.rounds]


BACKDOOR_TARGET = 0


def trigger(x: torch.Tensor, value: float) -> torch.Tensor:
    """``x`` (N, C, H, W) with its 3x3 top-left corner set to ``value`` (the backdoor's pixel trigger)."""
    out = x.clone()
    out[..., :3, :3] = value
    return out


def poisoned(data: ClientData, value: float, seed: int, share: float = 0.5) -> ClientData:
    """A data-poisoning client's own data: a fixed ``share`` of it triggered and relabelled to
    :data:`BACKDOOR_TARGET` (no boosting, no crafted update: it trains and uploads as an honest client would)."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(len(data.y), generator=g)[: int(share * len(data.y))]
    x, y = data.x.clone(), data.y.clone()
    x[chosen] = trigger(x[chosen], value)
    y[chosen] = BACKDOOR_TARGET
    return ClientData(x, y, data.num_classes, data.open_x)
