"""Child processes that a test stops with Ctrl-C (SIGINT), as a user on a terminal would.

A process started in the background by a non-interactive shell (``cmd &``, ``nohup``: how CI or a long local run
may start pytest) inherits SIGINT *ignored*, and so would every process the test starts: its Ctrl-C would do
nothing. Pass :func:`default_sigint` as ``preexec_fn`` so the child gets SIGINT's default action back.
"""

from __future__ import annotations

import signal


def default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
