"""The fleet view's memory: every completed round's outcome and a row per client, from the run's own records.

What ``fedge status`` shows beyond the round under way (:mod:`coordinator.status_board` publishes it): the rounds
(aggregated or skipped, replies, drops, accuracy, bytes, time, a DP run's epsilon) and, per client, what it is (runtime,
device, samples) and what it did (rounds sampled, replied, dropped and the latest reason, when it was last heard of,
its latest step time, the wire bytes of its messages). All of it comes from the records the run keeps anyway
(:class:`~fedge.accounting.records.RoundRecord`, the byte ledger, the clients' hellos); nothing is measured twice.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from coordinator.presence import Presence
from fedge.accounting.ledger import BROADCAST_CLIENT, LedgerEntry
from fedge.accounting.records import RoundRecord
from fedge.config import RunConfig
from fedge.types import ClientId
from fedge.wire.fields import printable
from fedge.wire.protocol import ClientStatus
from fedge.wire.run_status import MAX_HISTORY, MAX_LISTED, ClientRow, RoundOutcome

MAX_VALUE = 1e9
"""The largest step time or epsilon a run status carries (fedge.wire.run_status refuses a larger one)."""


def outcome(r: RoundRecord, ended: float = 0.0) -> RoundOutcome:
    """One round's line of the view. ``ended``: when it was recorded (0: unknown, a resumed run's earlier round)."""
    epsilon = r.metrics.get("dp_epsilon")
    return RoundOutcome(
        round=r.round,
        aggregated=r.aggregated,
        sampled=len(r.sampled),
        replied=len(r.replied),
        dropped=len(r.drops),
        accuracy=r.accuracy if r.accuracy is not None else -1.0,
        wire_bytes=r.bytes.wire,
        wall_s=round(max(r.wall_s, 0.0), 3),
        ended=round(ended, 3),
        epsilon=min(float(epsilon), MAX_VALUE) if epsilon is not None and math.isfinite(epsilon) else -1.0,
    )


def client_rows(
    rounds: Sequence[RoundRecord],
    entries: Iterable[LedgerEntry],
    clients: Mapping[ClientId, ClientStatus],
    admitted: Mapping[ClientId, ClientStatus],
    seen_at: Mapping[ClientId, float],
) -> tuple[ClientRow, ...]:
    """A row per client that said hello or took part in a round (at most MAX_LISTED, by id)."""
    sampled, replied, dropped = Counter[str](), Counter[str](), Counter[str]()
    last_drop: dict[str, str] = {}
    step: dict[str, float] = {}
    for r in rounds:
        sampled.update(r.sampled)
        replied.update(r.replied)
        for d in r.drops:
            dropped[d.client] += 1
            last_drop[d.client] = d.reason
        for t in r.timings:
            if t.client in r.replied and math.isfinite(t.compute_s):
                step[t.client] = min(t.compute_s, MAX_VALUE)  # the client's word: capped, as monitors refuse more
    wire: defaultdict[str, int] = defaultdict(int)
    for e in entries:
        if e.client != BROADCAST_CLIENT:
            wire[e.client] += e.wire_bytes
    ids = sorted(set(clients) | set(sampled))[:MAX_LISTED]
    rows = []
    for c in ids:
        hello = admitted.get(c) or clients.get(c)
        rows.append(
            ClientRow(
                client=c,
                runtime=printable(hello.runtime, 40) if hello else "",
                device=printable(hello.device, 40) if hello else "",
                samples=hello.dataset_size if hello else 0,
                sampled=sampled[c],
                replied=replied[c],
                dropped=dropped[c],
                last_drop=printable(last_drop.get(c, ""), 200),
                last_seen=round(seen_at.get(c, 0.0), 3),
                step_s=round(step[c], 3) if c in step else -1.0,
                wire_bytes=wire[c],
            )
        )
    return tuple(rows)


def history(rounds: Sequence[RoundRecord], ended: Mapping[int, float]) -> tuple[RoundOutcome, ...]:
    """The latest MAX_HISTORY rounds' outcomes, oldest first."""
    return tuple(outcome(r, ended.get(r.round, 0.0)) for r in rounds[-MAX_HISTORY:])


class FleetMemory:
    """What the view adds to the records: when each round was recorded and when each client last replied."""

    def __init__(self) -> None:
        self.ended: dict[int, float] = {}
        self.replied_at: dict[ClientId, float] = {}

    def round_done(self, r: RoundRecord, now: float) -> None:
        self.ended[r.round] = now
        self.replied_at.update(dict.fromkeys(r.replied, now))

    def fields(
        self, rounds: Sequence[RoundRecord], entries: Iterable[LedgerEntry], presence: Presence
    ) -> dict[str, Any]:
        """The run-status fields of the view: ``history``, ``clients`` and ``epsilon``."""
        seen = dict(presence.seen_at)
        for c, at in self.replied_at.items():
            seen[c] = max(seen.get(c, 0.0), at)
        spent = [o.epsilon for o in map(outcome, rounds[-1:]) if o.epsilon >= 0]
        return {
            "history": history(rounds, self.ended),
            "clients": client_rows(rounds, entries, presence.clients, presence.admitted, seen),
            "epsilon": spent[0] if spent else -1.0,
        }


def about(config: RunConfig, model: str) -> str:
    """The run in one line: algorithm, dataset, model and the settings an operator asks about first."""
    text = (
        f"{config.algorithm} on {config.dataset}, model {model}, {config.num_clients} clients, "
        f"{config.clients_per_round} a round, {config.rounds} rounds, {config.train.local_epochs} local epoch(s), "
        f"quorum {config.min_replies:g} of the sampled and at least {config.cohort_floor}"
    )
    if config.differential_privacy:
        text += f", DP-FedAvg noise multiplier {config.dp_noise_multiplier:g}"
    return text
