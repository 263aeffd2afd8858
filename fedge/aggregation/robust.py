"""Robust aggregation: what a server can do when some clients send poisoned or scaled updates.

- Norm clipping: each client's update (its weights minus the broadcast) is scaled down to at most ``clip_factor``
  times the median update norm of the round, so one scaled update (a model-replacement attack, DS-FL eq. 19) cannot
  move the global model further than an honest one.
- Coordinate-wise median and trimmed mean (Yin et al., ICML 2018): per coordinate, the median of the clients'
  values, or the mean after dropping the ``trim_ratio`` largest and smallest. Unweighted: a client's self-reported
  data size must not buy it a larger share of a robust statistic.
- The same two for soft labels (DS-FL): per sample and class over the clients, then rows renormalized to sum to 1.
- The reference an update's norm is judged against (:class:`UpdateNormHistory`): the largest of the recent rounds'
  median update norms, which no single client can inflate and which follows the honest majority when the model moves.
- The clipping a deployment gets by default (:data:`DEPLOYMENT_CLIP_FACTOR`), where the simulator keeps the papers'
  plain mean.

Every function is pure and deterministic: sums run in float64 in the order given.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fedge.aggregation.average import weighted_average
from fedge.errors import ConfigError
from fedge.types import Probs, StateDict

RULES = ("mean", "median", "trimmed_mean")

DEPLOYMENT_CLIP_FACTOR = 1.0
"""The norm clipping of ``fedge coordinator`` and the laptop runner over a broker (weight-exchange algorithms) unless
the user sets one: every update is shortened to at most the round's median update norm, and every averaging weight
to at most the median weight, before the mean, so one admitted client moves the model no further than an honest
one, whatever it sends or claims. Measured on digits
(``experiments/insiders.py``): no cost on an honest run, IID or 2-class shards, where the coordinate-wise trimmed
mean and median cost 30-34 points on shards. ``fedge sim`` keeps the papers' plain mean."""


def check_rule(rule: str, trim_ratio: float) -> None:
    """ConfigError unless ``rule`` is known and ``trim_ratio`` lies in [0, 0.5)."""
    if rule not in RULES:
        raise ConfigError(f"robust aggregation rule must be one of {', '.join(RULES)}, not {rule!r}")
    if not 0 <= trim_ratio < 0.5:
        raise ConfigError(f"trim_ratio must be in [0, 0.5), got {trim_ratio}")


def coordinate_median(values: Tensor) -> Tensor:
    """The per-coordinate median over dim 0 of ``values`` (K, ...); the mean of the middle two for even K."""
    k = values.shape[0]
    ordered = values.sort(dim=0).values
    return (ordered[(k - 1) // 2] + ordered[k // 2]) / 2


def trimmed_mean(values: Tensor, trim_ratio: float) -> Tensor:
    """The per-coordinate mean over dim 0 after dropping the ``floor(K * trim_ratio)`` largest and smallest values,
    and at least one of each when ``trim_ratio`` > 0 and K >= 3: a share that rounds to nothing on a small round
    would leave a lone attacker in the mean."""
    k = values.shape[0]
    cut = math.floor(k * trim_ratio)
    if cut == 0 and trim_ratio > 0 and k >= 3:
        cut = 1
    ordered = values.sort(dim=0).values
    return ordered[cut : k - cut].mean(dim=0)


def state_norm(state: StateDict) -> float:
    """L2 norm of every floating-point tensor of ``state`` together (float64)."""
    return math.sqrt(sum(float(v.double().pow(2).sum()) for v in state.values() if v.is_floating_point()))


def update_norm(state: StateDict, reference: StateDict) -> float:
    """L2 norm of ``state - reference`` over every floating-point tensor (float64)."""
    total = 0.0
    for k, ref in reference.items():
        if ref.is_floating_point():
            total += float((state[k].double() - ref.double()).pow(2).sum())
    return math.sqrt(total)


def robust_average(
    states: Sequence[StateDict],
    weights: Sequence[float],
    reference: StateDict,
    *,
    rule: str = "mean",
    trim_ratio: float = 0.2,
    clip_factor: float = 0.0,
) -> StateDict:
    """Aggregate client weights ``states`` around the broadcast ``reference``.

    With ``clip_factor`` > 0 every update ``state - reference`` longer than ``clip_factor`` x the round's median
    update norm is scaled down to that length first, and every weight above ``clip_factor`` x the round's median
    weight is lowered to it: a self-reported data size must not buy one client the whole mean either. ``rule``
    "mean" is FedAvg's weighted average (``weights`` are the clients' data sizes); "median" and "trimmed_mean" are
    coordinate-wise and unweighted.
    """
    check_rule(rule, trim_ratio)
    if not states:
        raise ValueError("robust_average needs at least one state")
    deltas = [{k: s[k].double() - reference[k].double() for k in reference} for s in states]
    if clip_factor > 0:
        norms = [math.sqrt(sum(float(d.pow(2).sum()) for d in delta.values())) for delta in deltas]
        bound = clip_factor * float(coordinate_median(torch.tensor(norms, dtype=torch.float64)))
        deltas = [
            {k: d * (bound / n) for k, d in delta.items()} if n > bound > 0 else delta
            for delta, n in zip(deltas, norms, strict=True)
        ]
        cap = clip_factor * statistics.median(float(w) for w in weights)
        weights = [min(float(w), cap) for w in weights] if cap > 0 else weights
    if rule == "mean":
        moved = [{k: reference[k].double() + d for k, d in delta.items()} for delta in deltas]
        averaged = weighted_average(moved, weights)
        return {k: v.to(reference[k].dtype) for k, v in averaged.items()}
    out: StateDict = {}
    for k, ref in reference.items():
        stacked = torch.stack([delta[k] for delta in deltas])  # (K, *shape)
        agg = coordinate_median(stacked) if rule == "median" else trimmed_mean(stacked, trim_ratio)
        out[k] = (ref.double() + agg).to(ref.dtype)
    return out


def robust_rows(client_probs: Sequence[Probs], *, rule: str, trim_ratio: float = 0.2) -> Probs:
    """Per sample and class over the clients: the mean, median or trimmed mean, rows renormalized to sum to 1."""
    check_rule(rule, trim_ratio)
    stacked = torch.stack([p.double() for p in client_probs])  # (K, I, C)
    if rule == "mean":
        agg = stacked.mean(dim=0)
    elif rule == "median":
        agg = coordinate_median(stacked)
    else:
        agg = trimmed_mean(stacked, trim_ratio)
    agg = agg.clamp_min(0)
    sums = agg.sum(dim=-1, keepdim=True)  # (I, 1)
    uniform = torch.full_like(agg, 1.0 / agg.shape[-1])
    return torch.where(sums > 0, agg / sums.clamp_min(1e-300), uniform).to(client_probs[0].dtype)


@dataclass
class UpdateNormHistory:
    """What an update's norm is judged against, so that a bound cannot be turned into a weapon.

    Each round's update norms (accepted or refused, as long as the update was well-formed) are remembered, the first
    of each client only; once a round is over, its median over the clients enters the history if at least
    ``min_voters`` clients answered, so no single client sets it. The reference is the largest of the last
    ``window`` medians: an attacker cannot raise it in one step, and when the honest majority's updates grow (the
    model moved) the next round's reference grows with them, so honest clients are not locked out by a model an
    attacker moved (refused for one round at most, when all their updates grow tenfold at once). Before any round
    has a median, the caller's fallback (the initial global model's norm) is the reference.
    """

    window: int = 5
    min_voters: int = 3
    medians: list[float] = field(default_factory=list)
    _seen: dict[int, dict[str, float]] = field(default_factory=dict)  # round -> client -> its first update's norm

    def observe(self, rnd: int, client: str, norm: float) -> None:
        """Remember the norm of ``client``'s well-formed update of round ``rnd``: one vote per client and round,
        however many messages it sends (the caller judges only sampled clients, which bounds the memory)."""
        self._seen.setdefault(rnd, {}).setdefault(client, norm)

    def reference(self, rnd: int, fallback: float) -> float:
        """The reference norm for updates of round ``rnd``: earlier rounds' medians folded in first."""
        for past in sorted(r for r in self._seen if r < rnd):
            norms = self._seen.pop(past)
            if len(norms) >= self.min_voters:
                self.medians = [*self.medians, statistics.median(norms.values())][-self.window :]
        return max(self.medians) if self.medians else fallback
