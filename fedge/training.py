"""Local optimization shared by clients and the DS-FL server: objectives, batch order and the SGD loop.

Every backend (PyTorch here; ExecuTorch and ONNX Runtime in ``edge_client``) follows the same batch order, given by
:func:`batch_order`, so the same task gives the same weights whichever runtime executes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedge import losses
from fedge.errors import ConfigError

OBJECTIVES = ("ce", "ntd", "kd", "lsd", "cad", "soft", "fd")


@dataclass(frozen=True)
class Objective:
    """A local loss and its hyperparameters.

    ``kind`` is one of:
    - ``ce``: cross-entropy (FedAvg; DS-FL eq. 1-2);
    - ``ntd``: CE + beta * tau^2 * not-true KL to the teacher (FedNTD eq. 10-11); aux = teacher logits;
    - ``kd``: Hinton KD, (1 - beta) CE + beta * tau^2 KL (FedNTD sec. 1); aux = teacher logits;
    - ``lsd``/``cad``: (1 - a_y) CE + a_y soft-CE to the teacher at tau (FedCAD eq. 1-2), a_y = ``class_weights[y]``
      (constant for FedLSD, eq. 3 for FedCAD); aux = teacher logits;
    - ``soft``: soft-label cross-entropy to probabilities (DS-FL eq. 10-11); aux = target probabilities;
    - ``fd``: CE + gamma * soft-CE to the leave-one-out targets (DS-FL eq. 7); aux = target probabilities, and rows
      whose ``aux_mask`` is False get CE only (no other client holds that class).
    """

    kind: str = "ce"
    tau: float = 1.0
    beta: float = 1.0
    gamma: float = 1.0
    class_weights: torch.Tensor | None = None  # (C,) for lsd/cad

    def __post_init__(self) -> None:
        if self.kind not in OBJECTIVES:
            raise ConfigError(f"unknown objective {self.kind!r}; choose one of {OBJECTIVES}")
        if self.kind in ("lsd", "cad") and self.class_weights is None:
            raise ConfigError(f"objective {self.kind!r} needs class_weights")

    @property
    def needs_teacher(self) -> bool:
        return self.kind in ("ntd", "kd", "lsd", "cad")

    def loss(
        self, logits: torch.Tensor, targets: torch.Tensor, aux: torch.Tensor | None, aux_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Batch-mean loss of ``logits`` (B, C) against labels (B,) and the per-sample auxiliary targets (B, C)."""
        if self.kind == "ce":
            return F.cross_entropy(logits, targets)
        if aux is None:
            raise ConfigError(f"objective {self.kind!r} needs auxiliary targets (teacher logits or soft labels)")
        if self.kind == "ntd":
            return losses.ntd_loss(logits, aux, targets, tau=self.tau, beta=self.beta)
        if self.kind == "kd":
            return losses.kd_loss(logits, aux, targets, tau=self.tau, beta=self.beta)
        if self.kind in ("lsd", "cad"):
            assert self.class_weights is not None
            return losses.class_weighted_distillation_loss(logits, aux, targets, self.class_weights, tau=self.tau)
        if self.kind == "soft":
            return losses.soft_cross_entropy(logits, aux)
        # fd: distill only the samples whose class has a leave-one-out target (DS-FL eq. 6-7).
        return losses.fd_distillation_loss(logits, targets, aux, gamma=self.gamma, mask=aux_mask)


@dataclass(frozen=True)
class SGDSettings:
    """Momentum SGD as in FedNTD B.3; momentum buffers start at zero for every task."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0


@dataclass(frozen=True)
class TrainStats:
    """What one local training call did."""

    steps: int
    samples: int
    mean_loss: float


def batch_order(num_samples: int, epochs: int, batch_size: int, seed: int) -> list[torch.Tensor]:
    """Mini-batch indices for ``epochs`` shuffled passes; every backend uses this exact order.

    A trailing batch of one sample is dropped: batch norm cannot normalize a single sample in training mode.
    """
    gen = torch.Generator().manual_seed(seed)
    batches: list[torch.Tensor] = []
    for _ in range(epochs):
        perm = torch.randperm(num_samples, generator=gen)
        for start in range(0, num_samples, batch_size):
            idx = perm[start : start + batch_size]
            if len(idx) > 1 or num_samples == 1:
                batches.append(idx)
    return batches


def train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    objective: Objective,
    sgd: SGDSettings,
    *,
    epochs: int,
    batch_size: int,
    seed: int,
    aux: torch.Tensor | None = None,
    aux_mask: torch.Tensor | None = None,
) -> TrainStats:
    """Run ``epochs`` of mini-batch SGD on (x, y) in place.

    ``aux`` (N, C) holds per-sample teacher logits or soft targets, ``aux_mask`` (N,) which rows of it to use.
    """
    device = next(model.parameters()).device
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=sgd.lr, momentum=sgd.momentum, weight_decay=sgd.weight_decay)
    total, steps, samples = 0.0, 0, 0
    for idx in batch_order(len(x), epochs, batch_size, seed):
        xb, yb = x[idx].to(device), y[idx].to(device)
        ab = aux[idx].to(device) if aux is not None else None
        mb = aux_mask[idx].to(device) if aux_mask is not None else None
        loss = objective.loss(model(xb), yb, ab, mb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += float(loss.detach())
        steps += 1
        samples += len(idx)
    return TrainStats(steps=steps, samples=samples, mean_loss=total / steps if steps else 0.0)


@torch.no_grad()
def predict_logits(model: nn.Module, x: torch.Tensor, *, batch_size: int = 1000) -> torch.Tensor:
    """Logits of ``model`` in eval mode, computed in batches, returned on the CPU."""
    device = next(model.parameters()).device
    model.eval()
    outs = [model(x[i : i + batch_size].to(device)).float().cpu() for i in range(0, len(x), batch_size)]
    return torch.cat(outs) if outs else torch.empty(0)
