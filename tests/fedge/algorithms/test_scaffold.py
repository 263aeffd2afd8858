"""SCAFFOLD, two rounds of two clients, against Karimireddy et al.'s Algorithm 1 (option II) by hand."""

import torch
from algorithm_support import W0, X_A, X_B, Y_A, Y_B, TwoClients, ce_gradient, config

from fedge.algorithms.scaffold import CONTROL, CONTROL_DELTA

LR, K = 0.5, 2  # local learning rate; full-batch steps per round (2 epochs of one batch)


def _client(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, c: torch.Tensor, c_i: torch.Tensor):
    """Lines 9-12: K corrected steps, then c_i+ = c_i - c + (x - y) / (K lr). Returns (y, c_i+)."""
    y_i = w
    for _ in range(K):
        y_i = y_i - LR * (ce_gradient(y_i, x, y) - c_i + c)
    return y_i, c_i - c + (w - y_i) / (K * LR)


def test_two_rounds_follow_algorithm_1():
    run = TwoClients(config("scaffold", local_epochs=2))
    zero = torch.zeros_like(W0)
    # Round 1: c = c_i = 0, so the clients take plain steps; the server averages (by data size, as FedAvg) and moves
    # c by |S|/N = 1 times the mean of the clients' control deltas.
    y_a, ca = _client(X_A, Y_A, W0, zero, zero)
    y_b, cb = _client(X_B, Y_B, W0, zero, zero)
    x1, c1 = (2 * y_a + y_b) / 3, (ca + cb) / 2
    run.round(1)
    assert torch.allclose(run.global_weight(), x1, atol=1e-6)
    assert torch.allclose(run.strategy._control["weight"], c1, atol=1e-6)
    # Round 2: the correction c - c_i is now non-zero for each client.
    y_a2, ca2 = _client(X_A, Y_A, x1, c1, ca)
    y_b2, cb2 = _client(X_B, Y_B, x1, c1, cb)
    run.round(2)
    assert torch.allclose(run.global_weight(), (2 * y_a2 + y_b2) / 3, atol=1e-6)
    assert torch.allclose(run.strategy._control["weight"], c1 + ((ca2 - ca) + (cb2 - cb)) / 2, atol=1e-6)


def test_messages_carry_the_control_variate_both_ways():
    run = TwoClients(config("scaffold"))
    record = run.round(1)
    plan = run.strategy.configure(2, ["a", "b"])
    assert plan.broadcast is not None and set(plan.broadcast.tensors) == {"weight", CONTROL + "weight"}
    assert set(run.strategy.reply_tensors()) == {"weight", CONTROL_DELTA + "weight"}
    # Twice FedAvg's tensor bytes each way: 3 x 2 float32 weights plus as many control values.
    assert record.bytes.tensor_up == 2 * (2 * 6 * 4) and record.bytes.tensor_down["multicast"] == 2 * 6 * 4
