"""FedProx, one round of two clients, against FedProx eq. 2 by hand: each local step adds mu * (w - w_global)."""

import torch
from algorithm_support import W0, X_A, X_B, Y_A, Y_B, TwoClients, ce_gradient, config

from fedge.algorithms.fedprox import FedProxSettings


def _local(x: torch.Tensor, y: torch.Tensor, mu: float, lr: float = 0.5, steps: int = 2) -> torch.Tensor:
    w = W0
    for _ in range(steps):  # full-batch gradient steps on CE + mu/2 ||w - W0||^2
        w = w - lr * (ce_gradient(w, x, y) + mu * (w - W0))
    return w


def test_one_round_takes_proximal_gradient_steps():
    run = TwoClients(config("fedprox", FedProxSettings(prox_mu=0.4), local_epochs=2))
    run.round(1)
    expected = (2 * _local(X_A, Y_A, 0.4) + _local(X_B, Y_B, 0.4)) / 3
    assert torch.allclose(run.global_weight(), expected, atol=1e-7)
    # The proximal term matters from the second step on: the result differs from FedAvg's.
    plain = (2 * _local(X_A, Y_A, 0.0) + _local(X_B, Y_B, 0.0)) / 3
    assert not torch.allclose(expected, plain, atol=1e-4)


def test_mu_zero_is_fedavg():
    prox, avg = TwoClients(config("fedprox", FedProxSettings(prox_mu=0.0), local_epochs=2)), None
    avg = TwoClients(config("fedavg", local_epochs=2))
    prox.round(1)
    avg.round(1)
    assert torch.equal(prox.global_weight(), avg.global_weight())


def test_the_task_carries_mu():
    run = TwoClients(config("fedprox", FedProxSettings(prox_mu=0.25)))
    task = run.strategy.configure(1, ["a"]).tasks["a"]
    assert task.params["prox_mu"] == "0.25" and "weighting" not in task.params  # server-only settings stay home
