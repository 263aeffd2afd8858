"""FedLSD, one round of two clients with two local steps: FedCAD eq. 1-2 with one constant weight w, in closed form.

Per sample, d/dz of (1 - w) CE + w L_d is (1 - w)(p - onehot_y) + (w / tau)(p_tau - p^g_tau) (eq. 2's softmaxes at
temperature tau; the teacher is the received global model, frozen for the round), and z = W x.
"""

import pytest
import torch
from algorithm_support import NUM_CLASSES, W0, X_A, X_B, Y_A, Y_B, TwoClients, ce_gradient, config

from fedge.algorithms.fedlsd import FedLSDSettings

LR, STEPS = 1.0, 2  # full-batch steps: 2 epochs of one batch


def _gradient(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, weight: float, tau: float) -> torch.Tensor:
    z, z_g = x @ w.T, x @ W0.T  # (N, C) student and teacher logits
    dz = (1 - weight) * (torch.softmax(z, 1) - torch.eye(NUM_CLASSES)[y]) + weight / tau * (
        torch.softmax(z / tau, 1) - torch.softmax(z_g / tau, 1)
    )  # (N, C)
    return dz.T @ x / len(x)  # (C, features): batch mean


def _local(x: torch.Tensor, y: torch.Tensor, weight: float, tau: float) -> torch.Tensor:
    w = W0
    for _ in range(STEPS):
        w = w - LR * _gradient(w, x, y, weight, tau)
    return w


@pytest.mark.parametrize(("weight", "tau"), [(0.3, 1.0), (0.6, 3.0)])
def test_one_round_with_a_constant_weight(weight: float, tau: float):
    run = TwoClients(config("fedlsd", FedLSDSettings(lsd_weight=weight, kd_tau=tau), local_epochs=STEPS, lr=LR))
    run.round(1)
    expected = (2 * _local(X_A, Y_A, weight, tau) + _local(X_B, Y_B, weight, tau)) / 3
    assert torch.allclose(run.global_weight(), expected, atol=1e-6)
    # Every class gets the same weight, whatever the teacher says.
    for cid in ("a", "b"):
        assert torch.equal(run.backend(cid).requests[0].inputs["class_weights"], torch.full((NUM_CLASSES,), weight))
    # Step 1 is CE's scaled by 1 - w (student = teacher); step 2 also feels the distillation.
    assert torch.allclose(_gradient(W0, X_A, Y_A, weight, tau), (1 - weight) * ce_gradient(W0, X_A, Y_A), atol=1e-7)
    plain = (2 * _local(X_A, Y_A, 0.0, tau) + _local(X_B, Y_B, 0.0, tau)) / 3
    assert not torch.allclose(expected, plain, atol=1e-3)


def test_weight_zero_is_fedavg():
    lsd = TwoClients(config("fedlsd", FedLSDSettings(lsd_weight=0.0), local_epochs=STEPS))
    avg = TwoClients(config("fedavg", local_epochs=STEPS))
    lsd.round(1)
    avg.round(1)
    assert torch.allclose(lsd.global_weight(), avg.global_weight(), atol=1e-7)
