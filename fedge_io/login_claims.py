"""Which of a monitor bundle's interchangeable logins a viewer takes: one that no other viewer on this machine holds.

A fleet broker binds a connection to its user name (mosquitto's ``use_username_as_clientid``), so two viewers on one
name push each other off. Viewers on one machine (an operator's web page and terminal) each hold an advisory lock
(``flock``) on a file per name, in a directory all users share; a name whose lock is held is skipped, so they never
meet. A lock dies with its process: a killed viewer holds nothing. Viewers on other machines cannot see these locks:
among them the choice stays random, and the one pushed off takes another name at its next try
(:class:`fedge_io.mqtt.MqttLink`). Where the directory cannot be used, the choice is random, as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import secrets
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

CLAIMS_DIR = "fedge-logins"


def claims_dir() -> Path:
    """The shared directory of the locks: ``$TMPDIR/fedge-logins`` (sticky and world-writable, as /tmp)."""
    return Path(tempfile.gettempdir()) / CLAIMS_DIR


class LoginClaim:
    """The login one connection holds among interchangeable names of one broker (``scope``: its host and port)."""

    def __init__(self, scope: str, directory: Path | None = None) -> None:
        self._scope = scope
        self._dir = directory if directory is not None else claims_dir()
        self._fd: int | None = None
        self.name: str | None = None

    def take(self, names: Sequence[str], avoid: str | None = None) -> str:
        """A name of ``names`` (not ``avoid`` when there is another) that no viewer on this machine holds, now held
        by this one; when every name is held here (more viewers than names) or the locks cannot be used, a random
        one."""
        order = secrets.SystemRandom().sample(list(names), len(names))
        order = [n for n in order if n != avoid] or order
        chosen, held = order[0], None
        for name in order:
            fd = self._open(name)
            if fd is None:
                break  # no locks here: stay with the random choice
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held by another viewer (or by this one's previous connection)
                os.close(fd)
                continue
            chosen, held = name, fd
            break
        self.release()
        self._fd, self.name = held, chosen
        return chosen

    def release(self) -> None:
        """Let another viewer take the name (also done by the process's exit)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _open(self, name: str) -> int | None:
        digest = hashlib.sha256(f"{self._scope}\0{name}".encode()).hexdigest()[:32]
        path = self._dir / f"{digest}.lock"
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(path, flags)  # another user's file, too (it is 0644)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.debug("login lock %s: %s; choosing at random", path, exc)
            return None
        try:
            self._make_dir()
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:  # another viewer made it just now
            with contextlib.suppress(OSError):
                return os.open(path, flags)
            return None
        except OSError as exc:
            log.debug("login lock %s: %s; choosing at random", path, exc)
            return None
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o644)  # whatever the umask: other users' viewers must open it to lock it
        return fd

    def _make_dir(self) -> None:
        try:
            self._dir.mkdir(mode=0o700)
        except FileExistsError:
            return
        os.chmod(self._dir, 0o1777)  # every user's viewers, none deleting another's file (as /tmp)
