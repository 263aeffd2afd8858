"""FedNova, one round of two clients with different step counts, against Wang et al.'s normalized averaging by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from algorithm_support import W0, TwoClients, assert_mqtt_run_matches_inprocess, config

from fedge.algorithms.base import Strategy, UpdateReport
from fedge.algorithms.fednova import FedNovaReport, FedNovaSettings, accumulation_norm
from fedge.config import RunConfig, TrainConfig
from fedge.errors import CodecError
from fedge.wire.fields import to_params
from fedge.wire.message import Message

# Client "a" holds 4 samples, "b" 2: with batch 2, a takes 2 steps per epoch and b takes 1.
X_A = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.5, -0.5]])
Y_A = torch.tensor([0, 1, 2, 0])
X_B = torch.tensor([[1.0, 1.0], [-1.0, 0.5]])
Y_B = torch.tensor([2, 1])
DATA = ((X_A, Y_A), (X_B, Y_B))


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_one_round_normalizes_each_update_by_its_local_work(momentum: float) -> None:
    run = TwoClients(config("fednova", FedNovaSettings(), batch_size=2, momentum=momentum), data=DATA)
    run.round(1)
    steps = {c: int(run.transport.replies[1][c].params["local_steps"]) for c in ("a", "b")}
    assert steps == {"a": 2, "b": 1}
    y = {c: run.upload(1, c, "weight") for c in ("a", "b")}
    p = {"a": 4 / 6, "b": 2 / 6}
    rho = momentum
    a = {c: float(n) if rho == 0 else (n - rho * (1 - rho**n) / (1 - rho)) / (1 - rho) for c, n in steps.items()}
    tau_eff = sum(p[c] * a[c] for c in p)
    expected = W0 - tau_eff * sum(p[c] * (W0 - y[c]) / a[c] for c in p)
    assert torch.allclose(run.global_weight(), expected, atol=1e-7)
    # FedAvg's average of the same uploads would differ: b's single step would count as much as a's two.
    fedavg = sum(p[c] * y[c] for c in p)
    assert not torch.allclose(expected, fedavg, atol=1e-4)


def test_each_reply_report_is_parsed_once_and_travels_checked_to_aggregation(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's accept parses a reply's report with its bounds; averaging weights, the loss metric and FedNova's
    step counts read that parsed report (CheckedReply.report) instead of parsing the reply's strings again."""
    parsed: list[str] = []
    report_of = Strategy.report_of

    def counting(self: Strategy, reply: Message) -> UpdateReport:
        parsed.append(reply.client)
        return report_of(self, reply)

    monkeypatch.setattr(Strategy, "report_of", counting)
    run = TwoClients(config("fednova", FedNovaSettings(), batch_size=2), data=DATA)
    record = run.round(1)
    assert sorted(parsed) == ["a", "b"] and record.metrics["fednova_tau_eff"] > 0


def test_equal_local_work_is_fedavg() -> None:
    nova = TwoClients(config("fednova", batch_size=8, local_epochs=2))
    avg = TwoClients(config("fedavg", batch_size=8, local_epochs=2))
    nova.round(1)
    avg.round(1)
    assert torch.allclose(nova.global_weight(), avg.global_weight(), atol=1e-7)


def test_accumulation_norm_sums_the_momentum_series() -> None:
    rho, steps = 0.9, 7
    series = sum(sum(rho**j for j in range(k + 1)) for k in range(steps))  # sum over steps of 1 + rho + ... + rho^k
    assert accumulation_norm(steps, rho) == pytest.approx(series)
    assert accumulation_norm(steps, 0.0) == steps


@pytest.mark.parametrize("steps", [0, 5])
def test_a_step_count_the_declared_data_cannot_take_is_refused(steps: int) -> None:
    run = TwoClients(config("fednova", batch_size=2), data=DATA)
    plan = run.strategy.configure(1, ["a"])
    report = FedNovaReport(num_examples=4, loss=0.1, local_steps=steps)  # 4 examples, batch 2, 1 epoch: 1 or 2 steps
    weights = dict(plan.broadcast.tensors) if plan.broadcast else {}
    reply = Message("update", 1, run="t", client="a", params=to_params(report), tensors=weights)
    with pytest.raises(CodecError, match=f"reports {steps} local steps"):
        run.strategy.check_reply(1, "a", reply)


@pytest.mark.broker
def test_over_the_secured_embedded_broker_it_gives_the_in_process_model(tmp_path: Path) -> None:
    """The step count travels in each client process's report; unequal clients (Dirichlet) make it matter."""
    cfg = RunConfig(
        algorithm="fednova",
        dataset="digits",
        model="tiny_mlp",
        num_clients=3,
        rounds=2,
        partition="dirichlet",
        dirichlet_alpha=0.5,
        train=TrainConfig(local_epochs=1),
    )
    inprocess = assert_mqtt_run_matches_inprocess(cfg, tmp_path)
    assert inprocess.rounds[0].metrics["fednova_tau_eff"] > 0
