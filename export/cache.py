"""A directory of exported programs shared by client processes: export once, check, then reuse.

What a workstation or laptop client uses (the CLI hands it to the edge client's runtimes): a missing program is
exported, parity-checked and written under the one naming scheme of :func:`fedge.programs.program_file_name` (the
names ``fedge export`` writes too); a present one is checked again once per process, since a cache directory is a
place where stale or foreign files appear. A program is written only after it passed its check, through a temporary
file and an atomic rename, so a client never reads a half-written or unchecked file, and several client processes on
one machine can share a cache.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from edge_client.backends.cache_dir import default_cache_dir
from fedge.errors import ConfigError
from fedge.programs import FORMAT_VERSION, ModelSpec, TrainingLoss, program_file_name

log = logging.getLogger(__name__)


def toolchain_tag(runtime: str) -> str:
    """Versions that change what an export contains, for cache file names."""
    import torch

    if runtime == "executorch":
        from importlib.metadata import version

        return f"torch{torch.__version__.split('+')[0]}-et{version('executorch')}"
    import onnx

    return f"torch{torch.__version__.split('+')[0]}-onnx{onnx.__version__}"


_checked: set[str] = set()  # digests of the programs that passed their check in this process


def checked_once(data: bytes, source: str, check: Callable[[bytes, str], None] | None) -> None:
    """Run ``check`` (which raises on failure) unless these exact bytes already passed it in this process.

    ``check=None`` skips checking (and records nothing).
    """
    if check is None:
        return
    digest = hashlib.sha256(data).hexdigest()
    if digest not in _checked:
        check(data, source)
        _checked.add(digest)


def cached_program(path: Path, make: Callable[[], bytes], check: Callable[[bytes, str], None] | None) -> bytes:
    """The program at ``path``; if absent, ``make()`` it, ``check`` it (raises on failure), then store it.

    A program read from the cache is checked again (once per process): a cache directory is a place where stale or
    foreign files can appear, and the check costs far less than an export.
    """
    if path.exists():
        data = path.read_bytes()
        checked_once(data, str(path), check)
        log.debug("using cached program %s", path)
        return data
    log.info("exporting %s (cached for later runs)", path.name)
    data = make()
    checked_once(data, path.name, check)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)  # atomic: readers see the whole file or none
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return data


class ExportingSource:
    """A :class:`edge_client.backends.executorch.ProgramSource` that exports (and checks) what the cache lacks."""

    def __init__(self, cache_dir: Path | None = None, *, verify: bool = True) -> None:
        self.cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
        self.verify = verify

    def program(self, spec: ModelSpec, loss: TrainingLoss, max_batch: int) -> bytes:
        from export.executorch import export_training
        from export.parity import check_training, require

        def check(data: bytes, source: str) -> None:
            for report in require(check_training(data, source=source)):
                log.info("%s", report)

        def make() -> bytes:
            return export_training(spec.build(seed=0), spec, loss, max_batch=max_batch)

        try:
            return cached_program(
                self.cache_dir / program_file_name(spec, loss, max_batch), make, check if self.verify else None
            )
        except OSError as exc:
            raise ConfigError(f"cannot use the program cache {self.cache_dir}: {exc}") from exc


def onnx_model(
    spec: ModelSpec, model_file: Path | None = None, cache_dir: Path | None = None, *, verify: bool = True
) -> bytes:
    """The ONNX model of an onnxruntime client: ``model_file`` (checked), or ``spec`` exported into the cache."""
    from export.parity import check_onnx, require

    def check(data: bytes, source: str) -> None:
        for report in require(check_onnx(data, source=source)):
            log.info("%s", report)

    run_check = check if verify else None
    if model_file is not None:
        try:
            data = Path(model_file).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read the model file {model_file}: {exc}") from exc
        checked_once(data, str(model_file), run_check)
        return data
    directory = cache_dir if cache_dir is not None else default_cache_dir()
    shape = "x".join(str(d) for d in spec.input_shape)
    from export.onnx import DEFAULT_OPSET, export_onnx

    # The opset is in the name: a file cached by an older default (opset 20, IR 10) is not what old runtimes load.
    name = f"{spec.name}-{shape}-c{spec.num_classes}-op{DEFAULT_OPSET}-v{FORMAT_VERSION}-{toolchain_tag('onnx')}"
    path = directory / f"{name}.onnx"

    def make() -> bytes:
        return export_onnx(spec.build(seed=0), spec)

    try:
        return cached_program(path, make, run_check)
    except OSError as exc:
        raise ConfigError(f"cannot use the program cache {directory}: {exc}") from exc
