"""FedBuff's buffered server step (Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation",
AISTATS 2022, Algorithm 1): staleness weights, the buffer's mean update and the server step that applies it.

A client trains on the model version it last received, ``v_i``, and returns the move ``delta_i = w_i - w(v_i)``. When
the buffer holds K updates, the server at version ``v`` takes one step (Algorithm 1, lines 11-15, with fedge's data
size weights)::

    s_i      = v - v_i                                                   # staleness, in server steps
    delta    = sum_i weight(s_i) * n_i * delta_i / sum_i n_i             # the buffer's mean update
    w(v + 1) = w(v) + server_lr * delta                                  # the server step

The normalisation follows the paper, which sums the staleness-weighted updates and divides by K: the staleness weight
stays an absolute discount (a buffer of stale updates moves the model less), it is not renormalised away as dividing
by ``sum_i weight(s_i) * n_i`` would do. ``n_i`` is FedAvg's data size weight (FedNTD eq. 2); with uniform weights
(``n_i = 1``) this is the paper's ``sum_i weight(s_i) * delta_i / K`` exactly. With K = the cohort, one version,
constant weights and ``server_lr = 1`` the step is FedAvg's weighted average.

:func:`buffered_delta` and :class:`ServerLearningRate` are separate on purpose: the step that turns the mean update
into weights is a :class:`ServerStep`. Its result is what a synchronous round's average is to the strategy's server
optimizer (:mod:`fedge.aggregation.server_step`), which moves the model from there: FedAvg's takes it as it is,
FedAdam's takes an Adam step towards it (so ``server_lr`` stays 1 then). FedBuff's step stays its own because it
starts from a mean *move* against stale versions and sums it in float64, where the synchronous step starts from a
mean of models.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from fedge.errors import ConfigError
from fedge.types import ClientId, StateDict

__all__ = [
    "BufferedUpdate",
    "ServerLearningRate",
    "ServerStep",
    "StalenessWeight",
    "buffered_delta",
    "staleness",
]


@dataclass(frozen=True)
class StalenessWeight:
    """How much an update ``s`` server steps old counts: ``constant`` 1; ``sqrt`` 1/(1+sqrt(s)) (FedBuff's, also
    NVIDIA FLARE's edge buffer); ``poly`` 1/(1+s)^a (Xie et al.'s FedAsync polynomial)."""

    kind: str = "constant"
    a: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "sqrt", "poly"):
            raise ConfigError(f"staleness weight {self.kind!r}: choose constant, sqrt or poly:A")
        if not (math.isfinite(self.a) and self.a >= 0):
            raise ConfigError(f"staleness weight poly:{self.a}: the exponent A must be a number >= 0")

    @classmethod
    def parse(cls, spec: str) -> StalenessWeight:
        """``constant``, ``sqrt`` or ``poly:A`` (e.g. ``poly:0.5``); ConfigError naming what is wrong."""
        kind, _, arg = spec.strip().partition(":")
        if kind == "poly":
            try:
                a = float(arg)
            except ValueError:
                raise ConfigError(f"--staleness-weight {spec!r}: poly needs an exponent, e.g. poly:0.5") from None
            return cls("poly", a)
        if arg:
            raise ConfigError(f"--staleness-weight {spec!r}: {kind} takes no argument (only poly:A does)")
        if kind not in ("constant", "sqrt"):
            raise ConfigError(f"--staleness-weight {spec!r}: choose constant, sqrt or poly:A")
        return cls(kind)

    def __call__(self, s: int) -> float:
        if s < 0:
            raise ValueError(f"staleness must be >= 0, got {s}")
        if self.kind == "sqrt":
            return 1.0 / (1.0 + math.sqrt(s))
        if self.kind == "poly":
            return 1.0 / (1.0 + s) ** self.a
        return 1.0


@dataclass(frozen=True)
class BufferedUpdate:
    """One update in the buffer: who sent it, the model version it trained on, its data size weight ``n_i`` and its
    move ``delta_i = w_i - w(v_i)``."""

    client: ClientId
    base_version: int
    weight: float  # n_i: the client's data size, or 1 with uniform weighting
    delta: StateDict
    loss: float | None = None


def staleness(version: int, update: BufferedUpdate) -> int:
    """How many server steps the model moved since ``update``'s client received it."""
    return version - update.base_version


def buffered_delta(updates: Sequence[BufferedUpdate], version: int, weight: StalenessWeight) -> StateDict:
    """The buffer's mean update at server version ``version`` (see the module): ``sum_i weight(s_i) n_i delta_i /
    sum_i n_i``, summed in float64 in the order given (deterministic), cast back to each tensor's dtype."""
    if not updates:
        raise ValueError("a server step needs at least one buffered update")
    total = sum(u.weight for u in updates)
    if not (total > 0 and math.isfinite(total)):
        raise ValueError(f"the buffered updates' weights must sum to a positive number, got {total}")
    shares = [weight(staleness(version, u)) * u.weight / total for u in updates]
    reference = updates[0].delta
    out: StateDict = {}
    with torch.no_grad():
        for key, ref in reference.items():
            acc = torch.zeros(ref.shape, dtype=torch.float64)
            for u, share in zip(updates, shares, strict=True):
                acc += share * u.delta[key].to(torch.float64)
            out[key] = acc.to(ref.dtype) if ref.dtype.is_floating_point else acc  # integer tensors: rounded at the step
    return out


class ServerStep(Protocol):
    """Turns the global weights and the buffer's mean update into the buffer's averaged weights."""

    def __call__(self, weights: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]) -> StateDict: ...


@dataclass(frozen=True)
class ServerLearningRate:
    """FedBuff's server step: ``w + lr * delta`` (Algorithm 1, line 14), in float64, cast back to each tensor's dtype
    (integer tensors, e.g. batch norm's step count, rounded)."""

    lr: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"server_lr must be > 0, got {self.lr}")

    def __call__(self, weights: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]) -> StateDict:
        out: StateDict = {}
        with torch.no_grad():
            for key, w in weights.items():
                moved = w.to(torch.float64) + self.lr * delta[key].to(torch.float64)
                out[key] = (moved if w.dtype.is_floating_point else moved.round()).to(w.dtype)
        return out
