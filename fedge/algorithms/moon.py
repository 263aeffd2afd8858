"""MOON (Li, He and Song, CVPR 2021, "Model-Contrastive Federated Learning"): FedAvg whose local loss also
pulls the local model's representation of each sample towards the global model's and away from the client's previous
local model's.

Local loss: ``CE(logits, y) + mu * l_con`` with the model-contrastive loss

    l_con = -log( exp(sim(z, z_glob)/tau) / (exp(sim(z, z_glob)/tau) + exp(sim(z, z_prev)/tau)) )

averaged over the batch, ``sim`` the cosine similarity, ``z`` the representation of the model being trained, ``z_glob``
that of the received global model and ``z_prev`` that of this client's previous local model, both frozen and fed
the same (augmented) batch. The paper's networks end in a projection head whose output is ``z``; fedge's models have
none, so ``z`` is the penultimate layer's output (``model.representation``, the input of the last linear layer), as
in the FedNTD authors' implementation (``get_features``, Lee-Gihun/FedNTD ``algorithms/moon``). Defaults mu = 1,
tau = 0.5: FedNTD Table 5 (the authors' config/moon.json says mu 0.1).

The previous local model lives in the client's store (journaled like SCAFFOLD's c_i). A client without one (its first
round, or after losing its store) compares with the received global model twice, so ``l_con`` is the constant log 2
and its first round is plain cross-entropy; the FedNTD authors' server starts every client from the initial global
model instead, which a fedge client does not hold.

The contrastive part is the local term :class:`ModelContrastive`, added to the cross-entropy; the reference models'
weights arrive with it each round, so every runtime evaluates it (the exported programs take both models' weights as
inputs and compute their eval-mode representations of each batch inside the program). Traffic is FedAvg's: the
previous model never leaves the client.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fedge.algorithms.base import Algorithm, ClientStore, weights_traffic
from fedge.algorithms.fedavg import FedAvg, FedAvgClient, FedAvgSettings, LocalRound
from fedge.errors import ConfigError
from fedge.learning.terms import LocalTerm, TermBatch, TermCall
from fedge.learning.training import REPRESENTATION, TrainRequest, TrainStats
from fedge.types import StateDict
from fedge.wire.fields import bounded

_PREVIOUS = "moon.previous."  # the client's previous local model in its store


@dataclass(frozen=True)
class MoonSettings(FedAvgSettings):
    moon_mu: float = field(default=1.0, metadata=bounded(0.0, 1e3, help="weight mu of the model-contrastive loss"))
    moon_tau: float = field(default=0.5, metadata=bounded(1e-3, 1e3, help="temperature tau of the contrastive loss"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.moon_tau > 0:
            raise ConfigError(f"moon_tau must be > 0, got {self.moon_tau}")


@dataclass(frozen=True)
class ModelContrastive(LocalTerm):
    """``mu * l_con`` (MOON eq. 3 with weight mu) on the representations of the trained, the global and the previous
    model."""

    kind = "moon"
    references = ("global", "previous")
    representation = True
    mu: float = 1.0
    tau: float = 0.5

    def __call__(self, b: TermBatch) -> torch.Tensor:
        z = b.z
        assert z is not None  # a term with ``representation`` is given it
        positive = F.cosine_similarity(z, b.reference_z["global"], dim=-1)
        negative = F.cosine_similarity(z, b.reference_z["previous"], dim=-1)
        # -log(e^p / (e^p + e^n)) is the cross-entropy of the logits (p, n) / tau for the label 0.
        contrast = torch.stack([positive, negative], dim=1) / self.tau
        zeros = torch.zeros_like(b.y)  # label 0 for every sample (made from y: a traced program keeps the batch size)
        return self.mu * F.cross_entropy(contrast, zeros)


class MoonClient(FedAvgClient[MoonSettings]):
    settings_type = MoonSettings

    def request(self, r: LocalRound[MoonSettings]) -> TrainRequest:
        references = {"global": r.global_weights, "previous": _previous(r.store, r.global_weights)}
        term = TermCall(ModelContrastive(mu=r.settings.moon_mu, tau=r.settings.moon_tau), references=references)
        request = super().request(r)
        return dataclasses.replace(request, terms=(*request.terms, term))

    def upload(self, r: LocalRound[MoonSettings], weights: StateDict, stats: TrainStats) -> dict[str, torch.Tensor]:
        for k, v in weights.items():
            r.store[_PREVIOUS + k] = v
        return weights


def _previous(store: ClientStore, global_weights: StateDict) -> StateDict:
    """This client's previous local model; the received global model when it has none (or one of another shape)."""
    kept = {k: store.get(_PREVIOUS + k) for k in global_weights}
    if any(v is None or v.shape != global_weights[k].shape for k, v in kept.items()):
        return dict(global_weights)
    return {k: v for k, v in kept.items() if v is not None}


ALGORITHM = Algorithm(
    name="moon",
    label="MOON",
    paper="Li, He and Song, CVPR 2021 (penultimate layer, no projection head)",
    settings=MoonSettings,
    server=FedAvg,
    client=MoonClient(),
    traffic=weights_traffic,
    hooks=frozenset({REPRESENTATION}),
    describe=lambda s: f"μ={s.moon_mu:g}, τ={s.moon_tau:g}",
    secagg_gap="",
    terms=(ModelContrastive,),
)
