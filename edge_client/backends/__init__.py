"""Client runtimes: PyTorch (CPU/CUDA), ExecuTorch training programs, ONNX Runtime (inference, and training).

:func:`make_backend` is what ``fedge client --runtime`` calls. What each runtime can do:

============  ==========================================  ==========================================
runtime       trains (FedAvg/NTD/LSD/CAD, FD, DS-FL)      logits / evaluation
============  ==========================================  ==========================================
torch         yes (CPU or CUDA, eager)                    yes
executorch    yes (training programs, portable kernels)   yes (the programs' eval method)
onnxruntime   no; FD/DS-FL predict-only with ``skip``     yes (weights replaced by name)
onnxruntime-  yes (ORT training artifacts; own venv,      yes (the artifacts' eval model)
training      ``make ort-training``)
============  ==========================================  ==========================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedge.errors import ConfigError
from fedge.learning.backend import Backend, TorchBackend
from fedge.learning.training import HOOKS

if TYPE_CHECKING:
    from edge_client.backends.executorch import ProgramSource
    from edge_client.backends.ort_training import ArtifactSource

RUNTIMES = ("torch", "executorch", "onnxruntime", "onnxruntime-training")

RUNTIME_HOOKS: dict[str, frozenset[str]] = {
    "torch": frozenset(HOOKS),
    "executorch": frozenset(HOOKS),
    "onnxruntime": frozenset(),
    "onnxruntime-training": frozenset(HOOKS),
}
"""The hooks of :data:`fedge.learning.training.HOOKS` each runtime runs. Every training runtime computes the local terms
(:mod:`fedge.learning.terms`) inside its programs, representations included, and the Fisher pass from its own
gradients; ONNX Runtime inference trains nothing."""


def make_backend(
    runtime: str,
    model: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    device: str = "cpu",
    programs: ProgramSource | None = None,
    onnx_model: bytes | None = None,
    onnx_source: str = "ONNX model",
    predict_only: bool = False,
    threads: int = 0,
    ort_artifacts: ArtifactSource | None = None,
) -> Backend:
    """The backend for ``runtime`` holding ``model``.

    ``programs``: where an executorch client finds its training programs (default: the program directory,
    ``$FEDGE_PROGRAM_CACHE`` or ``~/.cache/fedge/programs``). ``onnx_model``: the ``.onnx`` an onnxruntime client
    serves. ``predict_only``: an onnxruntime client that skips training (FD/DS-FL uploads from its deployed model).
    ``ort_artifacts``: where an onnxruntime-training client finds its training artifacts (default: the program
    directory).
    """
    if runtime not in RUNTIMES:
        raise ConfigError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
    if predict_only and runtime != "onnxruntime":
        raise ConfigError("predict-only is for onnxruntime clients (the other runtimes train)")
    if runtime != "torch" and device not in ("cpu", "auto"):
        raise ConfigError(f"the {runtime} runtime runs on the CPU here, not on {device!r}")
    if onnx_model is not None and runtime != "onnxruntime":
        raise ConfigError(
            f"a model file is for onnxruntime clients; {runtime} clients get weights from the coordinator"
        )
    if runtime == "torch":
        return TorchBackend(model, input_shape, num_classes, device=device)
    if runtime == "onnxruntime-training":
        try:
            from edge_client.backends.ort_training import OrtTrainingBackend

            return OrtTrainingBackend(model, input_shape, num_classes, artifacts=ort_artifacts, threads=threads)
        except ImportError as exc:
            raise ConfigError(
                f"the onnxruntime-training runtime runs in its own environment: `make ort-training`, then "
                f"`.venv-ort-training/bin/fedge client ...` ({exc})"
            ) from exc
    try:
        if runtime == "executorch":
            from edge_client.backends.executorch import ExecuTorchBackend

            return ExecuTorchBackend(model, input_shape, num_classes, programs=programs)
        from edge_client.backends.onnxruntime import OnnxRuntimeBackend

        if onnx_model is None:
            raise ConfigError("an onnxruntime client needs its .onnx model (--model-file, or export it first)")
        return OnnxRuntimeBackend(
            model,
            input_shape,
            num_classes,
            onnx_model=onnx_model,
            source=onnx_source,
            train_policy="skip" if predict_only else "refuse",
            threads=threads,
        )
    except ImportError as exc:
        raise ConfigError(
            f"the {runtime} runtime needs the export extras: pip install 'fedge[export]' ({exc})"
        ) from exc


__all__ = ["RUNTIMES", "RUNTIME_HOOKS", "make_backend"]
