"""The round loop, written once for every algorithm and transport.

Per round: sample clients, let the strategy plan the round, let the transport deliver it and collect the replies,
aggregate when a quorum replied (otherwise the round is skipped: the global state stays as it was and the run goes
on), evaluate, and record a :class:`fedge.accounting.records.RoundRecord`. Same config and seeds give the same result
over any transport.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from coordinator.transport import Transport
from fedge.accounting.ledger import ByteLedger
from fedge.accounting.records import ByteCounts, RoundRecord
from fedge.algorithms.base import Strategy, derive_seed
from fedge.config import RunConfig
from fedge.learning.metrics import forgetting
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

    def run(self, on_round: Callable[[RoundRecord], None] | None = None) -> RunHistory:
        """The rounds after those already in ``history`` (all of them, unless a resumed run restored some)."""
        for rnd in range(len(self.history.rounds) + 1, self.config.rounds + 1):
            record = self.run_round(rnd)
            if on_round is not None:
                on_round(record)
        return self.history

    def run_round(self, rnd: int) -> RoundRecord:
        cfg = self.config
        started = time.perf_counter()
        available = list(self.transport.available_clients())
        sampled = sample_clients(available, cfg.clients_per_round, cfg.seed, rnd)
        plan = self.strategy.configure(rnd, sampled)
        exchange = self.transport.exchange(plan, lambda c, m: self.strategy.accept(rnd, c, m))
        comm_done = time.perf_counter()
        self.history.ledger.extend(exchange.entries)
        self._note_lost_state(rnd, exchange.replies)

        quorum = max(1, math.ceil(cfg.min_replies * len(sampled)))
        aggregated = len(exchange.replies) >= quorum
        metrics: dict[str, float] = {}
        if aggregated:
            metrics = self.strategy.aggregate(rnd, exchange.replies)
        else:
            log.warning(
                "round %d: %d of %d replies, below the quorum of %d: skipped",
                rnd,
                len(exchange.replies),
                len(sampled),
                quorum,
            )
        accuracy = per_class = forgotten = None
        if rnd % cfg.eval_every == 0 or rnd == cfg.rounds:
            evaluation = self.strategy.evaluate(self.test_x, self.test_y)
            if evaluation is not None:
                self.history.per_class_history.append(evaluation.per_class)
                accuracy = evaluation.accuracy
                per_class = tuple(None if np.isnan(v) else float(v) for v in evaluation.per_class)
                forgotten = forgetting(self.history.per_class_history)
        previous = self.history.rounds[-1].bytes if self.history.rounds else None
        record = RoundRecord(
            round=rnd,
            sampled=tuple(sampled),
            replied=tuple(sorted(exchange.replies)),
            aggregated=aggregated,
            quorum=quorum,
            bytes=ByteCounts.of(self.history.ledger.round_bytes(rnd), previous, self.initial_bytes),
            drops=tuple(exchange.drops),
            rejections=tuple(exchange.rejections),
            metrics=metrics,
            accuracy=accuracy,
            per_class_accuracy=per_class,
            forgetting=forgotten,
            timings=tuple(exchange.timings),
            wall_s=time.perf_counter() - started,
            exchange_s=comm_done - started,
        )
        self.history.rounds.append(record)
        return record

    def _note_lost_state(self, rnd: int, replies: Mapping[ClientId, Message]) -> None:
        """Compare the round each stateful client says its state came from with its last accepted reply."""
        for client, msg in replies.items():
            said = msg.transport.get(STATE_ROUND)
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
