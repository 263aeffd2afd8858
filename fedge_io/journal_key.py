"""The key that signs run journals (HMAC-SHA256), kept outside every run directory.

A journal's SHA-256 digests catch damage, but someone who can write the run directory can alter a weight and
recompute its digest. journal.json therefore carries an HMAC of everything it records (the digests of the tensor file
and of every client's store file included) under a key that is not in the run directory: by default a per-user file,
``$XDG_CONFIG_HOME/fedge/journal.key`` (``~/.config/fedge/journal.key``), made on first use with 32 random bytes and
mode 0600; ``FEDGE_JOURNAL_KEY_FILE`` names another (e.g. a fleet coordinator's, beside its bundle, on a disk the run
directory's writers cannot read). A run resumes only with the key it was written with.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from fedge.errors import JournalError

KEY_ENV = "FEDGE_JOURNAL_KEY_FILE"
KEY_BYTES = 32


def journal_key_path() -> Path:
    """Where the journal key is: ``$FEDGE_JOURNAL_KEY_FILE``, else the per-user default."""
    named = os.environ.get(KEY_ENV)
    if named:
        return Path(named).expanduser()
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config_home) / "fedge" / "journal.key"


def journal_key(run_dir: Path) -> bytes:
    """The journal key, made if it does not exist yet; JournalError if it is inside ``run_dir`` or unreadable."""
    path = journal_key_path()
    if path.resolve().is_relative_to(run_dir.resolve()):
        raise JournalError(f"the journal key {path} is inside the run directory it protects; keep it elsewhere")
    if not path.exists():
        _create(path)
    try:
        key = path.read_bytes()
    except OSError as exc:
        raise JournalError(f"cannot read the journal key {path}: {exc}") from None
    if len(key) != KEY_BYTES:
        raise JournalError(
            f"the journal key {path} is {len(key)} bytes, not {KEY_BYTES}: restore it or point {KEY_ENV} at it"
        )
    return key


def sign(key: bytes, payload: bytes) -> str:
    """HMAC-SHA256 of ``payload`` under ``key``, hex."""
    return hmac.new(key, payload, hashlib.sha256).hexdigest()


def verify(key: bytes, payload: bytes, tag: object) -> bool:
    """Whether ``tag`` is ``payload``'s HMAC under ``key`` (constant-time)."""
    return isinstance(tag, str) and hmac.compare_digest(sign(key, payload), tag)


def _create(path: Path) -> None:
    """Write a new key atomically: several processes may start at once (test workers, a fleet's services), and all
    must end up with the one key that won, never each its own."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_bytes(KEY_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if another process made the key first: then that key is the one
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
