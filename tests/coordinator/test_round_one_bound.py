"""Round 1 is bounded as tightly as later rounds (issue 52): with no earlier round, an update is judged at aggregation
against the median update norm of round 1's own replies (a reference an attacker minority cannot move), so an update
at 12 x an honest update's norm is refused in round 1 as it is in round 2, and one at 5 x passes in both (the bound,
not exclusion). In process through the coordinator's round engine; digits, tiny_mlp, 10 clients, 2 rounds."""

from __future__ import annotations

import pytest
import torch
from insiders import Scaled, refused

from coordinator.engine import RoundEngine
from edge_client.client import EdgeClient
from fedge.accounting.records import RoundRecord
from fedge.algorithms.base import UpdateReport, update_message
from fedge.algorithms.fedavg import FedAvg, FedAvgSettings
from fedge.config import RunConfig, TrainConfig
from fedge.learning.backend import TorchBackend
from fedge_io.experiment import prepare
from sim.inprocess import InProcessTransport

ATTACKER = "c000"


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
    assert [refused(r) for r in rounds] == [{ATTACKER}, {ATTACKER}]
    assert all(r.aggregated and ATTACKER not in r.replied for r in rounds)


def test_an_update_within_the_bound_passes_in_both_rounds() -> None:
    rounds, _ = _run("sign_flip", 5.0)
    assert [refused(r) for r in rounds] == [set(), set()]
    assert all(ATTACKER in r.replied for r in rounds)


def test_fedbuffs_first_step_is_bounded_as_round_one() -> None:
    """FedBuff (issue 53) steps from a buffer, not through FedAvg's aggregate: its first step, judged at arrival against
    the initial model's norm only, is judged again at the step against its updates' own median, as round 1 is. K =
    concurrency = the cohort, so step 1 buffers the ten version-0 updates, and steps from the nine within the bound; on
    the simulated clock, in process."""
    from sim.clock import load_profiles
    from sim.fedbuff import fedbuff_engine

    config = RunConfig(
        algorithm="fedavg",
        dataset="digits",
        model="tiny_mlp",
        num_clients=10,
        rounds=1,
        partition="iid",
        train=TrainConfig(local_epochs=1, lr=0.1),
        algo=FedAvgSettings(),  # max_update_ratio 10
        client_profiles="uniform:compute=1ms",
        link="lte",
        aggregation="fedbuff",
        buffer_size=10,
        concurrency=10,
    )
    exp = prepare(config)
    backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes)
    clients = [EdgeClient(c, exp.client_data(c), backend) for c in sorted(exp.parts)]
    clients[0] = Scaled(clients[0], "sign_flip", 12.0)
    profiles, _ = load_profiles(config, sorted(exp.parts), lambda: pytest.fail("a given compute is not measured"))
    samples = {c: len(exp.client_data(c)) for c in exp.parts}
    engine = fedbuff_engine(
        config, exp.strategy("fedbuff-bound"), InProcessTransport(clients), *exp.test_tensors(), profiles=profiles,
        samples=samples,
    )  # fmt: skip
    (step,) = engine.run().rounds  # later steps have a history to judge by (refused at arrival, as in round 2)
    assert refused(step) == {ATTACKER} and ATTACKER not in step.replied
    assert step.metrics["buffer_fill"] == 9 and len(step.replied) == 9


def test_a_resumed_fedbuff_still_judges_version_zeros_updates_by_their_median() -> None:
    """The rounds judged without a median are journaled with the strategy: a FedBuff coordinator killed with version
    0's updates in its buffer judges them at the step as the uninterrupted run does (they are not judged again)."""
    config = RunConfig(algorithm="fedavg", dataset="digits", model="tiny_mlp", num_clients=4, partition="iid")
    exp = prepare(config)
    killed, resumed = exp.strategy("resumed-bound"), exp.strategy("resumed-bound")
    assert isinstance(killed, FedAvg) and isinstance(resumed, FedAvg)
    task = killed.configure(1, ["c000"]).tasks["c000"]
    killed.accept(1, "c000", update_message(task, killed.global_weights(), UpdateReport(num_examples=50)))
    resumed.load_state(*killed.state())
    norms = {"c000": 100.0, "c001": 1.0, "c002": 1.1, "c003": 0.9}
    assert [d.client for d in resumed.refused_moves(1, norms)] == ["c000"]
    assert resumed.refused_moves(1, norms) == ()  # judged once
