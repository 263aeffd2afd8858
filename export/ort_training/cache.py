"""Artifacts made, checked and cached for a client before it says hello (an ``ArtifactSource``)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from edge_client.backends.cache_dir import default_cache_dir
from edge_client.backends.ort_training import artifact_dir_name, has_artifacts
from export.cache import checked_once
from export.ort_training.artifacts import generate
from export.ort_training.check import check_artifacts
from fedge.errors import ConfigError
from fedge.programs.spec import ModelSpec, TrainingLoss

log = logging.getLogger(__name__)


def _digest(directory: Path) -> bytes:
    """What identifies a set of artifacts for :func:`export.cache.checked_once`."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(directory)):
        if (directory / name).is_file():
            h.update(name.encode() + b"\0" + (directory / name).read_bytes())
    return h.digest()


class ArtifactCache:
    """An :data:`edge_client.backends.ort_training.ArtifactSource` that makes (and checks) what the cache lacks.

    A missing set is generated into a temporary directory beside its final place, parity-checked
    (:func:`check_artifacts`, raising :class:`ExportError` on failure) and renamed into place, so a client never
    loads a half-written or unchecked set and client processes can share the cache. A present set is checked again
    once per process: a cache directory is a place where stale or foreign files appear.
    """

    def __init__(self, cache_dir: Path | None = None, *, verify: bool = True) -> None:
        self.cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
        self.verify = verify

    def _check(self, directory: Path, name: str) -> None:
        from export.gates.report import require

        def check(_: bytes, source: str) -> None:
            for report in require(check_artifacts(directory, source=source)):
                log.info("%s", report)

        checked_once(_digest(directory), name, check if self.verify else None)

    def __call__(self, spec: ModelSpec, loss: TrainingLoss) -> Path:
        final = self.cache_dir / artifact_dir_name(spec, loss)
        try:
            if has_artifacts(final):
                self._check(final, str(final))
                log.debug("using cached ONNX Runtime training artifacts %s", final)
                return final
            log.info("making ONNX Runtime training artifacts %s (cached for later runs)", final.name)
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", suffix=".tmp", dir=self.cache_dir))
            try:
                generate(spec, loss, tmp)
                self._check(tmp, final.name)
                try:
                    os.rename(tmp, final)  # atomic; fails if another process got there first
                except OSError:
                    if not has_artifacts(final):
                        raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            return final
        except OSError as exc:
            raise ConfigError(f"cannot use the program cache {self.cache_dir}: {exc}") from exc
