"""The round loop, written once for every algorithm and transport.

Per round: sample clients, let the strategy plan the round, let the transport deliver it and collect the replies,
aggregate when a quorum replied (otherwise, or when the strategy's own protocol gives up, as secure aggregation does
when too many clients vanish, the round is skipped: the global state stays as it was and the run goes on), evaluate,
and record a :class:`fedge.accounting.records.RoundRecord`. Same config and seeds give the same result over any
transport.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType

import numpy as np
import torch

from coordinator.transport import Exchange, Transport
from fedge.accounting.ledger import ByteLedger, RoundBytes
from fedge.accounting.records import ByteCounts, RoundRecord
from fedge.algorithms.base import CheckedReply, Strategy, derive_seed
from fedge.config import RunConfig
from fedge.learning.metrics import forgetting
from fedge.privacy.mechanism import poisson_sample
from fedge.types import ClientId
from fedge.wire.message import Message
from fedge.wire.protocol import STATE_ROUND

log = logging.getLogger(__name__)


@dataclass
class RunHistory:
    """Everything recorded so far: one record per round, and the ledger."""

    rounds: list[RoundRecord] = field(default_factory=list)
    ledger: ByteLedger = field(default_factory=ByteLedger)
    per_class_history: list[np.ndarray] = field(default_factory=list)
    resumed_after: list[int] = field(default_factory=list)  # rounds after which a killed run was resumed
    # Clients whose own state (SCAFFOLD's control variate, FD/DS-FL models) was older than their last accepted reply:
    # they lost it (a wiped state directory, --no-state and a restart); the run goes on, but is not the
    # uninterrupted run's any more. By client, the first time seen.
    state_lost: dict[ClientId, str] = field(default_factory=dict)
    stopped: str = ""  # why the run stopped before its last round (a DP run's privacy budget), "" when it did not


@dataclass
class _Played:
    """A round between its exchange and its record."""

    round: int
    started: float
    exchanged: float
    sampled: list[ClientId]
    exchange: Exchange
    quorum: int = 0
    aggregated: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    round_bytes: RoundBytes | None = None
    abandoned: str = ""  # why the strategy gave up on a round with a quorum (secure aggregation)


def sample_clients(available: list[ClientId], k: int, seed: int, rnd: int) -> list[ClientId]:
    """``k`` of the available clients, chosen by (seed, round) alone so every transport picks the same ones."""
    pool = sorted(available)
    if k >= len(pool):
        return pool
    rng = np.random.default_rng(derive_seed(seed, "sample", rnd))
    return sorted(rng.choice(pool, size=k, replace=False).tolist())


class RoundEngine:
    """Runs ``config.rounds`` rounds of ``strategy`` over ``transport``."""

    def __init__(
        self,
        config: RunConfig,
        strategy: Strategy,
        transport: Transport,
        test_x: torch.Tensor,
        test_y: torch.Tensor,
        *,
        initial_bytes: dict[str, int] | None = None,
    ) -> None:
        self.config = config
        self.strategy = strategy
        self.transport = transport
        self.test_x, self.test_y = test_x, test_y
        # One-time tensor-level cost per accounting model, e.g. distributing DS-FL's open set (ComU@I).
        self.initial_bytes = initial_bytes or {}
        self.history = RunHistory()

    def run(
        self,
        on_round: Callable[[RoundRecord], None] | None = None,
        *,
        overlap: bool = False,
        prepare: Callable[[int], Callable[[RoundRecord], None]] | None = None,
    ) -> RunHistory:
        """The rounds after those already in ``history`` (all of them, unless a resumed run restored some).

        ``prepare``: called in this thread right after a round's aggregation, before the next round starts; returns
        what commits the round (its metrics line, its journal) once its record, evaluation included, is made; then
        ``on_round`` gets the record. ``overlap``: evaluate (and commit, and call ``on_round``) on a second thread
        while the next round's clients train (see :class:`RoundPipeline`); the same records either way.
        """
        with RoundPipeline(self, overlap=overlap, prepare=prepare, on_round=on_round) as pipeline:
            for rnd in range(len(self.history.rounds) + 1, self.config.rounds + 1):
                self.history.stopped = self.strategy.stop_before(rnd)
                if self.history.stopped:
                    log.warning("%s", self.history.stopped)
                    break
                pipeline.round(rnd)
        return self.history

    def run_round(self, rnd: int) -> RoundRecord:
        """Round ``rnd`` from sampling to its record (evaluation included), in this thread."""
        return self._conclude(self._aggregate(self._exchange(rnd)))

    def _exchange(self, rnd: int) -> _Played:
        """Sample, plan and deliver round ``rnd``: what runs while the previous round's evaluation may still run."""
        cfg = self.config
        started = time.perf_counter()
        available = list(self.transport.available_clients())
        if cfg.differential_privacy:  # what DP-FedAvg's accountant assumes: each client with probability q
            sampled = poisson_sample(available, cfg.client_fraction, cfg.seed, rnd)
        else:
            sampled = sample_clients(available, cfg.clients_per_round, cfg.seed, rnd)
        plan = self.strategy.configure(rnd, sampled)
        if len(sampled) < cfg.clients_per_round and not (cfg.differential_privacy or cfg.secure_aggregation):
            # Fewer were available than the round samples: a client that comes back early in the round may still be
            # given its task (not under DP's Poisson sampling, nor secure aggregation's fixed cohort).
            plan = dataclasses.replace(plan, late_task=self._late_task(rnd), cohort=cfg.clients_per_round)
        exchange = self.transport.exchange(plan, lambda c, m: self.strategy.accept(rnd, c, m))
        if exchange.added:
            sampled = sorted([*sampled, *exchange.added])
        return _Played(rnd, started, time.perf_counter(), sampled, exchange)

    def _late_task(self, rnd: int) -> Callable[[ClientId], Message]:
        """Round ``rnd``'s task for a client that was not sampled: as the strategy plans it for any client."""

        def task(client: ClientId) -> Message:
            return self.strategy.configure(rnd, [client]).tasks[client]

        return task

    def _aggregate(self, played: _Played) -> _Played:
        """Account for the round's messages and aggregate; needs every earlier round's record (lost-state checks)."""
        rnd, exchange, sampled = played.round, played.exchange, played.sampled
        self.history.ledger.extend(exchange.entries)
        self._note_lost_state(rnd, exchange.replies)
        # DP-FedAvg divides by the expected cohort: any number of replies, none included, makes a valid round.
        # Otherwise the quorum's share of the sampled, and never fewer than the cohort floor (one client's model is
        # no aggregate).
        cfg = self.config
        share = math.ceil(cfg.min_replies * len(sampled))
        played.quorum = 0 if cfg.differential_privacy else max(1, share, cfg.cohort_floor)
        played.aggregated = len(exchange.replies) >= played.quorum
        if played.aggregated:
            played.metrics = self.strategy.aggregate(rnd, exchange.replies)
            self._note_protocol(played)
        else:
            log.warning(
                "round %d: %d of %d replies, below the quorum of %d: skipped",
                rnd,
                len(exchange.replies),
                len(sampled),
                played.quorum,
            )
        played.round_bytes = self.history.ledger.round_bytes(rnd)
        return played

    def _note_protocol(self, played: _Played) -> None:
        """What the strategy's aggregation did beyond the replies (secure aggregation's protocol): its messages go
        into the ledger, the clients it left out become drops, and a round it gave up on is skipped."""
        rnd, exchange = played.round, played.exchange
        extra = self.strategy.aggregation_record(rnd)
        self.history.ledger.extend(extra.entries)
        for drop in extra.drops:
            exchange.replies.pop(drop.client, None)  # replied, but not in the aggregate
            exchange.drops.append(drop)
        if extra.abandoned:
            played.aggregated, played.abandoned = False, extra.abandoned
            log.warning("round %d: %s: skipped, the global model stays as it was", rnd, extra.abandoned)

    def _conclude(self, played: _Played) -> RoundRecord:
        """Evaluate the aggregated state and record the round (on the evaluation thread when overlapped)."""
        cfg, rnd, exchange = self.config, played.round, played.exchange
        accuracy = per_class = forgotten = None
        if rnd % cfg.eval_every == 0 or rnd == cfg.rounds:
            evaluation = self.strategy.evaluate(self.test_x, self.test_y)
            if evaluation is not None:
                self.history.per_class_history.append(evaluation.per_class)
                accuracy = evaluation.accuracy
                per_class = tuple(None if np.isnan(v) else float(v) for v in evaluation.per_class)
                forgotten = forgetting(self.history.per_class_history)
        previous = self.history.rounds[-1].bytes if self.history.rounds else None
        assert played.round_bytes is not None, "a round is aggregated before it is concluded"
        record = RoundRecord(
            round=rnd,
            sampled=tuple(played.sampled),
            replied=tuple(sorted(exchange.replies)),
            aggregated=played.aggregated,
            quorum=played.quorum,
            bytes=ByteCounts.of(played.round_bytes, previous, self.initial_bytes),
            drops=tuple(exchange.drops),
            rejections=tuple(exchange.rejections),
            metrics=played.metrics,
            accuracy=accuracy,
            per_class_accuracy=per_class,
            forgetting=forgotten,
            timings=tuple(exchange.timings),
            wall_s=time.perf_counter() - played.started,
            exchange_s=played.exchanged - played.started,
            abandoned=played.abandoned,
        )
        self.history.rounds.append(record)
        return record

    def _note_lost_state(self, rnd: int, replies: Mapping[ClientId, CheckedReply]) -> None:
        """Compare the round each stateful client says its state came from with its last accepted reply."""
        for client, reply in replies.items():
            said = reply.update.transport.get(STATE_ROUND)
            if said is None or not said.isdigit() or len(said) > 9 or client in self.history.state_lost:
                continue
            last = max((r.round for r in self.history.rounds if client in r.replied), default=0)
            if int(said) < last:
                why = (
                    f"round {rnd}: its local state came from round {said}, but it last answered round {last}: "
                    "it lost its state (its state directory wiped, or --no-state and a restart)"
                )
                self.history.state_lost[client] = why
                log.warning("client %s %s", client, why)


class RoundPipeline:
    """Runs a :class:`RoundEngine`'s rounds one at a time: exchange, aggregation, then the round's conclusion (its
    evaluation, record, commit and ``on_round``). With ``overlap``, the conclusion runs on a second thread while the
    next round's clients train, so the server's evaluation no longer keeps the clients waiting.

    Why the records stay the same: the next round's sampling, plan and client steps do not read what a conclusion
    writes (the strategy's scratch evaluation model, the per-class history, the records), and this thread waits for
    the previous conclusion before it aggregates, the first step that changes what an evaluation reads. A round's
    evaluation thus overlaps only the next round's exchange; conclusions run in round order, one at a time, with the
    torch thread count this thread had (float sums depend on it). ``prepare`` (the journal's snapshot of the state a
    round committed) runs here, before the next round can change that state.

    A failure in a conclusion (or in ``on_round``) is raised here, at the next round's aggregation or at the end. An
    exception here (Ctrl-C during a round) first lets the conclusion in flight finish: its round is complete, and its
    commit must not race the clean-up of the run directory.
    """

    def __init__(
        self,
        engine: RoundEngine,
        *,
        overlap: bool = False,
        prepare: Callable[[int], Callable[[RoundRecord], None]] | None = None,
        on_round: Callable[[RoundRecord], None] | None = None,
    ) -> None:
        self.engine, self.prepare, self.on_round = engine, prepare, on_round
        self._threads = torch.get_num_threads()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fedge-conclude") if overlap else None
        self._pending: concurrent.futures.Future[RoundRecord] | None = None

    @property
    def overlap(self) -> bool:
        return self._pool is not None

    def round(self, rnd: int) -> None:
        """Play round ``rnd``; overlapped, its conclusion may still run when this returns (see :meth:`wait`)."""
        engine = self.engine
        played = engine._exchange(rnd)  # meanwhile, the previous round's conclusion
        self.wait()
        engine._aggregate(played)
        commit = self.prepare(rnd) if self.prepare is not None else None
        if self._pool is None:
            self._conclude(played, commit)
        else:
            self._pending = self._pool.submit(self._conclude, played, commit)

    def wait(self) -> RoundRecord | None:
        """Until the conclusion in flight is done: its record (None when there is none); raises what failed in it."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def _conclude(self, played: _Played, commit: Callable[[RoundRecord], None] | None) -> RoundRecord:
        if torch.get_num_threads() != self._threads:  # a thread's own count: this thread's only
            torch.set_num_threads(self._threads)
        record = self.engine._conclude(played)
        if commit is not None:
            commit(record)
        if self.on_round is not None:
            self.on_round(record)
        return record

    def __enter__(self) -> RoundPipeline:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc is None:
                self.wait()
            elif self._pending is not None:
                pending, self._pending = self._pending, None
                concurrent.futures.wait([pending])
                if not pending.cancelled() and pending.exception() is not None:
                    log.warning("the round concluding when the run stopped failed too: %s", pending.exception())
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
