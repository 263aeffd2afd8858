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

from fedge import __version__
from fedge.errors import ConfigError

MANIFEST_FILE = "manifest.json"
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


def read_manifest(directory: Path) -> dict[str, dict[str, object]] | None:
    """The entries of ``directory/manifest.json`` by file name; None when there is none. Validated: names are plain
    file names, digests 64 hex digits, sizes non-negative integers."""
    path = directory / MANIFEST_FILE
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ManifestError(f"cannot read {path}: {exc}") from exc
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes: not a fedge manifest")
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
            and name not in ("", ".", "..", MANIFEST_FILE)
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
    fd, tmp = tempfile.mkstemp(prefix=MANIFEST_FILE + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh, indent=1)
            fh.write("\n")
        os.replace(tmp, directory / MANIFEST_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
        fd, tmp = tempfile.mkstemp(prefix=name + ".", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
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


def verified_read(path: Path, *, required: bool = True) -> bytes:
    """The bytes of ``path``, checked against the manifest beside it before they are returned.

    ``required=False`` accepts a file with no manifest beside it (a listed file must still match).
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    files = read_manifest(path.parent)
    if files is None and not required:
        return data
    verify_bytes(data, path, files)
    return data


def verify_files(directory: Path, names: list[str], *, required: bool = True) -> None:
    """Check files that a runtime opens by path (ONNX Runtime training artifacts) against the manifest."""
    files = read_manifest(directory)
    if files is None and not required:
        return
    for name in names:
        path = directory / name
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from exc
        verify_bytes(data, path, files)
