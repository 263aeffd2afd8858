"""Losses of fedge.learning.losses on tiny hand-computed cases, plus the properties the papers state."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedge.errors import ConfigError
from fedge.learning.losses import (
    class_weighted_distillation_loss,
    fd_distillation_loss,
    fedcad_class_weights,
    kd_loss,
    lsd_loss,
    ntd_loss,
    soft_cross_entropy,
)

LN2, LN3, LN6 = math.log(2.0), math.log(3.0), math.log(6.0)


def _random_batch(seed: int, batch: int, classes: int, dtype: torch.dtype = torch.float64):
    gen = torch.Generator().manual_seed(seed)
    logits = (3.0 * torch.randn(batch, classes, generator=gen, dtype=dtype)).requires_grad_(True)
    teacher = 3.0 * torch.randn(batch, classes, generator=gen, dtype=dtype)
    targets = torch.randint(0, classes, (batch,), generator=gen)
    return logits, teacher, targets


# --- FedNTD (eq. 10-11) -------------------------------------------------------------------------------------------


def test_ntd_hand_case_one_sample_three_classes():
    # Student z = [ln2, ln3, 0], true class y = 0.
    #   CE = -log(2 / (2 + 3 + 1)) = ln 3.
    #   Not-true student logits [ln3, 0] -> q~_s = [3/4, 1/4].
    # Teacher z^g = [5, 0, 0]: not-true logits [0, 0] -> q~_g = [1/2, 1/2] (the teacher's true logit 5 is dropped).
    #   KL(q~_g || q~_s) = 1/2 ln((1/2)/(3/4)) + 1/2 ln((1/2)/(1/4)) = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3).
    # tau = 1, beta = 1: L = ln 3 + 1/2 ln(4/3) = 1.24245332...
    logits = torch.tensor([[LN2, LN3, 0.0]], dtype=torch.float64)
    teacher = torch.tensor([[5.0, 0.0, 0.0]], dtype=torch.float64)
    targets = torch.tensor([0])
    loss = ntd_loss(logits, teacher, targets, tau=1.0, beta=1.0)
    assert loss.item() == pytest.approx(LN3 + 0.5 * math.log(4.0 / 3.0), abs=1e-12)
    assert loss.item() == pytest.approx(1.2424533248940002, abs=1e-12)


def test_ntd_hand_case_temperature_two():
    # Same sample, tau = 2, beta = 0.5. CE is not tempered: still ln 3.
    # Not-true student logits / 2 = [ln3 / 2, 0] -> q~_s = [sqrt3, 1] / (sqrt3 + 1); q~_g still [1/2, 1/2].
    #   KL = 1/2 ln((sqrt3 + 1) / (2 sqrt3)) + 1/2 ln((sqrt3 + 1) / 2) = 1/2 ln((sqrt3 + 1)^2 / (4 sqrt3)).
    # L = ln 3 + 0.5 * 2**2 * KL.
    logits = torch.tensor([[LN2, LN3, 0.0]], dtype=torch.float64)
    teacher = torch.tensor([[5.0, 0.0, 0.0]], dtype=torch.float64)
    s3 = math.sqrt(3.0)
    kl = 0.5 * math.log((s3 + 1.0) ** 2 / (4.0 * s3))
    loss = ntd_loss(logits, teacher, torch.tensor([0]), tau=2.0, beta=0.5)
    assert loss.item() == pytest.approx(LN3 + 0.5 * 4.0 * kl, abs=1e-12)


def test_ntd_ignores_teacher_true_class_logit():
    logits, teacher, targets = _random_batch(0, 8, 10)
    other = teacher.clone()
    other[torch.arange(8), targets] += torch.linspace(-20.0, 20.0, 8, dtype=other.dtype)
    assert torch.equal(ntd_loss(logits, teacher, targets), ntd_loss(logits, other, targets))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("classes", [10, 2])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_ntd_true_class_gradient_is_exactly_the_cross_entropy_gradient(seed, classes, dtype):
    logits, teacher, targets = _random_batch(seed, 16, classes, dtype)
    batch = torch.arange(16)
    (grad,) = torch.autograd.grad(ntd_loss(logits, teacher, targets, tau=2.0, beta=3.0), logits)
    (ce_grad,) = torch.autograd.grad(F.cross_entropy(logits, targets), logits)
    # The distillation term adds an exact 0 to the true-class column: bit-identical to CE alone.
    assert torch.equal(grad[batch, targets], ce_grad[batch, targets])
    # And that is (softmax(z)_y - 1) / B.
    expected = (torch.softmax(logits.detach(), dim=1)[batch, targets] - 1.0) / 16
    torch.testing.assert_close(grad[batch, targets], expected, rtol=0.0, atol=1e-7)
    if classes == 10:
        # Sanity: the distillation term does move the not-true logits.
        assert not torch.equal(grad, ce_grad)


def test_ntd_two_classes_has_no_distillation_term():
    # With C = 2 the not-true softmax has one class, so q~_s = q~_g = 1 and KL = 0 whatever the teacher says.
    logits, teacher, targets = _random_batch(4, 32, 2)
    loss = ntd_loss(logits, teacher, targets, tau=3.0, beta=5.0)
    ce = F.cross_entropy(logits, targets)
    assert torch.equal(loss, ce)
    (grad,) = torch.autograd.grad(loss, logits)
    (ce_grad,) = torch.autograd.grad(F.cross_entropy(logits, targets), logits)
    assert torch.equal(grad, ce_grad)


def test_ntd_kl_is_zero_when_student_equals_teacher():
    logits, _, targets = _random_batch(5, 12, 10)
    for tau in (0.5, 1.0, 4.0):
        loss = ntd_loss(logits, logits.detach().clone(), targets, tau=tau, beta=7.0)
        assert torch.equal(loss, F.cross_entropy(logits, targets))


def test_ntd_scales_distillation_by_beta_tau_squared():
    logits, teacher, targets = _random_batch(6, 12, 10)
    ce = F.cross_entropy(logits, targets)
    kl_tau2 = (ntd_loss(logits, teacher, targets, tau=2.0, beta=1.0) - ce).item()
    assert kl_tau2 > 0
    # beta multiplies linearly.
    scaled = (ntd_loss(logits, teacher, targets, tau=2.0, beta=3.0) - ce).item()
    assert scaled == pytest.approx(3.0 * kl_tau2, rel=1e-10)
    # tau**2 multiplies the KL computed at temperature tau.
    nt = torch.ones_like(logits, dtype=torch.bool)
    nt[torch.arange(12), targets] = False
    student = logits.detach()[nt].view(12, 9) / 2.0
    teacher_nt = teacher[nt].view(12, 9) / 2.0
    kl = F.kl_div(F.log_softmax(student, 1), F.softmax(teacher_nt, 1), reduction="batchmean").item()
    assert kl_tau2 == pytest.approx(4.0 * kl, rel=1e-10)


def test_ntd_beta_zero_is_cross_entropy():
    logits, teacher, targets = _random_batch(7, 12, 10)
    assert torch.equal(ntd_loss(logits, teacher, targets, beta=0.0), F.cross_entropy(logits, targets))


def test_ntd_does_not_backpropagate_into_teacher():
    logits, teacher, targets = _random_batch(8, 4, 5)
    teacher.requires_grad_(True)
    ntd_loss(logits, teacher, targets).backward()
    assert teacher.grad is None
    assert logits.grad is not None


def test_ntd_rejects_bad_input():
    logits, teacher, targets = _random_batch(9, 4, 5)
    with pytest.raises(ValueError, match="teacher_logits"):
        ntd_loss(logits, teacher[:, :4], targets)
    with pytest.raises(ValueError, match="targets"):
        ntd_loss(logits, teacher, targets[:3])
    with pytest.raises(ValueError, match="integer"):
        ntd_loss(logits, teacher, targets.double())
    with pytest.raises(ValueError, match="at least 2 classes"):
        ntd_loss(logits[:, :1], teacher[:, :1], torch.zeros(4, dtype=torch.long))
    with pytest.raises(ConfigError, match="tau"):
        ntd_loss(logits, teacher, targets, tau=0.0)
    with pytest.raises(ConfigError, match="beta"):
        ntd_loss(logits, teacher, targets, beta=-1.0)


# --- KD (FedNTD eq. 3-4) ------------------------------------------------------------------------------------------


def test_kd_hand_case():
    # Student z = [ln3, 0] -> q = [3/4, 1/4]; teacher z^g = [0, 0] -> [1/2, 1/2]; y = 1, tau = 1, beta = 1/2.
    #   CE = -ln(1/4) = ln 4.  KL(teacher || student) = 1/2 ln((1/2)/(3/4)) + 1/2 ln((1/2)/(1/4)) = 1/2 ln(4/3).
    #   L = 1/2 ln 4 + 1/2 * 1/2 ln(4/3) = 0.76506769...
    logits = torch.tensor([[LN3, 0.0]], dtype=torch.float64)
    teacher = torch.zeros(1, 2, dtype=torch.float64)
    loss = kd_loss(logits, teacher, torch.tensor([1]), tau=1.0, beta=0.5)
    assert loss.item() == pytest.approx(0.5 * math.log(4.0) + 0.25 * math.log(4.0 / 3.0), abs=1e-12)


def test_kd_limits():
    logits, teacher, targets = _random_batch(10, 8, 10)
    assert torch.equal(kd_loss(logits, teacher, targets, tau=3.0, beta=0.0), F.cross_entropy(logits, targets))
    pure_kd = kd_loss(logits, teacher, targets, tau=3.0, beta=1.0)
    kl = F.kl_div(F.log_softmax(logits / 3.0, 1), F.softmax(teacher / 3.0, 1), reduction="batchmean")
    torch.testing.assert_close(pure_kd, 9.0 * kl)
    with pytest.raises(ConfigError, match="beta"):
        kd_loss(logits, teacher, targets, tau=1.0, beta=1.5)


# --- FedCAD / FedLSD (FedCAD eq. 1-3) -----------------------------------------------------------------------------


def test_fedcad_class_weights_hand_case():
    # p^g = softmax(z^g), tau = 1, beta = 0.25, gamma = 0.5, so alpha = 0.125 * E[phi] + 0.375, phi = 2 p^g_y - 1.
    #   x1: z^g = [ln6, 0, 0] -> p^g = [3/4, 1/8, 1/8], y = 0: phi = 1/2
    #   x2: z^g = [ln2, 0, 0] -> p^g = [1/2, 1/4, 1/4], y = 0: phi = 0
    #   x3: z^g = [ln2, 0, 0] -> p^g = [1/2, 1/4, 1/4], y = 1: phi = -1/2
    # Class 0: E = 1/4 -> alpha = 0.40625. Class 1: E = -1/2 -> alpha = 0.3125. Class 2 absent -> midpoint 0.375.
    teacher = torch.tensor([[LN6, 0.0, 0.0], [LN2, 0.0, 0.0], [LN2, 0.0, 0.0]], dtype=torch.float64)
    targets = torch.tensor([0, 0, 1])
    weights = fedcad_class_weights(teacher, targets, 3, beta=0.25, gamma=0.5)
    torch.testing.assert_close(weights, torch.tensor([0.40625, 0.3125, 0.375], dtype=torch.float64))


def test_fedcad_class_weights_stay_in_beta_gamma():
    _, teacher, targets = _random_batch(11, 200, 10)
    weights = fedcad_class_weights(teacher, targets, 10, beta=0.1, gamma=0.9, tau=2.0)
    assert weights.shape == (10,)
    assert bool(((weights >= 0.1) & (weights <= 0.9)).all())


def test_fedcad_class_weights_validation():
    _, teacher, targets = _random_batch(12, 6, 4)
    with pytest.raises(ConfigError, match="beta <= gamma"):
        fedcad_class_weights(teacher, targets, 4, beta=0.6, gamma=0.5)
    with pytest.raises(ConfigError, match=r"0 <= beta <= gamma <= 1, got beta=-0.1"):
        fedcad_class_weights(teacher, targets, 4, beta=-0.1, gamma=0.5)
    with pytest.raises(ValueError, match="shape"):
        fedcad_class_weights(teacher, targets, 5)
    with pytest.raises(ValueError, match="lie in"):
        fedcad_class_weights(teacher, torch.full((6,), 4), 4)
    # beta == gamma is allowed: a constant weight (FedLSD), exactly.
    assert torch.equal(
        fedcad_class_weights(teacher, targets, 4, beta=0.3, gamma=0.3), torch.full((4,), 0.3, dtype=teacher.dtype)
    )


def test_class_weighted_loss_hand_case():
    # Student z = [ln3, 0] -> p = [3/4, 1/4]; teacher z^g = [0, 0] -> p^g = [1/2, 1/2]; y = 0; tau = 1; a_0 = 0.25.
    #   CE = ln(4/3).  L_d = -(1/2 ln(3/4) + 1/2 ln(1/4)) = ln 4 - 1/2 ln 3.
    #   L = 0.75 ln(4/3) + 0.25 (ln 4 - 1/2 ln 3).
    logits = torch.tensor([[LN3, 0.0]], dtype=torch.float64)
    teacher = torch.zeros(1, 2, dtype=torch.float64)
    weights = torch.tensor([0.25, 0.9], dtype=torch.float64)
    loss = class_weighted_distillation_loss(logits, teacher, torch.tensor([0]), weights)
    expected = 0.75 * math.log(4.0 / 3.0) + 0.25 * (math.log(4.0) - 0.5 * LN3)
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_fedcad_with_equal_bounds_is_lsd():
    logits, teacher, targets = _random_batch(13, 32, 10)
    for w in (0.0, 0.3, 1.0):
        weights = fedcad_class_weights(teacher, targets, 10, beta=w, gamma=w, tau=2.0)
        cad = class_weighted_distillation_loss(logits, teacher, targets, weights, tau=2.0)
        assert torch.equal(cad, lsd_loss(logits, teacher, targets, weight=w, tau=2.0))


def test_fedcad_with_zero_bounds_is_cross_entropy():
    logits, teacher, targets = _random_batch(14, 32, 10)
    weights = fedcad_class_weights(teacher, targets, 10, beta=0.0, gamma=0.0)
    loss = class_weighted_distillation_loss(logits, teacher, targets, weights)
    torch.testing.assert_close(loss, F.cross_entropy(logits, targets), rtol=0.0, atol=1e-12)


def test_class_weighted_loss_uses_each_sample_class_weight():
    logits, teacher, targets = _random_batch(15, 16, 4)
    weights = torch.tensor([0.1, 0.4, 0.7, 1.0], dtype=torch.float64)
    loss = class_weighted_distillation_loss(logits, teacher, targets, weights, tau=1.5)
    ce = F.cross_entropy(logits, targets, reduction="none")
    soft = -(F.softmax(teacher / 1.5, 1) * F.log_softmax(logits / 1.5, 1)).sum(1)
    a = weights[targets]
    torch.testing.assert_close(loss, ((1 - a) * ce + a * soft).mean())
    with pytest.raises(ValueError, match="class_weights"):
        class_weighted_distillation_loss(logits, teacher, targets, weights[:3])


def test_lsd_validation():
    logits, teacher, targets = _random_batch(16, 4, 4)
    with pytest.raises(ConfigError, match="weight"):
        lsd_loss(logits, teacher, targets, weight=1.2)


# --- soft cross-entropy and FD (DS-FL eq. 7) ----------------------------------------------------------------------


def test_soft_cross_entropy_equals_cross_entropy_for_one_hot():
    logits, _, targets = _random_batch(17, 16, 10)
    one_hot = F.one_hot(targets, 10).to(logits.dtype)
    torch.testing.assert_close(soft_cross_entropy(logits, one_hot), F.cross_entropy(logits, targets))


def test_soft_cross_entropy_hand_case():
    # z = [ln3, 0] -> log p = [ln(3/4), ln(1/4)]; t = [1/2, 1/2]: -(1/2 ln(3/4) + 1/2 ln(1/4)) = ln 4 - 1/2 ln 3.
    loss = soft_cross_entropy(torch.tensor([[LN3, 0.0]], dtype=torch.float64), torch.tensor([[0.5, 0.5]]))
    assert loss.item() == pytest.approx(math.log(4.0) - 0.5 * LN3, abs=1e-12)
    with pytest.raises(ValueError, match="target_probs"):
        soft_cross_entropy(torch.zeros(2, 3), torch.zeros(2, 4))


def test_fd_distillation_loss():
    logits, _, targets = _random_batch(18, 8, 5)
    gen = torch.Generator().manual_seed(18)
    distill = torch.softmax(torch.randn(8, 5, generator=gen, dtype=torch.float64), 1)
    ce = F.cross_entropy(logits, targets)
    loss = fd_distillation_loss(logits, targets, distill, gamma=0.5)
    torch.testing.assert_close(loss, ce + 0.5 * soft_cross_entropy(logits, distill))
    assert torch.equal(fd_distillation_loss(logits, targets, distill, gamma=0.0), ce)
    # Masked samples drop their distillation term but still count in the batch mean.
    mask = torch.tensor([True, False] * 4)
    per_sample = -(distill * F.log_softmax(logits, 1)).sum(1)
    masked = fd_distillation_loss(logits, targets, distill, gamma=0.5, mask=mask)
    torch.testing.assert_close(masked, ce + 0.5 * (per_sample * mask).sum() / 8)
    with pytest.raises(ValueError, match="mask"):
        fd_distillation_loss(logits, targets, distill, gamma=0.5, mask=mask.float())
    with pytest.raises(ConfigError, match="gamma"):
        fd_distillation_loss(logits, targets, distill, gamma=-1.0)
