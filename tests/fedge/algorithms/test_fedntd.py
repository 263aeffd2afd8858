"""FedNTD, one round of two clients with two local steps, against eq. 10-11 written out and differentiated by autograd.

The distillation term is scaled by tau^2 as in the authors' ``criterion.py`` (``loss = tau**2 * KLDiv(...)``); eq. 10
as printed has no tau^2, so for tau != 1 fedge's beta acts as the paper's beta * tau^2 (documented in
``fedge.learning.losses.ntd_loss``; see ``test_tau_squared_is_the_only_departure_from_eq_10_as_printed``).
"""

import pytest
import torch
from algorithm_support import NUM_CLASSES, W0, X_A, X_B, Y_A, Y_B, TwoClients, ce_gradient, config

from fedge.algorithms.fedntd import FedNTDSettings, NotTrueDistillation

LR, STEPS = 1.0, 2  # full-batch steps: 2 epochs of one batch; lr 1 so that step 2 clearly feels the distillation


def _drop_true(v: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(N, C) -> (N, C-1): each row without its true class's column, the sums over c != y of eq. 11."""
    keep = torch.ones_like(v, dtype=torch.bool)
    keep[torch.arange(len(y)), y] = False
    return v[keep].view(len(y), NUM_CLASSES - 1)


def _eq10(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, z_g: torch.Tensor, beta: float, tau: float, scale: float):
    """Eq. 10 with eq. 11, batch mean: CE(q^l, 1_y) + beta * scale * L_NTD(q~^l, q~^g)."""
    z_l = x @ w.T  # (N, C) local logits
    ce = -torch.log_softmax(z_l, dim=1)[torch.arange(len(y)), y].mean()
    nt_l, nt_g = torch.exp(_drop_true(z_l, y) / tau), torch.exp(_drop_true(z_g, y) / tau)  # (N, C-1)
    q_l, q_g = nt_l / nt_l.sum(1, keepdim=True), nt_g / nt_g.sum(1, keepdim=True)  # eq. 11's two softmaxes
    ntd = -(q_g * torch.log(q_l / q_g)).sum(dim=1).mean()
    return ce + beta * scale * ntd


def _gradient(
    w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, z_g: torch.Tensor, beta: float, tau: float, scale: float
) -> torch.Tensor:
    """d/dW of eq. 10 at ``w``, by autograd."""
    w = w.clone().requires_grad_()
    (g,) = torch.autograd.grad(_eq10(w, x, y, z_g, beta, tau, scale), w)
    return g


def _local(x: torch.Tensor, y: torch.Tensor, beta: float, tau: float, scale: float) -> torch.Tensor:
    z_g = x @ W0.T  # the received global model's logits, frozen for the round (Algorithm 1)
    w = W0
    for _ in range(STEPS):
        w = w - LR * _gradient(w, x, y, z_g, beta, tau, scale)
    return w


@pytest.mark.parametrize(("beta", "tau"), [(1.0, 1.0), (0.5, 2.0)])
def test_one_round_follows_eq_10_11(beta: float, tau: float):
    run = TwoClients(config("fedntd", FedNTDSettings(ntd_beta=beta, ntd_tau=tau), local_epochs=STEPS, lr=LR))
    run.round(1)
    w_a, w_b = _local(X_A, Y_A, beta, tau, tau**2), _local(X_B, Y_B, beta, tau, tau**2)
    assert torch.allclose(run.global_weight(), (2 * w_a + w_b) / 3, atol=1e-6)  # FedAvg's data-weighted mean
    # Step 1: the student is the teacher, so the not-true KL has zero gradient and the step is plain CE's.
    for x, y in ((X_A, Y_A), (X_B, Y_B)):
        assert torch.allclose(_gradient(W0, x, y, x @ W0.T, beta, tau, tau**2), ce_gradient(W0, x, y), atol=1e-7)
    # Step 2 is not: the result differs from FedAvg's two CE steps (beta = 0).
    w_ce = (2 * _local(X_A, Y_A, 0.0, tau, 1.0) + _local(X_B, Y_B, 0.0, tau, 1.0)) / 3
    assert not torch.allclose(run.global_weight(), w_ce, atol=1e-3)


def test_tau_squared_is_the_only_departure_from_eq_10_as_printed():
    beta, tau = 0.5, 2.0
    run = TwoClients(config("fedntd", FedNTDSettings(ntd_beta=beta, ntd_tau=tau), local_epochs=STEPS, lr=LR))
    run.round(1)
    as_printed = (2 * _local(X_A, Y_A, beta, tau, 1.0) + _local(X_B, Y_B, beta, tau, 1.0)) / 3
    assert not torch.allclose(run.global_weight(), as_printed, atol=1e-4)
    # fedge's (beta, tau) is eq. 10's (beta * tau^2, tau).
    printed_beta = (2 * _local(X_A, Y_A, beta * tau**2, tau, 1.0) + _local(X_B, Y_B, beta * tau**2, tau, 1.0)) / 3
    assert torch.allclose(run.global_weight(), printed_beta, atol=1e-6)


def test_the_true_class_logit_gets_plain_cross_entropy_gradient():
    """Below eq. 11: dropping the true class before the softmax sends it no distillation gradient."""
    z = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.2, -0.3]], requires_grad=True)  # (N, C) student logits
    z_g = torch.tensor([[-0.4, 0.8, 0.1], [0.3, 1.1, -0.9]])  # teacher logits, far from the student's
    y = torch.tensor([2, 0])
    loss = NotTrueDistillation(tau=2.0, beta=0.3).loss(z, y, {"teacher": z_g})
    (grad,) = torch.autograd.grad(loss, z)
    ce_grad = (torch.softmax(z.detach(), dim=1) - torch.eye(NUM_CLASSES)[y]) / len(y)  # d mean-CE / dz, by hand
    rows = torch.arange(len(y))
    assert torch.allclose(grad[rows, y], ce_grad[rows, y], atol=1e-7)
    # The not-true logits do get the distillation's gradient, so the check above can fail.
    assert (grad - ce_grad).abs().max() > 1e-2
    # And that gradient is eq. 11's: beta * tau^2 * (q~^l - q~^g) / tau per not-true class, batch mean.
    q_l = torch.softmax(_drop_true(z.detach(), y) / 2.0, dim=1)
    q_g = torch.softmax(_drop_true(z_g, y) / 2.0, dim=1)
    assert torch.allclose(_drop_true(grad - ce_grad, y), 0.3 * 4.0 * (q_l - q_g) / 2.0 / len(y), atol=1e-7)
