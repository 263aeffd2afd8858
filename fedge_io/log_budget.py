"""A bound on the log lines one peer can cause: a client that floods its update topic with refused messages must
not grow the coordinator's log without limit. Every message still goes in the ledger; only the lines are capped."""

from __future__ import annotations

import logging
from collections import Counter

PER_PEER = 5
"""Log lines one peer may cause per round before the rest are only counted."""


class LogBudget:
    """Counts the lines logged for each peer; :meth:`warn` logs while the peer is within its budget, then once that
    further lines are held back."""

    def __init__(self, logger: logging.Logger, per_peer: int = PER_PEER) -> None:
        if per_peer < 1:
            raise ValueError(f"per_peer must be >= 1, got {per_peer}")
        self.logger = logger
        self.per_peer = per_peer
        self.held_back: Counter[str] = Counter()  # peer -> lines not logged
        self._logged: Counter[str] = Counter()

    def warn(self, peer: str, message: str, *args: object) -> None:
        """``logger.warning(message, *args)`` while ``peer`` has budget left; the line after the last says so."""
        used = self._logged[peer]
        if used < self.per_peer:
            self._logged[peer] += 1
            self.logger.warning(message, *args)
            if used + 1 == self.per_peer:
                self.logger.warning(
                    "%s: %d messages logged; further ones this round are counted in the ledger, not logged",
                    peer,
                    self.per_peer,
                )
            return
        self.held_back[peer] += 1
