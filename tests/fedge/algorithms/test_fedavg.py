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
