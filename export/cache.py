"""A directory of exported programs shared by client processes: export once, check, then reuse.

What a workstation or laptop client uses (the CLI hands it to the edge client's runtimes): a missing program is
exported, parity-checked and written under the one naming scheme of :func:`fedge.programs.spec.program_file_name` (the
names ``fedge export`` writes too); a present one is checked again once per process, since a cache directory is a
place where stale or foreign files appear. A program is written only after it passed its check, through a temporary
file and an atomic rename, and recorded in the directory's manifest with its SHA-256, so a client never reads a
half-written, unchecked or damaged file, and several client processes on one machine can share a cache.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

from edge_client.backends.cache_dir import default_cache_dir
from fedge.errors import ConfigError
from fedge.programs.spec import FORMAT_VERSION, ModelSpec, TrainingLoss, program_file_name
from fedge_io import manifest

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


def cached_program(
    path: Path, make: Callable[[], bytes], check: Callable[[bytes, str], None] | None, *, kind: str = "pte-train"
) -> bytes:
    """The program at ``path``; if absent, ``make()`` it, ``check`` it (raises on failure), then store it.

    A cached file is read through the cache's manifest (:mod:`fedge_io.manifest`) before any runtime sees it: one that
    is damaged, or that the manifest does not list (a foreign file, or one cached by a fedge without manifests), is
    made again rather than loaded, since a damaged program can crash the runtime. A program read from the cache is
    also checked again (once per process), and the check costs far less than an export.
    """
    if path.exists():
        try:
            data = manifest.verified_read(path)
        except manifest.ManifestError as exc:
            log.warning("%s; making it again", exc)
        else:
            checked_once(data, str(path), check)
            log.debug("using cached program %s", path)
            return data
    log.info("exporting %s (cached for later runs)", path.name)
    data = make()
    checked_once(data, path.name, check)
    # Atomic, and recorded in the manifest under its lock: readers see the whole file (with its entry) or none.
    manifest.write_file(path.parent, path.name, data, kind)
    return data


class ExportingSource:
    """A :class:`edge_client.backends.executorch.ProgramSource` that exports (and checks) what the cache lacks."""

    def __init__(self, cache_dir: Path | None = None, *, verify: bool = True) -> None:
        self.cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
        self.verify = verify

    def program(self, spec: ModelSpec, loss: TrainingLoss, max_batch: int) -> bytes:
        from export.executorch import export_training
        from export.gates.check import check_training
        from export.gates.report import require

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
    spec: ModelSpec,
    model_file: Path | None = None,
    cache_dir: Path | None = None,
    *,
    verify: bool = True,
    unverified: bool = False,
) -> bytes:
    """The ONNX model of an onnxruntime client: ``model_file`` (checked), or ``spec`` exported into the cache.

    ``model_file`` must match the ``manifest.json`` beside it; ``unverified`` accepts a file with no manifest.
    """
    from export.gates.logits import check_onnx
    from export.gates.report import require

    def check(data: bytes, source: str) -> None:
        for report in require(check_onnx(data, source=source)):
            log.info("%s", report)

    run_check = check if verify else None
    if model_file is not None:
        # Checked against the export's manifest first: damaged weights in an .onnx load and serve wrong logits.
        data = manifest.verified_read(Path(model_file), required=not unverified)
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
        return cached_program(path, make, run_check, kind="onnx")
    except OSError as exc:
        raise ConfigError(f"cannot use the program cache {directory}: {exc}") from exc
