"""Client runtimes: PyTorch (CPU/CUDA), ExecuTorch training programs, ONNX Runtime (inference only).

:func:`make_backend` is what ``fedge client --runtime`` calls. What each runtime can do:

============  ==========================================  ==========================================
runtime       trains (FedAvg/NTD/LSD/CAD, FD, DS-FL)      logits / evaluation
============  ==========================================  ==========================================
torch         yes (CPU or CUDA, eager)                    yes
executorch    yes (training programs, portable kernels)   yes (the programs' eval method)
onnxruntime   no; FD/DS-FL predict-only with ``skip``     yes (weights replaced by name)
============  ==========================================  ==========================================
"""

from __future__ import annotations

from pathlib import Path

from fedge.backend import Backend, TorchBackend
from fedge.errors import ConfigError

RUNTIMES = ("torch", "executorch", "onnxruntime")


def make_backend(
    runtime: str,
    model: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    device: str = "cpu",
    cache_dir: Path | None = None,
    model_file: Path | None = None,
    predict_only: bool = False,
    threads: int = 0,
) -> Backend:
    """The backend for ``runtime`` holding ``model``.

    ``cache_dir``: where exported programs are kept and looked up (executorch, onnxruntime; put programs exported
    elsewhere there under their cache names). ``model_file``: a deployed ``.onnx`` (onnxruntime). ``predict_only``:
    an onnxruntime client that skips training (FD/DS-FL uploads from its deployed model).
    """
    if runtime not in RUNTIMES:
        raise ConfigError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
    if predict_only and runtime != "onnxruntime":
        raise ConfigError("predict-only is for onnxruntime clients (the other runtimes train)")
    if runtime != "torch" and device not in ("cpu", "auto"):
        raise ConfigError(f"the {runtime} runtime runs on the CPU here, not on {device!r}")
    if model_file is not None and runtime != "onnxruntime":
        raise ConfigError(
            f"a model file is for onnxruntime clients; {runtime} clients get weights from the coordinator"
        )
    if runtime == "torch":
        return TorchBackend(model, input_shape, num_classes, device=device)
    try:
        if runtime == "executorch":
            from edge_client.backends.executorch import ExecuTorchBackend

            return ExecuTorchBackend(model, input_shape, num_classes, cache_dir=cache_dir)
        from edge_client.backends.onnxruntime import OnnxRuntimeBackend

        return OnnxRuntimeBackend(
            model,
            input_shape,
            num_classes,
            model_file=model_file,
            cache_dir=cache_dir,
            train_policy="skip" if predict_only else "refuse",
            threads=threads,
        )
    except ImportError as exc:
        raise ConfigError(
            f"the {runtime} runtime needs the export extras: pip install 'fedge[export]' ({exc})"
        ) from exc


__all__ = ["RUNTIMES", "make_backend"]
