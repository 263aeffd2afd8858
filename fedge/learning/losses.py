"""Local training losses of the weight-sharing and output-sharing algorithms.

- FedNTD, Lee et al. (NeurIPS 2022): not-true distillation, eq. 10-11; Hinton KD as written in their eq. 3-4.
- FedCAD, He et al. (AAAI 2022): class-wise adaptive self distillation, eq. 1-3; FedLSD is FedCAD with constant weight.
- FD / DS-FL, Itahara et al. (IEEE TMC): distillation regularizer of eq. 7, with DS-FL's "logits" being softmax outputs.

Every loss is a pure function of its inputs and returns a scalar averaged over the batch. Teacher outputs are constants:
they are detached here, so callers need not remember ``torch.no_grad()``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fedge.errors import ConfigError
from fedge.types import Logits, Probs

__all__ = [
    "class_weighted_distillation_loss",
    "fd_distillation_loss",
    "fedcad_class_weights",
    "kd_loss",
    "lsd_loss",
    "ntd_loss",
    "soft_cross_entropy",
]


def ntd_loss(logits: Logits, teacher_logits: Logits, targets: Tensor, *, tau: float = 1.0, beta: float = 1.0) -> Tensor:
    """FedNTD loss, eq. 10-11: ``CE(logits, y) + beta * tau**2 * KL(q~_teacher || q~_student)``.

    ``q~`` is the softmax at temperature ``tau`` over the C-1 not-true classes of each sample: the true class's logit is
    dropped before the softmax, so the distillation term sends no gradient to it (FedNTD sec. 3, below eq. 11). The KL
    is summed over classes and averaged over the batch. The ``tau**2`` factor is not in eq. 10 but is in the authors'
    ``criterion.py``; it keeps the distillation gradient's size independent of ``tau`` (Hinton et al.).
    """
    _check_pair(logits, teacher_logits, targets)
    _check_positive("tau", tau)
    _check_nonnegative("beta", beta)
    if logits.shape[1] < 2:
        raise ValueError(f"ntd_loss needs at least 2 classes to have a not-true class, got {logits.shape[1]}")
    targets = targets.long()
    ce = F.cross_entropy(logits, targets)
    student_nt = _not_true(logits, targets)  # (B, C-1)
    teacher_nt = _not_true(teacher_logits.detach(), targets)  # (B, C-1)
    kl = _kl_batchmean(student_nt / tau, teacher_nt / tau)
    return ce + beta * tau**2 * kl


def kd_loss(logits: Logits, teacher_logits: Logits, targets: Tensor, *, tau: float, beta: float) -> Tensor:
    """Hinton knowledge distillation as written in FedNTD eq. 3-4, over all classes.

    ``(1 - beta) * CE(logits, y) + beta * tau**2 * KL(q_tau^T || q_tau^S)``, KL summed over classes, batch mean.
    """
    _check_pair(logits, teacher_logits, targets)
    _check_positive("tau", tau)
    _check_unit("beta", beta)
    ce = F.cross_entropy(logits, targets.long())
    kl = _kl_batchmean(logits / tau, teacher_logits.detach() / tau)
    return (1.0 - beta) * ce + beta * tau**2 * kl


def fedcad_class_weights(
    teacher_logits: Logits,
    targets: Tensor,
    num_classes: int,
    *,
    beta: float = 0.25,
    gamma: float = 0.5,
    tau: float = 1.0,
) -> Tensor:
    """FedCAD class-wise distillation weights, eq. 3; returns ``alpha`` of shape (C,).

    ``alpha_y = (gamma - beta) / 2 * E_{x|y}[phi(y, p^g(x))] + (gamma + beta) / 2`` with
    ``phi = p^g_y - sum_{k != y} p^g_k = 2 p^g_y - 1`` and ``p^g = softmax(teacher_logits / tau)``, the temperature of
    eq. 2. The expectation is estimated on the given samples, which should be all of the client's local data.

    Since phi lies in [-1, 1], alpha lies in [beta, gamma]: a class on which the global model is confident gets more
    distillation. A class absent from ``targets`` gets the midpoint ``(gamma + beta) / 2``, the value for phi = 0: the
    local data gives no evidence either way, and the weight is never used because no local sample carries that label.

    FedCAD asks for ``0 < beta < gamma < 1``; equality is allowed because ``beta == gamma == w`` is FedLSD with weight
    ``w`` and ``beta == gamma == 0`` is FedAvg (FedCAD, below eq. 3).
    """
    if teacher_logits.dim() != 2 or teacher_logits.shape[1] != num_classes:
        raise ValueError(f"teacher_logits must have shape (batch, {num_classes}), got {tuple(teacher_logits.shape)}")
    _check_targets(targets, teacher_logits.shape[0])
    if not 0.0 <= beta <= gamma <= 1.0:
        raise ConfigError(f"FedCAD needs 0 <= beta <= gamma <= 1, got beta={beta}, gamma={gamma}")
    _check_positive("tau", tau)
    targets = targets.long()
    if targets.numel() and not (int(targets.min()) >= 0 and int(targets.max()) < num_classes):
        raise ValueError(f"targets must lie in [0, {num_classes}), got [{int(targets.min())}, {int(targets.max())}]")
    probs = torch.softmax(teacher_logits.detach() / tau, dim=1)  # (B, C)
    phi = 2.0 * probs.gather(1, targets.unsqueeze(1)).squeeze(1) - 1.0  # (B,)
    sums = torch.zeros(num_classes, dtype=phi.dtype, device=phi.device).index_add_(0, targets, phi)  # (C,)
    counts = torch.bincount(targets, minlength=num_classes)  # (C,)
    # E = 0 for absent classes puts them at the midpoint; clamp only avoids 0/0.
    expectation = torch.where(counts > 0, sums / counts.clamp_min(1), torch.zeros_like(sums))  # (C,)
    return (gamma - beta) / 2.0 * expectation + (gamma + beta) / 2.0


def class_weighted_distillation_loss(
    logits: Logits, teacher_logits: Logits, targets: Tensor, class_weights: Tensor, *, tau: float = 1.0
) -> Tensor:
    """FedCAD loss, eq. 1-2, per sample: ``(1 - a_y) * CE + a_y * L_d`` with ``a_y = class_weights[y]``.

    ``L_d = -sum_k p^g_k(x) log p_k(x)``, both softmaxes at temperature ``tau`` (eq. 2; no ``tau**2`` factor, as
    written). Eq. 2 sums over the local data; here, like every loss in this module, it is averaged over the batch.
    """
    _check_pair(logits, teacher_logits, targets)
    _check_positive("tau", tau)
    num_classes = logits.shape[1]
    if class_weights.shape != (num_classes,):
        raise ValueError(f"class_weights must have shape ({num_classes},), got {tuple(class_weights.shape)}")
    targets = targets.long()
    alpha = class_weights.detach().to(logits.dtype)[targets]  # (B,)
    return _weighted_ce_plus_distillation(logits, teacher_logits, targets, alpha, tau)


def lsd_loss(logits: Logits, teacher_logits: Logits, targets: Tensor, *, weight: float, tau: float = 1.0) -> Tensor:
    """FedLSD loss: FedCAD eq. 1-2 with the same distillation weight ``weight`` for every class."""
    _check_pair(logits, teacher_logits, targets)
    _check_positive("tau", tau)
    _check_unit("weight", weight)
    alpha = torch.full((logits.shape[0],), weight, dtype=logits.dtype, device=logits.device)  # (B,)
    return _weighted_ce_plus_distillation(logits, teacher_logits, targets.long(), alpha, tau)


def soft_cross_entropy(logits: Logits, target_probs: Probs) -> Tensor:
    """Cross-entropy against soft targets, ``-sum_k t_k log softmax(logits)_k``, batch mean.

    This is DS-FL's loss ``phi`` with soft targets (DS-FL eq. 7, 10). For one-hot targets it equals the usual
    cross-entropy. ``target_probs`` are constants (detached).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must have shape (batch, classes), got {tuple(logits.shape)}")
    if target_probs.shape != logits.shape:
        raise ValueError(
            f"target_probs must have the shape of logits {tuple(logits.shape)}, got {tuple(target_probs.shape)}"
        )
    log_probs = F.log_softmax(logits, dim=1)  # (B, C)
    return -(target_probs.detach().to(log_probs.dtype) * log_probs).sum(dim=1).mean()


def fd_distillation_loss(
    logits: Logits,
    targets: Tensor,
    distill_probs: Probs,
    *,
    gamma: float,
    mask: Tensor | None = None,
) -> Tensor:
    """FD local objective, DS-FL eq. 7: ``CE(logits, y) + gamma * soft_cross_entropy(logits, distill_probs)``.

    ``distill_probs`` (B, C) holds each sample's distillation target, the row of its label in
    :func:`fedge.aggregation.average.fd_leave_one_out`. ``mask`` (B,) bool, optional, drops the distillation term of
    samples whose class has no target from other clients; dropped samples still count in the batch mean, so the term's
    scale
    does not depend on how many were dropped (eq. 7 sums over the whole local dataset).
    """
    _check_nonnegative("gamma", gamma)
    if logits.dim() != 2:
        raise ValueError(f"logits must have shape (batch, classes), got {tuple(logits.shape)}")
    _check_targets(targets, logits.shape[0])
    if distill_probs.shape != logits.shape:
        raise ValueError(
            f"distill_probs must have the shape of logits {tuple(logits.shape)}, got {tuple(distill_probs.shape)}"
        )
    ce = F.cross_entropy(logits, targets.long())
    per_sample = -(distill_probs.detach().to(logits.dtype) * F.log_softmax(logits, dim=1)).sum(dim=1)  # (B,)
    if mask is not None:
        if mask.shape != (logits.shape[0],) or mask.dtype != torch.bool:
            raise ValueError(
                f"mask must be a bool tensor of shape ({logits.shape[0]},), got {mask.dtype} {tuple(mask.shape)}"
            )
        per_sample = torch.where(mask, per_sample, torch.zeros_like(per_sample))
    return ce + gamma * per_sample.mean()


def _not_true(logits: Tensor, targets: Tensor) -> Tensor:
    """Drop each row's true-class column, keeping the order of the others; a pure gather like ``refine_as_not_true``."""
    num_classes = logits.shape[1]
    cols = torch.arange(num_classes - 1, device=logits.device).unsqueeze(0)  # (1, C-1)
    # Result column j is class j before the true class and class j+1 from it on; a static shape, no boolean indexing.
    index = cols + (cols >= targets.unsqueeze(1)).long()  # (B, C-1)
    return logits.gather(1, index)  # (B, C-1)


def _kl_batchmean(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """``KL(softmax(teacher) || softmax(student))`` summed over classes, batch mean."""
    # Log-space target: a teacher probability that underflows to 0 contributes 0 instead of 0 * log 0.
    return F.kl_div(
        F.log_softmax(student_logits, dim=1),
        F.log_softmax(teacher_logits, dim=1),
        reduction="batchmean",
        log_target=True,
    )


def _weighted_ce_plus_distillation(
    logits: Tensor, teacher_logits: Tensor, targets: Tensor, alpha: Tensor, tau: float
) -> Tensor:
    """Batch mean of ``(1 - alpha) * CE + alpha * L_d`` (FedCAD eq. 1-2); ``alpha`` is per sample, (B,)."""
    ce = F.cross_entropy(logits, targets, reduction="none")  # (B,)
    teacher_probs = torch.softmax(teacher_logits.detach() / tau, dim=1)  # (B, C)
    distill = -(teacher_probs * F.log_softmax(logits / tau, dim=1)).sum(dim=1)  # (B,)
    return ((1.0 - alpha) * ce + alpha * distill).mean()


def _check_pair(logits: Tensor, teacher_logits: Tensor, targets: Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must have shape (batch, classes), got {tuple(logits.shape)}")
    if teacher_logits.shape != logits.shape:
        raise ValueError(
            f"teacher_logits must have the shape of logits {tuple(logits.shape)}, got {tuple(teacher_logits.shape)}"
        )
    _check_targets(targets, logits.shape[0])


def _check_targets(targets: Tensor, batch: int) -> None:
    if targets.shape != (batch,):
        raise ValueError(f"targets must have shape ({batch},), got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer class indices, got dtype {targets.dtype}")


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name} must be > 0, got {value}")


def _check_nonnegative(name: str, value: float) -> None:
    if not value >= 0:
        raise ConfigError(f"{name} must be >= 0, got {value}")


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"{name} must be in [0, 1], got {value}")
