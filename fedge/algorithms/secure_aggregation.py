"""Secure aggregation of the FedAvg family: the server half's aggregation gets the sum of the round's updates, never
one client's update (Bonawitz et al. 2017; Bell et al. 2020: the SecAgg+ protocol of :mod:`fedge.secagg`).

:class:`SecureAggregationStrategy` wraps an algorithm's :class:`~fedge.algorithms.base.Strategy` whose aggregation
needs sums of the returned tensors only (``Algorithm.secagg_gap == ""``): by default the weighted mean of the returned
weights, as below; an algorithm that needs more (SCAFFOLD's control deltas, FedNova's per-client scaling, FedDyn's
plain sum, FedCurv's Fisher sums, DS-FL's and FD's outputs) declares the parts of each client's vector,
:mod:`fedge.secagg.parts`. One that tells each client whether its own upload is in what it broadcasts next (FD's
leave-one-out, FedCurv's own terms, which the client subtracts itself) is told the survivors U3 before it aggregates
(``secure_survivors``). Per round, with ``w`` the broadcast weights, ``a_k`` client k's averaging weight (its data
size, or 1 under uniform weighting) and ``A`` the sum of the ``a_k`` of the clients that take part:

1. :meth:`~SecureAggregationStrategy.configure`: the inner plan; the round's public protocol parameters
   (:class:`~fedge.secagg.config.RoundConfig`: the sampled cohort, the ring plan, degree, threshold, graph seed)
   ride in the broadcast's params, so their bytes are counted.
2. Each client's vector is ``x_k = (a_k / A) clip_C(w_k - w)``, flattened over the reply's tensors, where
   ``clip_C`` scales a delta down to L2 norm ``C`` (``secagg_clip``): each coordinate of ``x_k`` then lies in
   ``[-C, C]``, the ring's bound, and the clip is the norm bound that replaces the server's plaintext checks.
3. :meth:`~SecureAggregationStrategy.aggregate`: :func:`fedge.secagg.run_round` runs the protocol over the ``x_k``
   (every party's state machine, every message packed and parsed). The server learns ``S = sum_{U3} x_k`` and the
   survivors U3 (with their ``a_k`` and losses, reported in the clear), so the mean update of U3 is
   ``S / sum_{U3} a_k / A``. The inner strategy aggregates one reply carrying ``w`` plus that mean, with
   ``num_examples = sum_{U3} n_k``: a weighted average of one state is that state, bit for bit.

In ``fedge sim`` the replies are computed by the real client code in the executor's workers and reach this process
in the clear; the clients' parties of the protocol (clipping, encoding, key agreement, share encryption, masking) then
run here on their behalf, the same code a device runs over MQTT (:meth:`~SecureAggregationStrategy.use_channel`).
Nothing but the unmasked sum reaches the inner strategy.

Randomness: keys, self-mask seeds and nonces come from ``rand_bytes`` (os.urandom); the masks cancel exactly, so the
sum does not depend on them. The stochastic rounding, the simulated dropouts and the public graph seed derive from
the run's seed and the round, so two runs with one seed give the same model bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from fedge.accounting.records import AggregationRecord
from fedge.algorithms.base import CheckedReply, RoundPlan, Strategy, UpdateReport
from fedge.algorithms.wrapping import WrappingStrategy
from fedge.config import AlgorithmSettings, RunConfig
from fedge.errors import CodecError, ConfigError
from fedge.secagg.config import RoundConfig
from fedge.secagg.driver import RoundResult, run_configured, serve_round
from fedge.secagg.errors import RoundAbandoned, SecAggError
from fedge.secagg.messages import AdvertiseKeys, SecAggMessage
from fedge.secagg.parts import PartLayout, SecurePart, default_parts, parts_param
from fedge.secagg.protocol import SecAggServer, Stage
from fedge.secagg.remote import LAYOUT_PARAM, SEED_PARAM, WEIGHT_PARAM, StageChannel, from_message
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
from fedge.types import ClientId
from fedge.wire.fields import printable
from fedge.wire.message import UPDATE, Message

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Round:
    """What :meth:`SecureAggregationStrategy.configure` fixed for the round's aggregation."""

    round: int
    config: RoundConfig
    reference: dict[str, torch.Tensor]  # the broadcast weights


@dataclass(frozen=True)
class SecureRound:
    """The last aggregated round as the simulator saw it (for tests and benchmarks): each client's vector
    (its parts, each clipped to C, times its share ``s_k`` where weighted), the protocol's result, what the vectors
    are moves from (flat: the global weights on relative parts' coordinates, 0 elsewhere) and the stand-in's
    tensors after."""

    vectors: Mapping[ClientId, npt.NDArray[np.float64]]
    shares: Mapping[ClientId, float]  # s_k: a_k / A, or the algorithm's (secure_shares)
    result: RoundResult
    before: npt.NDArray[np.float64]  # (dim,)
    after: dict[str, torch.Tensor]


class SecureAggregationStrategy(WrappingStrategy):
    """A :class:`~fedge.algorithms.base.Strategy` whose aggregation sees only the secure sum of the updates.

    Everything that is not about aggregation (evaluation, state, global weights, reports, what stops a run) is the
    wrapped strategy's (:class:`~fedge.algorithms.wrapping.WrappingStrategy`)."""

    def __init__(
        self,
        inner: Strategy[Any],
        config: RunConfig,
        *,
        rand_bytes: RandBytes = os.urandom,
    ) -> None:
        super().__init__(inner, config)
        self.secure_config = config
        self._rand = rand_bytes
        self._session = rand_bytes(8).hex()  # keys are bound to it: a new coordinator never reuses one
        specs = inner.reply_tensors()
        weights = inner.global_weights()
        # The FedAvg family's (fedge.algorithms.fedavg.FedAvg): each client's share s_k (data sizes, or 1 each, or
        # FedNova's), the parts of its vector, and a factor on the weighted mean's step (FedNova's).
        shares = getattr(inner, "secure_shares", None) or getattr(inner, "averaging_weights", None)
        if not callable(shares):
            raise ConfigError(f"secure aggregation needs averaging weights; {inner.name} has none")
        self._shares: Callable[[Sequence[CheckedReply]], list[float]] = shares
        declared = getattr(inner, "secure_parts", None)
        parts: tuple[SecurePart, ...] = declared() if callable(declared) else default_parts(list(specs))
        if weights is None and any(p.relative for p in parts):
            raise ConfigError(f"secure aggregation of a model's move needs a global model; {inner.name} has none")
        self._scale: Callable[[Sequence[CheckedReply]], tuple[float, dict[str, float]]] | None = getattr(
            inner, "secure_scale", None
        )
        # FD and FedCurv: the inner strategy learns who is in the sum (U3, which the protocol reveals anyway) and their
        # reports (in the clear anyway), so a client can be told whether its own upload is in what it is sent next
        # (it subtracts its own part itself) and FD pools the survivors' own test counts.
        self._note_survivors: Callable[[int, Mapping[ClientId, UpdateReport]], None] | None = getattr(
            inner, "secure_survivors", None
        )
        covered = {n for p in parts for n in p.tensors}
        odd = [k for k, (shape, dtype) in specs.items() if dtype != torch.float32 or k not in covered]
        odd += [n for p in parts if p.relative for n in p.tensors if n not in (weights or {})]
        if odd:
            raise ConfigError(
                f"secure aggregation sums float32 tensors; this model also exchanges {odd[:3]} (not float32, not "
                "declared in a part, or a relative part's tensor not in the global model), which is not supported yet"
            )
        wide = [p.value_bound for p in parts if p.value_bound is not None and p.value_bound > config.secagg_clip]
        if wide:
            raise ConfigError(
                f"--secagg-clip {config.secagg_clip:g} is the ring's bound per value; {inner.name} uploads values up "
                f"to {max(wide):g}: set --secagg-clip {max(wide):g} or more"
            )
        self._layout = PartLayout(parts, specs)  # one flat vector per client, the parts concatenated
        self._dim = self._layout.dim
        self._round: _Round | None = None
        self._record = AggregationRecord()
        self.last: SecureRound | None = None
        self._remote: StageChannel | None = None
        self._advertised: dict[ClientId, AdvertiseKeys] = {}  # this round's, remote parties only
        # Fails now, not in round 1, when the degree, threshold or bound cannot fit the run's cohort.
        self._round_config(1, [f"c{i}" for i in range(config.clients_per_round)])
        log.info(
            "secure aggregation (SecAgg+): each client clips its update to L2 norm %g; the server's update-norm "
            "check is off (it needs the plaintext)",
            config.secagg_clip,
        )

    def use_channel(self, channel: StageChannel) -> None:
        """Run the clients' parties where the clients are (a deployment): each reply is the client's report and
        public keys, and :meth:`aggregate` drives the remaining stages over ``channel``."""
        self._remote = channel

    def _round_config(self, rnd: int, cohort: Sequence[ClientId]) -> RoundConfig:
        c = self.secure_config
        return RoundConfig.new(
            run=self.inner.run_id,
            session=self._session,
            round=rnd,
            clients=cohort,
            round_seed=graph_seed(c.seed, rnd),
            dim=self._dim,
            bound=c.secagg_clip,
            ring_bits=RING_BITS,
            degree=c.secagg_degree or None,
            threshold=c.secagg_threshold or None,
        )

    # --- the round protocol -----------------------------------------------------------------------------------------

    def configure(self, rnd: int, clients: Sequence[ClientId]) -> RoundPlan:
        plan = self.inner.configure(rnd, clients)
        weights = self.inner.global_weights()  # None (FD) only where no part is a move: checked in __init__
        config = self._round_config(rnd, clients)
        self._round = _Round(rnd, config, dict(weights or {}))
        tensors, meta = config.to_fields()
        params = {
            **meta,
            SEED_PARAM: config.round_seed.hex(),
            LAYOUT_PARAM: ",".join(self._layout.parts[0].tensors),
            **parts_param(self._layout.parts),
        }
        assert set(tensors) == {"secagg.round_seed"}
        if plan.broadcast is None:  # nothing to broadcast (DS-FL's first round): each task carries the parameters
            tasks = {c: dataclasses.replace(t, params={**t.params, **params}) for c, t in plan.tasks.items()}
            return dataclasses.replace(plan, tasks=tasks)
        broadcast = dataclasses.replace(plan.broadcast, params={**plan.broadcast.params, **params})
        return dataclasses.replace(plan, broadcast=broadcast)

    def accept(self, rnd: int, client: ClientId, reply: Message) -> CheckedReply:
        """The inner strategy's checks of the envelope, tensors and report (its update-norm check is off). With
        remote parties, a reply carries the client's report and its advertised public keys, no update."""
        if self._remote is None:
            return self.inner.accept(rnd, client, reply)
        checked, self._advertised[client] = remote_reply(self.inner, rnd, client, reply)
        return checked

    def aggregate(self, rnd: int, replies: Mapping[ClientId, CheckedReply]) -> dict[str, float]:
        """Run the protocol over the replies' clipped, weighted deltas; hand the inner strategy their mean only."""
        state = self._round
        if state is None or state.round != rnd:
            raise RuntimeError(f"round {rnd} was not configured by this strategy")
        cfg, config = self.secure_config, state.config
        ordered = sorted(replies)
        averaging = self._shares([replies[c] for c in ordered])
        total = float(sum(averaging))
        shares = {c: float(a) / total for c, a in zip(ordered, averaging, strict=True)}  # s_k, e.g. a_k / A
        if self._remote is not None:
            return self._aggregate_remote(rnd, replies, shares, state, self._remote)
        vectors: dict[ClientId, npt.NDArray[np.float64]] = {}
        clipped = 0
        for c in ordered:
            parts, was_clipped = self._layout.vector(replies[c].update.tensors, state.reference, cfg.secagg_clip)
            vectors[c] = parts * self._layout.coefficients(shares[c])  # (dim,) each coordinate in [-C, C]
            clipped += was_clipped
        simulated = simulated_dropouts(config.clients, cfg.simulate_dropouts, cfg.seed, rnd)
        drop_at: dict[ClientId, Stage] = {c: s for c, s in simulated.items() if c in replies}
        for c in config.clients:  # sampled, but without a valid reply: it never shows up in the protocol
            if c not in replies:
                vectors[c], drop_at[c] = np.zeros(self._dim), "advertise"
        ledger = ProtocolLedger(rnd, 4 * self._layout.covered)
        metrics = self._round_metrics(config, clipped)
        try:
            result = run_configured(
                config,
                vectors,
                drop_at=drop_at,
                rng=rounding_rng(cfg.seed, rnd),
                rand_bytes=self._rand,
                on_message=ledger,
            )
        except RoundAbandoned as exc:
            gone = [c for c in sorted(drop_at) if c in replies]
            self._record = AggregationRecord(tuple(ledger.entries), simulated_drops(gone, drop_at, config), str(exc))
            return metrics
        survivors = result.survivors
        after = self._release(rnd, state, result.decoded_sum, survivors, replies, shares, metrics)
        gone = [c for c in result.dropped if c in replies]
        self._record = AggregationRecord(tuple(ledger.entries), simulated_drops(gone, drop_at, config), "")
        self.last = SecureRound(vectors, shares, result, self._layout.reference(state.reference), after)
        return metrics | {
            "secagg_survivors": float(len(survivors)),
            "secagg_vanished_unmasking": float(sum(1 for c in survivors if drop_at.get(c) == "unmask")),
            "secagg_upload_tensor_bytes": float(ledger.upload_tensor_bytes),
            "secagg_s": sum(result.timings.values()),
            "secagg_unmask_server_s": result.timings["unmask.server"],
        }

    def _aggregate_remote(
        self,
        rnd: int,
        replies: Mapping[ClientId, CheckedReply],
        shares: Mapping[ClientId, float],
        state: _Round,
        channel: StageChannel,
    ) -> dict[str, float]:
        """The server's side of the protocol over ``channel``: the replies brought the keys (stage 0), the clients
        clip, weight, encode and mask their own updates; only the unmasked sum comes back."""
        config = state.config
        advertised = [self._advertised[c] for c in sorted(replies) if c in self._advertised]
        self._advertised = {}
        weights = {c: {WEIGHT_PARAM: repr(shares[c])} for c in replies}

        def deliver(stage: Stage, messages: Mapping[ClientId, SecAggMessage]) -> list[SecAggMessage]:
            return channel.stage(rnd, config, stage, messages, weights if stage == "upload" else {})

        def refused(message: SecAggMessage, exc: SecAggError) -> None:
            log.warning(
                "round %d: secure aggregation: refused a %s message of %s: %s", rnd, message.KIND, message.client, exc
            )

        metrics = self._round_metrics(config, clipped=None)
        timings: dict[str, float] = {}  # the server's own seconds per stage
        started = time.perf_counter()
        try:
            result = serve_round(SecAggServer(config), advertised, deliver, timings=timings, refused=refused)
        except RoundAbandoned as exc:
            entries, why = channel.take_record(rnd)
            gone = [c for c in sorted(replies) if c in why]
            self._record = AggregationRecord(tuple(entries), remote_drops(gone, why, config), str(exc))
            return metrics
        entries, why = channel.take_record(rnd)
        survivors = result.survivors
        self._release(rnd, state, result.decoded_sum, survivors, replies, shares, metrics)
        gone = [c for c in result.dropped if c in replies]
        self._record = AggregationRecord(tuple(entries), remote_drops(gone, why, config), "")
        return metrics | {
            "secagg_survivors": float(len(survivors)),
            "secagg_vanished_unmasking": float(sum(1 for c in survivors if c in why)),
            "secagg_s": time.perf_counter() - started,  # the stages after the replies, waiting for clients included
            "secagg_server_s": sum(timings.values()),
            "secagg_unmask_server_s": timings.get("unmask.server", 0.0),
        }

    def _release(
        self,
        rnd: int,
        state: _Round,
        decoded: npt.NDArray[np.float64],
        survivors: Sequence[ClientId],
        replies: Mapping[ClientId, CheckedReply],
        shares: Mapping[ClientId, float],
        metrics: dict[str, float],
    ) -> dict[str, torch.Tensor]:
        """The unmasked sum ``decoded`` of ``survivors`` handed on: the inner strategy told who survived (when it asks)
        and aggregating the reply that stands for them, its metrics and the stand-in's added to ``metrics``. The
        stand-in's tensors."""
        after, scaled = self._stand_in(state, decoded, replies, shares, survivors)
        if self._note_survivors is not None:
            self._note_survivors(rnd, {c: replies[c].report for c in survivors})
        metrics.update(self.inner.aggregate(rnd, {SUM_CLIENT: _mean_reply(replies, survivors, after)}) | scaled)
        return after

    def _stand_in(
        self,
        state: _Round,
        decoded: npt.NDArray[np.float64],
        replies: Mapping[ClientId, CheckedReply],
        shares: Mapping[ClientId, float],
        survivors: Sequence[ClientId],
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The tensors of the reply that stands for the survivors: each weighted part's mean (``decoded`` over
        ``sum_{U3} s_k``, times the algorithm's factor), each plain part's sum; and the factor's metrics (they
        replace the inner strategy's, which sees one reply)."""
        weight = sum(shares[c] for c in survivors)  # sum_{U3} s_k
        scale, extra = 1.0, dict[str, float]()
        if self._scale is not None:
            scale, extra = self._scale([replies[c] for c in survivors])
        return self._layout.stand_in(state.reference, decoded, weight, scale=scale), extra

    def _round_metrics(self, config: RoundConfig, clipped: int | None) -> dict[str, float]:
        """The round's public protocol parameters (and, in process, how many updates the clip shortened)."""
        metrics = {
            "secagg_bound": config.plan.bound,
            "secagg_ring_bits": float(config.plan.ring_bits),
            "secagg_frac_bits": float(config.plan.frac_bits),
            "secagg_degree": float(config.degree),
            "secagg_threshold": float(config.threshold),
        }
        return metrics if clipped is None else metrics | {"secagg_clipped": float(clipped)}

    def aggregation_record(self, rnd: int) -> AggregationRecord:
        """The protocol's messages of round ``rnd`` (all but the masked uploads, which the clients' update messages
        stand for: 4 bytes a value either way), whom it left out, and whether it gave up."""
        record, self._record = self._record, AggregationRecord()
        return record


def remote_reply(
    inner: Strategy[Any], rnd: int, client: ClientId, reply: Message
) -> tuple[CheckedReply, AdvertiseKeys]:
    """A remote party's reply (its report and advertised keys, no update) checked: the inner strategy's envelope and
    report rules, and the keys' message; CodecError otherwise."""
    expected = {"kind": UPDATE, "round": rnd, "client": client, "run": inner.run_id}
    got = {"kind": reply.kind, "round": reply.round, "client": reply.client, "run": reply.run}
    wrong = [
        f"{k} {printable(str(got[k]), 64)!r} (expected {expected[k]!r})" for k in expected if got[k] != expected[k]
    ]
    if wrong:
        raise CodecError("reply has " + ", ".join(wrong))
    report = inner.report_of(reply)
    keys = from_message(reply)
    if not isinstance(keys, AdvertiseKeys):
        raise CodecError(f"a reply under secure aggregation carries the client's keys, not a {keys.KIND} message")
    return CheckedReply(report, reply), keys


def _mean_reply(
    replies: Mapping[ClientId, CheckedReply], survivors: Sequence[ClientId], weights: dict[str, torch.Tensor]
) -> CheckedReply:
    """One reply carrying ``weights`` (the survivors' mean), their data sizes' sum and their mean loss, for the inner
    strategy: a weighted average of one state is that state."""
    first = replies[survivors[0]]
    losses = [loss for c in survivors if (loss := replies[c].report.loss) is not None]
    report = dataclasses.replace(
        first.report,
        num_examples=sum(replies[c].report.num_examples for c in survivors),
        loss=sum(losses) / len(losses) if losses else None,
    )
    update = dataclasses.replace(first.update, client=SUM_CLIENT, tensors=weights)
    return dataclasses.replace(first, report=report, update=update)


def secured(strategy: Strategy[Any], config: RunConfig) -> Strategy[AlgorithmSettings]:
    """``strategy`` wrapped for secure aggregation when the run asks for it, else itself."""
    if not config.secure_aggregation:
        return strategy
    return SecureAggregationStrategy(strategy, config)
