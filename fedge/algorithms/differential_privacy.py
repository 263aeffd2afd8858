"""Client-level differential privacy of the FedAvg family: DP-FedAvg (McMahan et al., ICLR 2018, Algorithm 1) with
adaptive clipping (Andrew et al., NeurIPS 2021, Algorithm 1) and a privacy accountant (:mod:`fedge.privacy.accountant`).

:class:`DifferentialPrivacyStrategy` wraps an algorithm's :class:`~fedge.algorithms.base.Strategy` whose aggregation
needs only sums of the replies' moves and deltas (``Algorithm.dp_refusal == ""``): the mean of the returned weights
for the FedAvg family, and SCAFFOLD's control-delta sum and FedDyn's drift sum beside it (their parts,
:mod:`fedge.privacy.contribution`). Per round ``r``, with ``w`` the broadcast weights, ``N`` the client population,
``q`` the sampling rate (``client_fraction``), ``m = q N`` the expected cohort and ``C`` the round's clip:

1. The cohort is Poisson-sampled by the round engine (:func:`fedge.privacy.mechanism.poisson_sample`): each client
   joins with probability ``q``; the cohort may be empty.
2. Each reply becomes ``clip_C(v_k)``, ``v_k`` its contribution: ``w_k - w`` for the FedAvg family and FedDyn,
   ``[w_k - w, delta_c_k]`` for SCAFFOLD, clipped jointly (and, for adaptive clipping, the bit ``||v_k|| <= C``).
3. The sum over the replies gets Gaussian noise of std ``z_delta C`` per coordinate (the bits' sum: std ``sigma_b =
   m / 20``), where ``z_delta`` is ``z`` for a fixed clip and Andrew et al.'s raised multiplier for an adaptive one.
   Without secure aggregation the coordinator adds it; with it, each client adds ``N(0, (z_delta C)^2 / t)`` before
   masking, ``t`` the fewest survivors the protocol's threshold lets a round complete with, so the survivors' noise
   has at least the stated std and the coordinator never sees an un-noised sum.
4. The new weights are ``w + (noised sum) / m`` (the fixed-denominator estimator ``f_f``: a dropped client leaves
   the round valid; an empty cohort moves the model by noise only, the mechanism the accountant counts). The inner
   strategy aggregates one reply carrying them (and the noised sums of SCAFFOLD's control deltas or FedDyn's moves,
   which its server step divides by ``N``).
5. Adaptive clipping: ``C <- C exp(-lr (b / m - target))`` with ``b`` the noised count (public: it is noised).

Every round is one Poisson-sampled Gaussian event to the accountant, aggregated or not (an abandoned secure round is
counted too: conservative). Clients are weighed uniformly (``weighting`` is set to uniform by the config): user-level
DP bounds each client's contribution by ``C``, which a weight by data size would scale.

Randomness: the noise comes from :func:`fedge.privacy.mechanism.noise_rng` (os.urandom-seeded PCG64, or the
``dp_noise_seed`` for reproducible simulations); sampling derives from the run's seed and the round.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from fedge.accounting.records import AggregationRecord
from fedge.algorithms.base import CheckedReply, RoundPlan, Strategy, StrategyState
from fedge.algorithms.secure_aggregation import remote_reply
from fedge.algorithms.wrapping import WrappingStrategy
from fedge.config import AlgorithmSettings, RunConfig
from fedge.errors import ConfigError
from fedge.privacy.accountant import Ledger, update_noise_multiplier
from fedge.privacy.contribution import Contribution
from fedge.privacy.mechanism import adapted_clip, count_std, noise_rng
from fedge.privacy.shares import ClientShare, share_params
from fedge.secagg.config import RoundConfig
from fedge.secagg.driver import run_configured, serve_round
from fedge.secagg.errors import RoundAbandoned, SecAggError
from fedge.secagg.messages import AdvertiseKeys, SecAggMessage
from fedge.secagg.parts import SecurePart, default_parts, parts_param
from fedge.secagg.protocol import SecAggServer, Stage
from fedge.secagg.remote import LAYOUT_PARAM, SEED_PARAM, StageChannel
from fedge.secagg.rounds import (
    RING_BITS,
    SUM_CLIENT,
    ProtocolLedger,
    graph_seed,
    remote_drops,
    rounding_rng,
    simulated_dropouts,
    simulated_drops,
)
from fedge.secagg.shamir import RandBytes
from fedge.tensors import l2_norm
from fedge.types import ClientId
from fedge.wire.message import Message

log = logging.getLogger(__name__)

NOISE_BOUND_STDS = 10.0
"""Under secure aggregation the ring clips each value to its bound: it is set this many per-client noise stds beyond
the clip, so a noised value is clipped with probability about 1e-23 per value."""


@dataclass(frozen=True)
class _Round:
    round: int
    cohort: tuple[ClientId, ...]
    weights: Mapping[str, torch.Tensor]  # the broadcast weights
    reference: npt.NDArray[np.float64]  # (dim,) what a vector is a move from: the weights on relative parts, else 0
    clip: float
    secure: RoundConfig | None = None  # the secure sum's parameters (a cohort of 2 or more under secure aggregation)


@dataclass(frozen=True)
class PrivateRound:
    """The last aggregated round as the simulator saw it (for tests): each survivor's clipped norm, the sum of their
    clipped contributions, the noise that was added to it (over the survivors, in total), what the contributions are
    moves from (the weights, and 0 on SCAFFOLD's control deltas) and that plus the noised sum over ``m``."""

    clipped_norms: Mapping[ClientId, float]
    clipped_sum: npt.NDArray[np.float64]  # (dim,)
    noise: npt.NDArray[np.float64]  # (dim,) the noise in the released sum
    survivors: tuple[ClientId, ...]
    before: npt.NDArray[np.float64]  # (dim,)
    after: npt.NDArray[np.float64]  # (dim,)
    clip: float


class DifferentialPrivacyStrategy(WrappingStrategy):
    """A :class:`~fedge.algorithms.base.Strategy` whose aggregation is DP-FedAvg's noised, clipped mean.

    What is not about the round's aggregation (evaluation, global weights, reports) is the wrapped strategy's
    (:class:`~fedge.algorithms.wrapping.WrappingStrategy`); the clip rides in its state."""

    def __init__(
        self,
        inner: Strategy[Any],
        config: RunConfig,
        *,
        rand_bytes: RandBytes = os.urandom,
    ) -> None:
        super().__init__(inner, config)
        self.dp_config = config
        self._rand = rand_bytes
        self._session = rand_bytes(8).hex()
        specs = inner.reply_tensors()
        weights = inner.global_weights()
        if weights is None:
            raise ConfigError(f"differential privacy needs a global model; {inner.name} has none")
        # What its server releases sums of (the model's move; SCAFFOLD's control deltas too): one joint clip covers
        # them all. A per-client rescaling (FedNova's) or per-client server state (FedCurv's) is outside that bound.
        beyond = [h for h in ("secure_shares", "secure_scale", "secure_survivors") if hasattr(inner, h)]
        if beyond:
            raise ConfigError(f"DP-FedAvg cannot bound {inner.name}'s release by one clip: it needs {beyond[0]}")
        declared = getattr(inner, "secure_parts", None)
        parts: tuple[SecurePart, ...] = declared() if callable(declared) else default_parts(list(specs))
        covered = {n for p in parts for n in p.tensors}
        odd = [k for k, (shape, dtype) in specs.items() if dtype != torch.float32 or k not in covered]
        odd += [n for p in parts if p.relative for n in p.tensors if n not in weights]
        if odd:
            raise ConfigError(f"DP-FedAvg noises float32 moves and deltas; this model also exchanges {odd[:3]}")
        self._layout = Contribution(parts, specs)  # one flat vector per client: the distinct parts, clipped jointly
        self._dim = self._layout.dim
        self.population = config.num_clients
        self.q = config.client_fraction
        self.expected_cohort = self.q * self.population  # m = qN, the fixed denominator
        self.z = config.dp_noise_multiplier
        self.adaptive = config.dp_fixed_clip is None
        self.count_std = count_std(self.expected_cohort) if self.adaptive else 0.0
        self.z_update = update_noise_multiplier(self.z, self.count_std) if self.adaptive else self.z
        self.delta = config.dp_delta_used
        self.clip = config.dp_initial_clip
        self.ledger = Ledger(self.q, self.z, self.delta, config.dp_accountant)
        self._epsilons: dict[int, float] = {}
        self._round: _Round | None = None
        self._record = AggregationRecord()
        self._secure_metrics: dict[str, float] = {}
        self.last: PrivateRound | None = None
        self._remote: StageChannel | None = None
        self._advertised: dict[ClientId, AdvertiseKeys] = {}  # this round's, remote parties only
        log.info(
            "DP-FedAvg: noise multiplier %g (%g on the update%s), clip %s, q = %g of %d clients (expected cohort "
            "%g), delta = %.3g%s, %s accountant; noise seeded from %s",
            self.z,
            self.z_update,
            f", clipped-count std {self.count_std:g}" if self.adaptive else "",
            f"adaptive from {self.clip:g}" if self.adaptive else f"{self.clip:g}",
            self.q,
            self.population,
            self.expected_cohort,
            self.delta,
            "" if config.dp_delta else " (1 / N^1.1)",
            config.dp_accountant,
            f"--dp-noise-seed {config.dp_noise_seed}" if config.dp_noise_seed is not None else "os.urandom",
        )

    def use_channel(self, channel: StageChannel) -> None:
        """Under secure aggregation, run the clients' parties where the clients are (a deployment): each client clips
        its update, adds its share of the noise (:mod:`fedge.privacy.shares`) and masks it on the device; a reply is
        its report and public keys, and :meth:`aggregate` drives the remaining stages over ``channel``."""
        self._remote = channel

    def epsilon_after(self, rounds: int) -> float:
        """Epsilon at the run's delta after ``rounds`` rounds (cached: a pure function of the round count)."""
        if rounds not in self._epsilons:
            self._epsilons[rounds] = self.ledger.epsilon(rounds)
        return self._epsilons[rounds]

    def stop_before(self, rnd: int) -> str:
        """Why round ``rnd`` must not run (its epsilon would exceed the budget), or ""."""
        budget = self.dp_config.dp_epsilon_budget
        if budget <= 0:
            return ""
        spent, would = self.epsilon_after(rnd - 1), self.epsilon_after(rnd)
        if would <= budget:
            return ""
        return (
            f"privacy budget: round {rnd} would spend epsilon {would:.3f} > --dp-epsilon-budget {budget:g} at delta "
            f"{self.delta:.3g}; stopped after round {rnd - 1} at epsilon {spent:.3f}"
        )

    # --- the round protocol -----------------------------------------------------------------------------------------

    def configure(self, rnd: int, clients: Sequence[ClientId]) -> RoundPlan:
        plan = self.inner.configure(rnd, clients)
        weights = self.inner.global_weights()
        assert weights is not None  # checked in __init__
        cohort = tuple(sorted(clients))
        secure = self._secure_config(rnd, cohort) if self.dp_config.secure_aggregation and len(cohort) >= 2 else None
        self._round = _Round(rnd, cohort, dict(weights), self._layout.reference(weights), self.clip, secure)
        if self._remote is None or not self.dp_config.secure_aggregation:
            return plan
        if secure is None or plan.broadcast is None:  # a lone client's update would reach the coordinator alone
            log.info(
                "round %d: a cohort of %d under secure aggregation: no task, the round is noise only", rnd, len(cohort)
            )
            return dataclasses.replace(plan, broadcast=None, tasks={})
        share = self._client_share(secure, self.clip)
        tensors, meta = secure.to_fields()
        params = {
            **plan.broadcast.params,
            **meta,
            SEED_PARAM: secure.round_seed.hex(),
            LAYOUT_PARAM: ",".join(self._layout.parts[0].tensors),
            **parts_param(self._layout.parts),  # SCAFFOLD: the control deltas too, in the one clipped vector
            **share_params(share),
        }
        assert set(tensors) == {"secagg.round_seed"}
        return dataclasses.replace(plan, broadcast=dataclasses.replace(plan.broadcast, params=params))

    def _stds(self, bound: float) -> npt.NDArray[np.float64]:
        """(dim + 1,) the std of the released sum's noise: z_delta C per coordinate, sigma_b on the count."""
        stds = np.full(self._dim + 1, self.z_update * bound)
        stds[-1] = self.count_std
        return stds

    def _secure_config(self, rnd: int, cohort: tuple[ClientId, ...]) -> RoundConfig:
        """The secure sum's parameters: the graph's degree and threshold for the cohort, and a ring whose bound holds
        the clip plus NOISE_BOUND_STDS of one client's noise share (which depends on the threshold)."""
        cfg = self.dp_config
        fields: dict[str, Any] = dict(
            run=self.inner.run_id,
            session=self._session,
            round=rnd,
            clients=cohort,
            round_seed=graph_seed(cfg.seed, rnd),
            dim=self._dim + 1,
            ring_bits=RING_BITS,
        )
        graph = RoundConfig.new(
            **fields, bound=1.0, degree=cfg.secagg_degree or None, threshold=cfg.secagg_threshold or None
        )
        share = self._stds(self.clip) / math.sqrt(graph.min_survivors)  # (dim + 1,) each client's noise std
        ring_bound = max(self.clip, 1.0) + NOISE_BOUND_STDS * float(share.max())
        return RoundConfig.new(**fields, bound=ring_bound, degree=graph.degree, threshold=graph.threshold)

    def _client_share(self, config: RoundConfig, bound: float) -> ClientShare:
        """What each client of a secure round adds: the clip, the count bit (adaptive clipping) and its noise."""
        share = self._stds(bound) / math.sqrt(config.min_survivors)
        return ClientShare(bound, self.adaptive, float(share[0]), float(share[-1]))

    def accept(self, rnd: int, client: ClientId, reply: Message) -> CheckedReply:
        if self._remote is None or not self.dp_config.secure_aggregation:
            return self.inner.accept(rnd, client, reply)
        checked, self._advertised[client] = remote_reply(self.inner, rnd, client, reply)
        return checked

    def aggregate(self, rnd: int, replies: Mapping[ClientId, CheckedReply]) -> dict[str, float]:
        """Clip, noise and sum the replies (securely when the run asks); hand the inner strategy ``w + sum / m``."""
        state = self._round
        if state is None or state.round != rnd:
            raise RuntimeError(f"round {rnd} was not configured by this strategy")
        cfg, bound = self.dp_config, state.clip
        ordered = sorted(replies)
        secure = state.secure is not None
        if secure and self._remote is not None:
            return self._aggregate_remote(rnd, state, replies, self._remote)
        vectors: dict[ClientId, npt.NDArray[np.float64]] = {}  # each client's input to the secure sum
        plain = np.zeros(self._dim + 1)  # (dim + 1,) the sum of the clipped deltas and bits, without the protocol
        norms: dict[ClientId, float] = {}
        scratch = None if secure else np.empty(self._dim + 1)  # one vector at a time, summed at once: one buffer
        for c in ordered:
            # (dim + 1,) clip_C(the parts' values), then the bit ||.|| <= C; each step in place (1.66M values a reply
            # for fedavg_cnn: a temporary costs as much as the arithmetic)
            vector = np.empty(self._dim + 1) if scratch is None else scratch
            self._layout.move_into(replies[c].update.tensors, state.reference, vector[:-1])
            norm = l2_norm(vector[:-1])
            if norm > bound:
                vector[:-1] *= bound / norm
            vector[-1] = 1.0 if self.adaptive and norm <= bound else 0.0  # a fixed clip releases no count
            norms[c] = min(norm, bound)
            if secure:
                vectors[c] = vector
            else:
                plain += vector
        stds = self._stds(bound)  # (dim + 1,) the noise of the released sum
        rng = noise_rng(cfg.dp_noise_seed, rnd)
        metrics = {
            "dp_epsilon": self.epsilon_after(rnd),
            "dp_delta": self.delta,
            "dp_clip": bound,
            "dp_noise_std": float(stds[0]),
            "dp_cohort": float(len(state.cohort)),
        }
        if secure:
            try:
                total, noise, survivors = self._secure_sum(rnd, state, vectors, stds, rng)
            except RoundAbandoned:
                return metrics
            clipped_sum = np.zeros(self._dim)  # (dim,) in survivor order, in place (sum() would copy per client)
            for c in survivors:
                clipped_sum += vectors[c][:-1]
            metrics.update(self._secure_metrics)  # the survivors' noise: dp_noise_std * sqrt(survivors / t)
        else:
            noise = rng.normal(0.0, stds)  # (dim + 1,) the coordinator's draw (also a lone client's, in effect)
            clipped_sum, total, survivors = plain[:-1], plain + noise, tuple(ordered)
        after = self._release(rnd, state, total, replies, survivors, metrics)
        self.last = PrivateRound(
            {c: norms[c] for c in survivors}, clipped_sum, noise[:-1], survivors, state.reference, after, bound
        )
        return metrics

    def _release(
        self,
        rnd: int,
        state: _Round,
        total: npt.NDArray[np.float64],
        replies: Mapping[ClientId, CheckedReply],
        survivors: Sequence[ClientId],
        metrics: dict[str, float],
    ) -> npt.NDArray[np.float64]:
        """From the noised sum ``total`` (dim + 1,): the reply standing for the round (new weights ``w + sum / m``;
        SCAFFOLD's control-delta sum, FedDyn's drift sum), handed to the inner strategy; ``reference + sum / m``
        (returned flat); and, under adaptive clipping, the next round's clip."""
        cfg = self.dp_config
        after = state.reference + total[:-1] / self.expected_cohort  # (dim,) f_f: the fixed denominator
        tensors = self._layout.stand_in(state.weights, total[:-1], self.expected_cohort)
        if self.adaptive:
            self.clip = adapted_clip(
                state.clip, float(total[-1]), self.expected_cohort, cfg.dp_target_quantile, cfg.dp_clip_lr
            )
            metrics["dp_unclipped_share"] = float(total[-1]) / self.expected_cohort  # noised: public
        self.inner.aggregate(rnd, {SUM_CLIENT: self._mean_reply(rnd, replies, survivors, tensors)})
        return after

    def _aggregate_remote(
        self, rnd: int, state: _Round, replies: Mapping[ClientId, CheckedReply], channel: StageChannel
    ) -> dict[str, float]:
        """The secure sum with the clients' parties on their devices: each reply brought its keys; each client
        clips, noises and masks its own input; only the noised sum comes back, so :attr:`last` stays None."""
        config = state.secure
        assert config is not None
        stds = self._stds(state.clip)
        metrics = {
            "dp_epsilon": self.epsilon_after(rnd),
            "dp_delta": self.delta,
            "dp_clip": state.clip,
            "dp_noise_std": float(stds[0]),
            "dp_cohort": float(len(state.cohort)),
        }
        advertised = [self._advertised[c] for c in sorted(replies) if c in self._advertised]
        self._advertised = {}

        def deliver(stage: Stage, messages: Mapping[ClientId, SecAggMessage]) -> list[SecAggMessage]:
            return channel.stage(rnd, config, stage, messages, {})  # summed as they are: no averaging shares

        def refused(message: SecAggMessage, exc: SecAggError) -> None:
            log.warning("round %d: secure aggregation: refused a %s of %s: %s", rnd, message.KIND, message.client, exc)

        try:
            result = serve_round(SecAggServer(config), advertised, deliver, refused=refused)
        except RoundAbandoned as exc:
            entries, why = channel.take_record(rnd)
            gone = [c for c in sorted(replies) if c in why]
            self._record = AggregationRecord(tuple(entries), remote_drops(gone, why, config), str(exc))
            return metrics
        entries, why = channel.take_record(rnd)
        gone = [c for c in result.dropped if c in replies]
        self._record = AggregationRecord(tuple(entries), remote_drops(gone, why, config), "")
        metrics |= {"dp_min_survivors": float(config.min_survivors), "dp_survivors": float(len(result.survivors))}
        self._release(rnd, state, result.decoded_sum, replies, result.survivors, metrics)
        self.last = None  # the coordinator knows neither a client's clipped update nor its noise
        return metrics

    def _secure_sum(
        self,
        rnd: int,
        state: _Round,
        vectors: Mapping[ClientId, npt.NDArray[np.float64]],
        stds: npt.NDArray[np.float64],
        rng: np.random.Generator,
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], tuple[ClientId, ...]]:
        """SecAgg+ over the vectors, each client's share of the noise added before masking: (the unmasked sum, the
        noise in it, the survivors). Raises RoundAbandoned (its record kept) when too many clients vanish."""
        cfg, config = self.dp_config, state.secure
        assert config is not None  # a secure round
        t_min = config.min_survivors  # the fewest survivors a completed round can have
        share = stds / math.sqrt(t_min)  # (dim + 1,) each client's noise std
        noises: dict[ClientId, npt.NDArray[np.float64]] = {}
        inputs: dict[ClientId, npt.NDArray[np.float64]] = {}
        drop_at: dict[ClientId, Stage] = {}
        for c in state.cohort:  # in id order: one stream, each client's draw in turn
            if c in vectors:
                noises[c] = rng.normal(0.0, share)
                inputs[c] = vectors[c] + noises[c]
            else:  # sampled, without a valid reply: never shows up in the protocol
                inputs[c], drop_at[c] = np.zeros(self._dim + 1), "advertise"
        simulated = simulated_dropouts(state.cohort, cfg.simulate_dropouts, cfg.seed, rnd)
        drop_at.update({c: s for c, s in simulated.items() if c in vectors})
        # The reply (dim float32 values) stands for the masked upload's first 4 dim bytes; the count value masked
        # after them (dim + 1 values, 4 bytes each) is sent too, so it gets an entry of its own.
        ledger = ProtocolLedger(rnd, 4 * self._dim)
        try:
            result = run_configured(
                config,
                inputs,
                drop_at=drop_at,
                rng=rounding_rng(cfg.seed, rnd),
                rand_bytes=self._rand,
                on_message=ledger,
            )
        except RoundAbandoned as exc:
            gone = [c for c in sorted(drop_at) if c in vectors]
            self._record = AggregationRecord(tuple(ledger.entries), simulated_drops(gone, drop_at, config), str(exc))
            raise
        survivors = result.survivors
        gone = [c for c in result.dropped if c in vectors]
        self._record = AggregationRecord(tuple(ledger.entries), simulated_drops(gone, drop_at, result.config), "")
        noise = np.zeros(self._dim + 1)  # (dim + 1,) in survivor order, in place
        for c in survivors:
            noise += noises[c]
        self._secure_metrics = {"dp_min_survivors": float(t_min), "dp_survivors": float(len(survivors))}
        return result.decoded_sum, noise, survivors

    def _mean_reply(
        self,
        rnd: int,
        replies: Mapping[ClientId, CheckedReply],
        survivors: Sequence[ClientId],
        weights: dict[str, torch.Tensor],
    ) -> CheckedReply:
        """One reply carrying the noised weights; its report counts the survivors' examples and no loss (the clients'
        losses are not noised, so they are not released)."""
        examples = sum(replies[c].report.num_examples for c in survivors)
        if survivors:
            first = replies[survivors[0]]
            report = dataclasses.replace(first.report, num_examples=examples, loss=None)
            update = dataclasses.replace(first.update, client=SUM_CLIENT, tensors=weights)
            return dataclasses.replace(first, report=report, update=update)
        update = Message(kind="update", round=rnd, run=self.inner.run_id, client=SUM_CLIENT, tensors=weights)
        return CheckedReply(self.inner.report_type(num_examples=0), update)

    def aggregation_record(self, rnd: int) -> AggregationRecord:
        record, self._record = self._record, AggregationRecord()
        return record

    # --- the inner strategy's state, with the clip -------------------------------------------------------------------

    def state(self) -> StrategyState:
        tensors, values = self.inner.state()
        return tensors, {**values, "dp_clip": self.clip}

    def load_state(self, tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any]) -> None:
        rest = dict(values)
        self.clip = float(rest.pop("dp_clip", self.clip))
        self.inner.load_state(tensors, rest)


def privatized(strategy: Strategy[Any], config: RunConfig) -> Strategy[AlgorithmSettings]:
    """``strategy`` wrapped for DP-FedAvg (secure aggregation inside, when asked)."""
    return DifferentialPrivacyStrategy(strategy, config)
