"""FedAvg, one round of two clients, against the numbers of McMahan et al.'s update and FedNTD eq. 2 by hand."""

import torch
from algorithm_support import W0, X_A, X_B, Y_A, Y_B, TwoClients, ce_gradient, config

from fedge.algorithms.fedavg import FedAvgSettings


def test_one_round_is_the_data_weighted_mean_of_one_gradient_step_each():
    run = TwoClients(config("fedavg"))
    run.round(1)
    w_a = W0 - 0.5 * ce_gradient(W0, X_A, Y_A)
    w_b = W0 - 0.5 * ce_gradient(W0, X_B, Y_B)
    expected = (2 * w_a + 1 * w_b) / 3  # eq. 2: weights by data size, 2 and 1 samples
    assert torch.allclose(run.global_weight(), expected, atol=1e-7)
    # The same, written out: client b's only sample is class 2 at x = (1, 1) with logits W0 @ x = (0.1, 0.3, -0.1).
    p_b = torch.softmax(torch.tensor([0.1, 0.3, -0.1]), dim=0)
    assert torch.allclose(w_b, W0 - 0.5 * torch.outer(p_b - torch.tensor([0.0, 0.0, 1.0]), torch.ones(2)), atol=1e-7)


def test_uniform_weighting_averages_clients_equally():
    run = TwoClients(config("fedavg", FedAvgSettings(weighting="uniform")))
    run.round(1)
    w_a = W0 - 0.5 * ce_gradient(W0, X_A, Y_A)
    w_b = W0 - 0.5 * ce_gradient(W0, X_B, Y_B)
    assert torch.allclose(run.global_weight(), (w_a + w_b) / 2, atol=1e-7)


def test_the_round_reports_the_mean_local_loss():
    record = TwoClients(config("fedavg")).round(1)
    ce_a = torch.nn.functional.cross_entropy(X_A @ W0.T, Y_A)
    ce_b = torch.nn.functional.cross_entropy(X_B @ W0.T, Y_B)
    assert abs(record.metrics["mean_local_loss"] - float(ce_a + ce_b) / 2) < 1e-6


def test_an_accepted_attacker_neither_raises_the_bound_nor_locks_honest_clients_out():
    """The issue's attack: an update just under ``max_update_ratio`` x the global model's norm, under the mean.

    The bound's reference is the recent rounds' median update norm, so in round 2 the same attack is refused, and
    honest updates are accepted. In round 1, with no earlier median, it passes the check at arrival but is left out
    at aggregation against round 1's own median update norm (issue 52), so it does not move the model either.
    """
    import pytest
    from algorithm_support import NUM_CLASSES, linear

    from fedge.aggregation.robust import state_norm
    from fedge.algorithms.base import ServerContext, UpdateReport, update_message
    from fedge.algorithms.fedavg import FedAvg
    from fedge.errors import CodecError

    strategy = FedAvg(config("fedavg"), ServerContext(linear, NUM_CLASSES, run_id="t"))
    honest_ids, attacker = ["h1", "h2", "h3", "h4"], "x"
    steps = [torch.tensor([[0.01, 0.0], [0.0, 0.01], [-0.01, 0.0]]) * (1 + i / 10) for i in range(4)]  # small

    def reply(rnd: int, plan, client: str, w: torch.Tensor):
        return update_message(plan.tasks[client], {"weight": w.contiguous()}, UpdateReport(num_examples=2))

    def old_bound_attack(w_g: torch.Tensor) -> torch.Tensor:
        direction = torch.ones_like(w_g) / w_g.numel() ** 0.5  # unit norm
        return w_g + 0.95 * 10 * max(state_norm({"w": w_g}), 1.0) * direction

    for rnd in (1, 2):
        w_g = strategy.global_weights()["weight"]
        plan = strategy.configure(rnd, [*honest_ids, attacker])
        replies = {c: reply(rnd, plan, c, w_g + s) for c, s in zip(honest_ids, steps, strict=True)}
        # honest: accepted in both rounds, whatever the attacker did to w_g
        checked = {c: strategy.accept(rnd, c, m) for c, m in replies.items()}
        attack = reply(rnd, plan, attacker, old_bound_attack(w_g))
        if rnd == 1:  # no history yet: the initial model's norm is the reference at arrival
            checked[attacker] = strategy.accept(rnd, attacker, attack)
        else:
            with pytest.raises(CodecError, match="reference update norm"):
                strategy.check_reply(rnd, attacker, attack)
        strategy.aggregate(rnd, checked)
        drops = strategy.aggregation_record(rnd).drops
        assert [d.client for d in drops] == ([attacker] if rnd == 1 else [])  # round 1: left out at aggregation
        assert "round's median update norm" in (drops[0].reason if drops else "round's median update norm")
    assert state_norm(strategy.global_weights()) < 1.2 * state_norm({"w": W0})  # the attack never moved the model


def test_the_server_evaluates_on_its_evaluation_device_without_moving_its_model(monkeypatch):
    """``evaluation_device`` (``fedge sim --device cuda``): the evaluation runs on a copy of the global model there;
    the model the strategy aggregates into stays put. Here the "device" is ``meta`` (no GPU on CI machines), so the
    logits themselves are stubbed: what is checked is where the model that computes them lives."""
    from algorithm_support import NUM_CLASSES, linear

    from fedge.algorithms import base
    from fedge.algorithms.base import ServerContext
    from fedge.algorithms.fedavg import FedAvg

    seen: list[torch.device] = []

    def logits_on(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        seen.append(next(model.parameters()).device)
        return torch.zeros(len(x), NUM_CLASSES)

    monkeypatch.setattr(base, "predict_logits", logits_on)
    x, y = torch.randn(4, *X_A.shape[1:]), torch.zeros(4, dtype=torch.long)
    for device in ("cpu", "meta"):
        strategy = FedAvg(config("fedavg"), ServerContext(linear, NUM_CLASSES, run_id="t", evaluation_device=device))
        assert strategy.evaluate(x, y).accuracy == 1.0  # every stubbed prediction is class 0, every label too
        assert next(strategy._model.parameters()).device.type == "cpu"
    assert [d.type for d in seen] == ["cpu", "meta"]
