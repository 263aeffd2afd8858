"""FedCAD, one round of two clients with two local steps, against eq. 1-3 by hand and with autograd.

Eq. 2 sums L_d over the local data; fedge averages both terms over the batch, as the CE of eq. 1 is averaged, which
only rescales the learning rate. A class absent from a client's data gets the midpoint (gamma + beta) / 2 (phi = 0):
eq. 3 estimates E_{x|y} on local data and leaves that case open; no local sample ever uses that weight.
"""

import math

import pytest
import torch
from algorithm_support import NUM_CLASSES, W0, X_A, X_B, Y_A, Y_B, TwoClients, ce_gradient, config

from fedge.algorithms.fedcad import FedCADSettings
from fedge.algorithms.fedlsd import FedLSDSettings

LR, STEPS = 1.0, 2  # full-batch steps: 2 epochs of one batch
BETA, GAMMA = 0.25, 0.5  # the paper's bounds


def _phi(z_g: list[float], y: int, tau: float) -> float:
    """phi(y, p^g(x)) = p^g_y - sum_{k != y} p^g_k, with p^g the teacher's softmax at temperature tau (eq. 2-3)."""
    e = [math.exp(v / tau) for v in z_g]
    p = [v / sum(e) for v in e]
    return p[y] - sum(p[k] for k in range(len(p)) if k != y)


def _alpha(phi: float) -> float:
    """Eq. 3 for one class, E_{x|y}[phi] = phi: each client has one sample per class it holds."""
    return 0.5 * (GAMMA - BETA) * phi + 0.5 * (GAMMA + BETA)


MID = 0.5 * (GAMMA + BETA)


def _expected_alphas(tau: float) -> tuple[list[float], list[float]]:
    # The teacher is W0: its logits W0 @ x on a's (1, 0) [class 0] and (0, 1) [class 1], and on b's (1, 1) [class 2].
    a = [_alpha(_phi([0.2, 0.0, -0.2], 0, tau)), _alpha(_phi([-0.1, 0.3, 0.1], 1, tau)), MID]
    b = [MID, MID, _alpha(_phi([0.1, 0.3, -0.1], 2, tau))]
    return a, b


def _eq1(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, z_g: torch.Tensor, alpha: torch.Tensor, tau: float):
    """Eq. 1-2 per sample, batch mean: (1 - alpha_y) L_c + alpha_y L_d."""
    z = x @ w.T  # (N, C)
    l_c = -torch.log_softmax(z, dim=1)[torch.arange(len(y)), y]  # (N,)
    p_g = torch.exp(z_g / tau) / torch.exp(z_g / tau).sum(1, keepdim=True)  # (N, C) eq. 2's p^g
    p = torch.exp(z / tau) / torch.exp(z / tau).sum(1, keepdim=True)  # (N, C) eq. 2's p
    l_d = -(p_g * torch.log(p)).sum(dim=1)  # (N,)
    a = alpha[y]  # (N,)
    return ((1 - a) * l_c + a * l_d).mean()


def _local(x: torch.Tensor, y: torch.Tensor, alpha: list[float], tau: float) -> torch.Tensor:
    z_g, a = x @ W0.T, torch.tensor(alpha)  # the received global model's logits, frozen for the round
    w = W0
    for _ in range(STEPS):
        w_ = w.clone().requires_grad_()
        (g,) = torch.autograd.grad(_eq1(w_, x, y, z_g, a, tau), w_)
        w = w - LR * g
    return w


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_class_weights_follow_eq_3(tau: float):
    run = TwoClients(config("fedcad", FedCADSettings(cad_beta=BETA, cad_gamma=GAMMA, kd_tau=tau), lr=LR))
    run.round(1)
    want_a, want_b = _expected_alphas(tau)
    got_a = run.backend("a").requests[0].inputs["class_weights"]
    got_b = run.backend("b").requests[0].inputs["class_weights"]
    assert torch.allclose(got_a, torch.tensor(want_a), atol=1e-7)
    assert torch.allclose(got_b, torch.tensor(want_b), atol=1e-7)
    # W0 gives each true class less than half its mass (phi < 0), least on b's class 2: all weights below the midpoint.
    assert BETA < want_b[2] < want_a[0] < MID and want_a[2] == want_b[0] == want_b[1] == MID


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_one_round_follows_eq_1_2(tau: float):
    run = TwoClients(
        config("fedcad", FedCADSettings(cad_beta=BETA, cad_gamma=GAMMA, kd_tau=tau), local_epochs=STEPS, lr=LR)
    )
    run.round(1)
    alpha_a, alpha_b = _expected_alphas(tau)
    w_a, w_b = _local(X_A, Y_A, alpha_a, tau), _local(X_B, Y_B, alpha_b, tau)
    assert torch.allclose(run.global_weight(), (2 * w_a + w_b) / 3, atol=1e-6)
    # Step 1, closed form: student = teacher, so L_d has zero gradient and the step is CE's scaled by 1 - alpha_y.
    z_g = X_A @ W0.T
    scale = (1 - torch.tensor(alpha_a)[Y_A]).unsqueeze(1)  # (N, 1)
    closed = ((torch.softmax(z_g, 1) - torch.eye(NUM_CLASSES)[Y_A]) * scale).T @ X_A / 2
    w_ = W0.clone().requires_grad_()
    (auto,) = torch.autograd.grad(_eq1(w_, X_A, Y_A, z_g, torch.tensor(alpha_a), tau), w_)
    assert torch.allclose(auto, closed, atol=1e-7)
    assert not torch.allclose(auto, ce_gradient(W0, X_A, Y_A), atol=1e-3)


def test_equal_bounds_are_fedlsd_and_zero_bounds_are_fedavg():
    """Below eq. 3: gamma = beta = w is FedLSD with weight w; gamma = beta = 0 is FedAvg."""
    cad = TwoClients(config("fedcad", FedCADSettings(cad_beta=0.3, cad_gamma=0.3, kd_tau=2.0), local_epochs=2))
    lsd = TwoClients(config("fedlsd", FedLSDSettings(lsd_weight=0.3, kd_tau=2.0), local_epochs=2))
    cad0 = TwoClients(config("fedcad", FedCADSettings(cad_beta=0.0, cad_gamma=0.0), local_epochs=2))
    avg = TwoClients(config("fedavg", local_epochs=2))
    for run in (cad, lsd, cad0, avg):
        run.round(1)
    assert torch.allclose(cad.global_weight(), lsd.global_weight(), atol=1e-7)
    assert torch.allclose(cad0.global_weight(), avg.global_weight(), atol=1e-7)
    assert not torch.allclose(cad.global_weight(), avg.global_weight(), atol=1e-3)
