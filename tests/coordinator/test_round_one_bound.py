"""Round 1 is bounded as tightly as later rounds (issue 52): with no earlier round, an update is judged at aggregation
against the median update norm of round 1's own replies (a reference an attacker minority cannot move), so an update
at 12 x an honest update's norm is refused in round 1 as it is in round 2, and one at 5 x passes in both (the bound,
not exclusion). In process through the coordinator's round engine; digits, tiny_mlp, 10 clients, 2 rounds."""

from __future__ import annotations

import pytest
import torch

from coordinator.engine import RoundEngine
from edge_client.client import EdgeClient
from fedge.accounting.records import RoundRecord
from fedge.aggregation.robust import update_norm
from fedge.algorithms.fedavg import FedAvgSettings
from fedge.compression.strategy import decode_broadcast, encode_update
from fedge.config import RunConfig, TrainConfig
from fedge.learning.backend import Backend, TorchBackend
from fedge.registry import ALGORITHMS
from fedge.wire.message import Message
from fedge_io.experiment import prepare
from sim.inprocess import InProcessTransport

ATTACKER = "c000"


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
            direction = {n: v.roll(1, dims=0) - v if n.startswith("layers.2.") else 0 * v for n, v in w_g.items()}
        else:  # zero model
            direction = {n: -v for n, v in w_g.items()}
        scale = self.times * update_norm(honest, w_g) / update_norm({n: w_g[n] + d for n, d in direction.items()}, w_g)
        tensors = {n: (w_g[n] + scale * d).contiguous() for n, d in direction.items()}
        crafted = Message(
            update.kind, update.round, update.run, update.client, update.params, tensors, update.transport
        )
        return encode_update(task, crafted, plain, self.store)


def _refused(record: RoundRecord) -> set[str]:
    """Clients refused in the round: at arrival (a rejection) or at aggregation (a drop that says refused)."""
    return {r.client for r in record.rejections if "refused" in r.detail} | {
        d.client for d in record.drops if d.reason.startswith("refused")
    }


def _run(attack: str, times: float) -> tuple[list[RoundRecord], dict[str, torch.Tensor]]:
    config = RunConfig(
        algorithm="fedavg",
        dataset="digits",
        model="tiny_mlp",
        num_clients=10,
        rounds=2,
        partition="iid",
        min_replies=0.5,
        train=TrainConfig(local_epochs=1, lr=0.1),
        algo=FedAvgSettings(),  # max_update_ratio 10
    )
    exp = prepare(config)
    backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes)
    clients = [EdgeClient(c, exp.client_data(c), backend) for c in sorted(exp.parts)]
    assert clients[0].client_id == ATTACKER
    clients[0] = Scaled(clients[0], attack, times)
    strategy = exp.strategy("round-one")
    test_x, test_y = exp.test_tensors()
    history = RoundEngine(exp.config, strategy, InProcessTransport(clients), test_x, test_y).run()
    weights = strategy.global_weights()
    assert weights is not None
    return history.rounds, weights


@pytest.mark.parametrize("attack", ["sign_flip", "replacement", "zero"])
def test_an_update_out_of_bound_is_refused_in_round_one_as_in_round_two(attack: str) -> None:
    rounds, _ = _run(attack, 12.0)
    assert [_refused(r) for r in rounds] == [{ATTACKER}, {ATTACKER}]
    assert all(r.aggregated and ATTACKER not in r.replied for r in rounds)


def test_an_update_within_the_bound_passes_in_both_rounds() -> None:
    rounds, _ = _run("sign_flip", 5.0)
    assert [_refused(r) for r in rounds] == [set(), set()]
    assert all(ATTACKER in r.replied for r in rounds)
