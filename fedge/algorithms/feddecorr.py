"""FedDecorr (Shi et al., ICLR 2023, "Towards Understanding and Mitigating Dimensional Collapse in Heterogeneous
Federated Learning"): FedAvg whose local loss also decorrelates the dimensions of the batch's representation.

Local loss (Section 4): ``CE + beta * L_FedDecorr`` with

    L_FedDecorr = ||K||_F^2 / d^2,    K = Z^T Z / B

where ``Z`` (B, d) is the batch's representation with each dimension standardized over the batch,
``Z = (z - mean_B z) / sqrt(var_B z + eps)``, so that ``K`` is its correlation matrix. Penalizing ``K``'s off-diagonal
entries keeps the representation from collapsing onto few dimensions under heterogeneous data.
``z`` is the penultimate layer's output (``model.representation``), as for MOON: fedge's models have no projection head.
The variance is the batch's biased one and ``eps = 1e-8``, so a batch of one sample has ``Z = 0`` and no penalty
(the authors skip such a batch; a branch on the batch size would not trace into an exported program).
Default beta = 0.1.

This is the paper's equation. The authors' released code (``FedDecorrLoss``) computes another scale of it: the
unbiased variance, ``Z^T Z`` without the 1 / B, the mean over the d (d - 1) off-diagonal entries, then / B; that is
about B d / (d - 1) times the value here (the diagonal, constant 1, has no gradient). Their beta for a batch of B
therefore corresponds to about B times it here: set ``--decorr-beta`` accordingly when following their settings.

The penalty is the local term :class:`Decorrelation`: every runtime evaluates it, the batched executor and the
exported ExecuTorch and ONNX Runtime training programs included. Traffic and aggregation are FedAvg's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from fedge.algorithms.base import Algorithm, weights_traffic
from fedge.algorithms.fedavg import FedAvg, FedAvgClient, FedAvgSettings, LocalRound
from fedge.errors import ConfigError
from fedge.learning.terms import LocalTerm, TermBatch, TermCall
from fedge.learning.training import REPRESENTATION, TrainRequest
from fedge.wire.fields import bounded

EPS = 1e-8


@dataclass(frozen=True)
class FedDecorrSettings(FedAvgSettings):
    decorr_beta: float = field(
        default=0.1, metadata=bounded(0.0, 1e3, help="weight beta of the decorrelation penalty, FedDecorr")
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.decorr_beta >= 0:
            raise ConfigError(f"decorr_beta must be >= 0, got {self.decorr_beta}")


@dataclass(frozen=True)
class Decorrelation(LocalTerm):
    """``beta * ||K||_F^2 / d^2`` of the correlation matrix ``K`` of the batch's representation (FedDecorr,
    Section 4)."""

    kind = "decorr"
    representation = True
    beta: float = 0.1

    def __call__(self, b: TermBatch) -> torch.Tensor:
        z = b.z
        assert z is not None  # a term with ``representation`` is given it
        centred = z - z.mean(dim=0, keepdim=True)  # (B, d)
        var = (centred * centred).mean(dim=0, keepdim=True)  # (1, d) the batch's biased variance
        standard = centred / torch.sqrt(var + EPS)  # (B, d)
        k = standard.T @ standard / z.shape[0]  # (d, d) correlation matrix
        d = z.shape[1]
        return self.beta * (k * k).sum() / (d * d)


class FedDecorrClient(FedAvgClient[FedDecorrSettings]):
    settings_type = FedDecorrSettings

    def request(self, r: LocalRound[FedDecorrSettings]) -> TrainRequest:
        request = super().request(r)
        if r.settings.decorr_beta == 0:
            return request  # FedAvg's training, bit for bit
        return dataclasses.replace(request, terms=(*request.terms, TermCall(Decorrelation(r.settings.decorr_beta))))


ALGORITHM = Algorithm(
    name="feddecorr",
    label="FedDecorr",
    paper="Shi et al., ICLR 2023, Section 4 (penultimate layer, no projection head)",
    settings=FedDecorrSettings,
    server=FedAvg,
    client=FedDecorrClient(),
    traffic=weights_traffic,
    hooks=frozenset({REPRESENTATION}),
    describe=lambda s: f"β={s.decorr_beta:g}",
    secagg_gap="",
    terms=(Decorrelation,),
)
