"""SIGTERM to a coordinator in the middle of a round: finish that round, then leave.

systemd, ``docker stop`` and ``kill`` send SIGTERM to stop a service. A round under way is seconds to minutes of the
clients' work: a stop that throws it away costs a round at every restart. So a first SIGTERM during a round lets the
round finish and commit to the journal, says so at INFO ("finishing round 3, then leaving"), and then stops the run as
Ctrl-C does (status 143, the resume command printed). Outside a round (waiting for clients, between rounds), or at a
second SIGTERM, the run stops at once, as before. A unit's stop timeout must leave time for a round: the coordinator
unit has ``TimeoutStopSec`` above its round timeout (:mod:`coordinator.kit.services`).

The handler runs in the main thread wherever it happens to be, so it does no logging itself (a log write interrupted
by another is a reentrant call); a watcher thread writes the line.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

from fedge_io.signals import Terminated

log = logging.getLogger(__name__)


class GracefulStop:
    """Turns SIGTERM during a round into "finish this round, then leave"; see the module's docstring."""

    def __init__(self) -> None:
        self.round_under_way: Callable[[], int] = lambda: 0  # the round being played now, 0 when none (set by the run)
        self.finishing = 0  # the round a SIGTERM asked to finish; 0: no stop asked
        self._asked = threading.Event()
        self._closed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        rnd = self.round_under_way()
        if rnd <= 0 or self.finishing:  # nothing to finish, or asked twice: leave now
            raise Terminated()
        self.finishing = rnd
        self._asked.set()  # only the watcher waits on it: no lock the main thread could hold

    def _watch(self) -> None:
        self._asked.wait()
        if not self._closed:
            log.info(
                "SIGTERM: finishing round %d, then leaving (its result goes into the journal; the same command "
                "continues the run after it; SIGTERM again or Ctrl-C leaves at once)",
                self.finishing,
            )

    def check(self) -> None:
        """After a round's commit: raise Terminated when a SIGTERM asked to stop."""
        if self.finishing:
            raise Terminated(f"after finishing round {self.finishing}")

    @contextlib.contextmanager
    def installed(self) -> Iterator[GracefulStop]:
        """This object handles SIGTERM while the block runs (in the main thread only; elsewhere nothing changes)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        watcher = threading.Thread(target=self._watch, name="fedge-sigterm", daemon=True)
        watcher.start()
        previous = signal.signal(signal.SIGTERM, self._handle)
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous)
            if not self._asked.is_set():
                self._closed = True
                self._asked.set()
            watcher.join(timeout=2.0)
