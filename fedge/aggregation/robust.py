"""Robust aggregation: what a server can do when some clients send poisoned or scaled updates.

- Norm clipping: each client's update (its weights minus the broadcast) is scaled down to at most ``clip_factor``
  times the median update norm of the round, so one scaled update (a model-replacement attack, DS-FL eq. 19) cannot
  move the global model further than an honest one.
- Coordinate-wise median and trimmed mean (Yin et al., ICML 2018): per coordinate, the median of the clients'
  values, or the mean after dropping the ``trim_ratio`` largest and smallest. Unweighted: a client's self-reported
  data size must not buy it a larger share of a robust statistic.
- FLAME (Nguyen et al., USENIX Security 2022, sec. 4): keep the majority cluster of the round's updates by cosine
  distance (:func:`majority_cluster`), clip each kept update to the round's median update norm, average, and add
  Gaussian noise of ``noise_factor`` x that norm (the paper's adaptive noise, lambda x S_t).
- The same two for soft labels (DS-FL): per sample and class over the clients, then rows renormalized to sum to 1.
- The reference an update's norm is judged against (:class:`UpdateNormHistory`): the largest of the recent rounds'
  median update norms, which no single client can inflate and which follows the honest majority when the model moves.
- The rules a deployment gets by default (:data:`DEPLOYMENT_RULE`, :data:`DEPLOYMENT_SOFT_LABEL_RULE`, and
  :data:`DEPLOYMENT_CLIP_FACTOR` under another rule), where the simulator keeps the papers' plain mean.

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
"""The rules for soft labels (DS-FL's uploads)."""
WEIGHT_RULES = (*RULES, "flame")
"""The rules for weight updates (the FedAvg family): also FLAME's cluster-clip-noise filter."""

DEPLOYMENT_RULE = "flame"
"""The aggregation rule of ``fedge coordinator``, the laptop runner over a broker and ``fedge provision``'s
``config.json`` for weight-exchange algorithms unless the user sets one. Chosen in issue 52 by measurement
(experiments/results/backdoor-defaults, docs/deployment.md): a data-poisoning backdoor (3x3 trigger, half of each
poisoning client's data) by 1 of 10 digits clients reaches 97.5% attack success under the mean and 49.9% under the
median-norm clip that was the default before; FLAME keeps it at the honest run's level (0.7%), and 3 of 10 at 6.2%
(honest 1.2%), where the median lets 52.3% through, at no clean-accuracy cost on digits. ``fedge sim`` keeps the
papers' plain mean."""

DEPLOYMENT_CLIP_FACTOR = 1.0
"""The norm clipping a deployment gets unless the user sets one (FLAME clips to the median norm itself and does not
apply it again; FedCurv also caps its Fisher terms by it): every update is shortened to at most the round's median
update norm, and every averaging weight to at most the median weight, so one admitted client moves the model no
further than an honest one, whatever it sends or claims. It stops the untargeted attacks of
``experiments/insiders.py`` but not a data-poisoning backdoor."""

DEPLOYMENT_MAX_UPDATE_RATIO = 5.0
"""The update bound a deployment gets unless the user sets one (the simulator keeps 10): an update longer than 5 x
the recent rounds' median update norm is refused. Chosen in issue 52 by measurement (experiments/backdoor.py long,
docs/deployment.md): three colluding poisoners of ten get past FLAME's majority once honest updates grow nearly
orthogonal late in training (attack success 6.2% / 25.2% / 88.1% at rounds 20 / 25 / 40 under the bound of 10),
and their updates are then 8-12 x the median; with 5 they are refused and the backdoor stays at the honest 0.7% to
round 40, and no honest update was refused in any run measured (digits IID to round 40, MNIST shards and LDA 0.1
to round 20)."""

DEPLOYMENT_SOFT_LABEL_RULE = "median"
"""The same for soft-label exchanges (DS-FL): the per-sample, per-class median of the clients' rows, which holds
confidently wrong uploaders where the mean does not (docs/deployment.md)."""


def check_rule(rule: str, trim_ratio: float, rules: Sequence[str] = RULES) -> None:
    """ConfigError unless ``rule`` is one of ``rules`` and ``trim_ratio`` lies in [0, 0.5)."""
    if rule not in rules:
        raise ConfigError(f"robust aggregation rule must be one of {', '.join(rules)}, not {rule!r}")
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


def majority_cluster(updates: Tensor) -> list[int]:
    """The rows of ``updates`` (K, P) that FLAME keeps, in order: the majority cluster by cosine distance.

    FLAME (sec. 4.2) clusters with HDBSCAN, ``min_cluster_size`` = K // 2 + 1, so that only a majority forms a
    cluster, and keeps that cluster. Written here in a few lines, so the core needs no clustering library: kept is
    the tightest majority under single linkage (edges added shortest first, every edge of one length before looking,
    until a connected group holds at least K // 2 + 1 updates), the one cluster HDBSCAN labels with
    ``min_samples`` = 1 and ``allow_single_cluster``. Updates pointing elsewhere than the majority (a colluding
    minority's backdoor direction, a sign flip) join later and stay out; a zero update has no direction and is as
    far as possible from every other. An honest update that is merely last to join is left out too: that is the
    rule's cost on non-IID data (measured in docs/deployment.md). A wider rule (every update within the majority's
    own diameter of it) was measured and let three colluding backdoor clients of ten in once honest updates grew
    nearly orthogonal late in training (experiments/results/backdoor-defaults). Fewer than 3 updates are all kept.
    """
    k = updates.shape[0]
    if k < 3:
        return list(range(k))
    flat = updates.double()
    norms = flat.norm(dim=1, keepdim=True)  # (K, 1)
    unit = torch.where(norms > 0, flat / norms.clamp_min(1e-300), torch.zeros_like(flat))
    distance = (1 - unit @ unit.T).clamp(0, 2)  # (K, K) cosine distances
    zero = (norms.squeeze(1) == 0).nonzero().flatten().tolist()
    distance[zero, :] = 2.0
    distance[:, zero] = 2.0
    need = k // 2 + 1
    parent = list(range(k))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    edges = sorted((float(distance[i, j]), i, j) for i in range(k) for j in range(i + 1, k))
    at = 0
    while at < len(edges):
        length = edges[at][0]
        while at < len(edges) and edges[at][0] == length:  # every edge of this length, then look
            _, i, j = edges[at]
            parent[root(i)] = root(j)
            at += 1
        groups: dict[int, list[int]] = {}
        for i in range(k):
            groups.setdefault(root(i), []).append(i)
        core = max(groups.values(), key=len)
        if len(core) >= need:
            return core
    return list(range(k))  # unreachable: all edges added join everything


def state_norm(state: StateDict) -> float:
    """L2 norm of every floating-point tensor of ``state`` together (float64)."""
    return math.sqrt(sum(float(v.double().pow(2).sum()) for v in state.values() if v.is_floating_point()))


def update_norm(state: StateDict, reference: StateDict) -> float:
    """L2 norm of ``state - reference`` over every floating-point tensor (float64)."""
    total = 0.0
    for k, ref in reference.items():
        if ref.is_floating_point():
            # One float64 copy, subtracted from and squared in place: the values of (a - b).pow(2), without the two
            # extra temporaries (the coordinator measures every reply: 1.7M values each for fedavg_cnn).
            d = state[k].to(torch.float64, copy=True).sub_(ref.double())
            total += float(d.pow_(2).sum())
    return math.sqrt(total)


def robust_average(
    states: Sequence[StateDict],
    weights: Sequence[float],
    reference: StateDict,
    *,
    rule: str = "mean",
    trim_ratio: float = 0.2,
    clip_factor: float = 0.0,
    noise_factor: float = 0.0,
    generator: torch.Generator | None = None,
) -> StateDict:
    """Aggregate client weights ``states`` around the broadcast ``reference``.

    With ``clip_factor`` > 0 every update ``state - reference`` longer than ``clip_factor`` x the round's median
    update norm is scaled down to that length first, and every weight above ``clip_factor`` x the round's median
    weight is lowered to it: a self-reported data size must not buy one client the whole mean either. ``rule``
    "mean" is FedAvg's weighted average (``weights`` are the clients' data sizes); "median" and "trimmed_mean" are
    coordinate-wise and unweighted; "flame" keeps the :func:`majority_cluster` of the updates, clips each kept one to
    the round's median update norm (over all updates, FLAME's S_t) and takes the mean weighted by data size, each
    weight capped at the round's median weight (``clip_factor`` is not applied on top). With ``noise_factor`` > 0,
    Gaussian noise of standard deviation ``noise_factor`` x the round's median update norm is added to every
    aggregated value (FLAME's adaptive noise; with "mean" and clipping, Sun et al. 2019's norm clipping plus weak
    noise), drawn from ``generator``.
    """
    check_rule(rule, trim_ratio, WEIGHT_RULES)
    if not states:
        raise ValueError("robust_average needs at least one state")
    if noise_factor < 0:
        raise ConfigError(f"noise_factor must be >= 0, got {noise_factor}")
    deltas = [{k: s[k].double() - reference[k].double() for k in reference} for s in states]
    norms = [math.sqrt(sum(float(d.pow(2).sum()) for d in delta.values())) for delta in deltas]
    median_norm = float(coordinate_median(torch.tensor(norms, dtype=torch.float64)))
    if rule == "flame":
        kept = majority_cluster(torch.stack([torch.cat([d.flatten() for d in delta.values()]) for delta in deltas]))
        cap = statistics.median(float(w) for w in weights)
        deltas = [
            {k: d * (median_norm / norms[i]) for k, d in deltas[i].items()} if norms[i] > median_norm else deltas[i]
            for i in kept
        ]
        weights = [min(float(weights[i]), cap) if cap > 0 else float(weights[i]) for i in kept]
        rule, clip_factor = "mean", 0.0  # clipped and capped already: ``clip_factor`` does not clip a second time
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
        out = weighted_average(moved, weights)
    else:
        out = {}
        for k, ref in reference.items():
            stacked = torch.stack([delta[k] for delta in deltas])  # (K, *shape)
            agg = coordinate_median(stacked) if rule == "median" else trimmed_mean(stacked, trim_ratio)
            out[k] = ref.double() + agg
    if noise_factor > 0:
        sigma = noise_factor * median_norm
        for k, v in out.items():
            if reference[k].is_floating_point():
                noise = torch.randn(v.shape, generator=generator, dtype=torch.float64)
                out[k] = v.double() + sigma * noise
    return {k: v.to(reference[k].dtype) for k, v in out.items()}


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
