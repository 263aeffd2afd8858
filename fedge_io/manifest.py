"""Export manifests: the SHA-256 and size of every file an export wrote, checked before any byte reaches a runtime.

A flipped byte in a ``.pte`` can abort or crash the ExecuTorch runtime that loads it (the loader's consistency check
does not cover the data it points into), and damaged ``.onnx`` weights load and serve wrong logits without a word.
So every directory of exports carries ``manifest.json``::

    {"format": "fedge-export-manifest/1", "fedge_version": "0.1.0",
     "files": {"fedavg_cnn.onnx": {"sha256": "9f2c...", "bytes": 1783210, "kind": "onnx"}, ...}}

and whoever reads an exported file (a client, the program cache, ``fedge export check``) reads it through
:func:`verified_read`, which hashes the bytes it read and compares them with the manifest *before* handing them on:
a mismatch or a file the manifest does not list is one line naming the file and the fix.

Writers update the manifest under an exclusive lock on the directory and replace it atomically, so client
processes sharing one program cache never lose each other's entries or read half a manifest. The manifest is as
trustworthy as the directory it lives in: it detects damage and stale files, not an attacker who can rewrite both.
Against that, ``fedge export --sign-key`` signs the manifest with the fleet kit's CA (``manifest.json.sig``, see
:mod:`fedge_io.signing`), and a reader given the CA certificate (``trust``) accepts only a manifest with a good
signature. Any change to a manifest removes its signature: a signature covers the manifest it was made for, no other.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from fedge import __version__
from fedge.errors import ConfigError

if TYPE_CHECKING:
    from cryptography.x509 import Certificate

    from fedge_io.signing import SigningKey

MANIFEST_FILE = "manifest.json"
SIGNATURE_FILE = MANIFEST_FILE + ".sig"
FORMAT = "fedge-export-manifest/1"
MAX_MANIFEST_BYTES = 1 << 20  # a few hundred entries; a larger file is not one of ours
_SHA256 = re.compile(r"[0-9a-f]{64}")
_KIND = re.compile(r"[a-z0-9-]{1,32}")


class ManifestError(ConfigError):
    """An exported file that does not match its manifest, or a manifest that cannot be read."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def entry(data_or_path: bytes | Path, kind: str) -> dict[str, object]:
    """The manifest entry of a file's bytes (or of the file at a path)."""
    if isinstance(data_or_path, Path):
        return {"sha256": sha256_file(data_or_path), "bytes": data_or_path.stat().st_size, "kind": kind}
    return {"sha256": sha256_bytes(data_or_path), "bytes": len(data_or_path), "kind": kind}


def read_manifest(directory: Path, trust: Certificate | None = None) -> dict[str, dict[str, object]] | None:
    """The entries of ``directory/manifest.json`` by file name; None when there is none. Validated: names are plain
    file names, digests 64 hex digits, sizes non-negative integers.

    ``trust``: a CA certificate whose signature the manifest must carry (``manifest.json.sig``): an unsigned, edited or
    foreign-signed manifest is refused, and so is a missing one (a program must then come with a signed manifest).
    """
    path = directory / MANIFEST_FILE
    raw = _read_bounded(path, MAX_MANIFEST_BYTES, "a fedge manifest")
    if trust is not None:
        _check_signature(directory, raw, trust)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path} is not valid JSON ({exc}); re-export into a fresh directory") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("files"), dict):
        raise ManifestError(f"{path} is not a {FORMAT} manifest; re-export into a fresh directory")
    files: dict[str, dict[str, object]] = {}
    for name, e in doc["files"].items():
        ok = (
            isinstance(name, str)
            and name == Path(name).name
            and name not in ("", ".", "..", MANIFEST_FILE, SIGNATURE_FILE)
            and isinstance(e, dict)
            and isinstance(e.get("sha256"), str)
            and _SHA256.fullmatch(e["sha256"]) is not None
            and type(e.get("bytes")) is int
            and e["bytes"] >= 0
            and isinstance(e.get("kind"), str)
            and _KIND.fullmatch(e["kind"]) is not None
        )
        if not ok:
            raise ManifestError(f"{path}: malformed entry {str(name)[:80]!r}; re-export into a fresh directory")
        files[name] = e
    return files


def _read_bounded(path: Path, limit: int, what: str) -> bytes | None:
    """At most ``limit`` bytes of ``path`` (None if absent); a larger file is refused, never read whole."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(limit + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ManifestError(f"cannot read {path}: {exc}") from exc
    if len(raw) > limit:
        raise ManifestError(f"{path} is larger than {limit} bytes: not {what}")
    return raw


def _check_signature(directory: Path, raw: bytes | None, trust: Certificate) -> None:
    """Raise ManifestError unless ``raw`` (the bytes of ``directory``'s manifest) carries ``trust``'s signature.

    Checked on the very bytes that are then parsed, so a manifest swapped in between cannot slip through."""
    from fedge_io.signing import MAX_SIGNATURE_BYTES, signed_by

    path = directory / MANIFEST_FILE
    issuer = trust.subject.rfc4514_string()[:120]
    if raw is None:
        raise ManifestError(
            f"{path}: missing, and this device accepts only programs whose manifest is signed by {issuer}; copy the "
            "whole signed export directory (`fedge export --sign-key`)"
        )
    sig = _read_bounded(directory / SIGNATURE_FILE, MAX_SIGNATURE_BYTES, "a manifest signature")
    if sig is None:
        raise ManifestError(
            f"{path} is not signed ({SIGNATURE_FILE} missing) and this device accepts only programs signed by "
            f"{issuer}; sign the export with `fedge export --sign-key`"
        )
    if not signed_by(trust, raw, sig):
        raise ManifestError(
            f"{path}: the signature in {SIGNATURE_FILE} is not {issuer}'s over this manifest (edited after signing, "
            "or signed by another CA); re-export and sign with that fleet's CA"
        )


def sign(directory: Path, key: SigningKey) -> Path:
    """Sign ``directory``'s manifest as it is now with ``key`` (under the lock); the signature file's path."""
    from fedge_io.signing import sign as sign_bytes

    path = directory / MANIFEST_FILE
    with _locked(directory):
        raw = _read_bounded(path, MAX_MANIFEST_BYTES, "a fedge manifest")
        if raw is None:
            raise ManifestError(f"{path} does not exist: nothing to sign")
        read_manifest(directory)  # sign only a well-formed manifest
        _replace(directory, SIGNATURE_FILE, sign_bytes(key, raw))
    return directory / SIGNATURE_FILE


def _replace(directory: Path, name: str, data: bytes) -> None:
    """Write ``directory/name`` through a temporary file and an atomic rename."""
    fd, tmp = tempfile.mkstemp(prefix=name + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, directory / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive lock on the directory itself (flock on its descriptor): no lock file left behind."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _write(directory: Path, files: Mapping[str, Mapping[str, object]]) -> None:
    doc = {"format": FORMAT, "fedge_version": __version__, "files": dict(sorted(files.items()))}
    # The old signature covers the old manifest only: dropped first, so it never stands beside another manifest.
    (directory / SIGNATURE_FILE).unlink(missing_ok=True)
    _replace(directory, MANIFEST_FILE, (json.dumps(doc, indent=1) + "\n").encode())


def record(directory: Path, entries: Mapping[str, Mapping[str, object]]) -> None:
    """Add (or replace) ``entries`` in ``directory``'s manifest, under the directory's lock."""
    with _locked(directory):
        files = read_manifest(directory) or {}
        files.update({name: dict(e) for name, e in entries.items()})
        _write(directory, files)


def write_file(directory: Path, name: str, data: bytes, kind: str) -> Path:
    """Write ``data`` as ``directory/name`` (atomically) and record it in the manifest, under the lock: a reader
    never sees a file whose entry is missing or stale."""
    path = directory / name
    with _locked(directory):
        _replace(directory, name, data)
        files = read_manifest(directory) or {}
        files[name] = entry(data, kind)
        _write(directory, files)
    return path


def verify_bytes(data: bytes, path: Path, files: Mapping[str, Mapping[str, object]] | None) -> None:
    """Raise ManifestError unless ``data`` (read from ``path``) is what the manifest ``files`` lists for it."""
    where = path.parent / MANIFEST_FILE
    if files is None:
        raise ManifestError(
            f"{path}: no {MANIFEST_FILE} beside it, so its bytes cannot be verified; export it with `fedge export` "
            "(which writes one), or start the client with --unverified-programs to load it anyway"
        )
    e = files.get(path.name)
    if e is None:
        raise ManifestError(f"{path}: not listed in {where}; it was not written by that export (re-export it)")
    if len(data) != e["bytes"] or sha256_bytes(data) != e["sha256"]:
        raise ManifestError(
            f"{path}: SHA-256 does not match {where} ({len(data)} bytes, expected {e['bytes']}): the file was "
            "altered or damaged after export; re-export it or copy it again"
        )


def verified_read(path: Path, *, required: bool = True, trust: Certificate | None = None) -> bytes:
    """The bytes of ``path``, checked against the manifest beside it before they are returned.

    ``required=False`` accepts a file with no manifest beside it (a listed file must still match). ``trust``: the
    manifest must also be signed by that CA (then a manifest is required whatever ``required`` says).
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    files = read_manifest(path.parent, trust)
    if files is None and not required:
        return data
    verify_bytes(data, path, files)
    return data


def verify_files(directory: Path, names: list[str], *, required: bool = True, trust: Certificate | None = None) -> None:
    """Check files that a runtime opens by path (ONNX Runtime training artifacts) against the manifest (signed by
    ``trust`` when given)."""
    files = read_manifest(directory, trust)
    if files is None and not required:
        return
    for name in names:
        path = directory / name
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from exc
        verify_bytes(data, path, files)
