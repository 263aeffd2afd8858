"""Training-step times of ONNX Runtime training artifacts against eager PyTorch, also from another environment."""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from edge_client.backends.ort_training import OrtTrainer
from export.ort_training.artifacts import generate
from fedge.errors import ExportError
from fedge.learning.models import load_exchanged_state
from fedge.programs.spec import ModelSpec, TrainingLoss

ENV_DIR = ".venv-ort-training"
"""The environment ``make ort-training`` makes, at the repository root."""
_ROOT = Path(__file__).resolve().parents[2]
"""This checkout (whose code another environment must run)."""


def step_times(
    spec: ModelSpec, *, batch: int = 50, threads: int = 1, steps: int = 10, repeats: int = 5
) -> dict[str, float]:
    """Median ms per training step of these artifacts and of eager PyTorch, same process, ``threads`` threads each.

    FedNTD loss, momentum 0.9, weight decay 1e-5, ``steps`` steps of ``batch`` per pass, ``repeats`` passes after a
    warm-up pass, the runtimes interleaved. ``eager_ms``: :func:`fedge.learning.training.train` on the model in its
    default memory layout (what ``benchmarks/runtimes.py`` times); ``torch_client_ms``: the PyTorch client's backend
    (:class:`fedge.learning.backend.TorchBackend`, convolutions channels-last on the CPU). The ORT figure includes the
    host-side SGD step and the copies of weights and gradients between host and ORT. Runs in ``.venv-ort-training``;
    :func:`step_times_in_env` calls it from another environment.
    """
    from export.gates.inputs import DRIFT_SGD, parity_sample
    from fedge.algorithms.fedntd import NotTrueDistillation
    from fedge.learning.backend import TorchBackend
    from fedge.learning.training import TrainRequest, predict_logits, train

    torch.set_num_threads(threads)
    loss = TrainingLoss(NotTrueDistillation())
    x, y = parity_sample(spec, batch * steps, seed=3)
    teacher = predict_logits(spec.build(seed=1), x)
    request = TrainRequest(x, y, loss.objective, DRIFT_SGD, 1, batch, 0, inputs={"teacher": teacher})
    model = spec.build(seed=0)
    start = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}
    client = TorchBackend(spec.name, spec.input_shape, spec.num_classes)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = OrtTrainer(generate(spec, loss, Path(tmp) / "artifacts"), threads=threads)

        def ort_pass() -> None:
            trainer.set_weights(start)
            trainer.train(request)

        def eager_pass() -> None:
            load_exchanged_state(model, start)
            train(model, request)

        def client_pass() -> None:
            client.set_weights(start)
            client.train(request)

        passes = {"eager_ms": eager_pass, "torch_client_ms": client_pass, "ort_training_ms": ort_pass}
        times: dict[str, list[float]] = {name: [] for name in passes}
        for i in range(repeats + 1):
            for name, run in passes.items():  # interleaved: every runtime sees the same machine load
                t = time.perf_counter()
                run()
                if i:  # the first pass is a warm-up
                    times[name].append((time.perf_counter() - t) * 1e3 / steps)
    result = {name: statistics.median(values) for name, values in times.items()}
    result["ratio"] = result["ort_training_ms"] / result["eager_ms"]
    result["ratio_to_torch_client"] = result["ort_training_ms"] / result["torch_client_ms"]
    return result


def env_python(root: Path | None = None) -> Path | None:
    """The Python of ``.venv-ort-training`` at ``root`` (default: this checkout), or None if it is not installed."""
    base = root if root is not None else _ROOT
    python = base / ENV_DIR / "bin" / "python"
    return python if python.exists() else None


def step_times_in_env(
    spec: ModelSpec,
    *,
    batch: int = 50,
    threads: int = 1,
    repeats: int = 5,
    python: Path | None = None,
    timeout: float = 600.0,
) -> dict[str, float] | None:
    """:func:`step_times` run in ``.venv-ort-training`` from any environment (e.g. ``benchmarks/runtimes.py``); None
    when that environment is not installed."""
    python = python or env_python()
    if python is None:
        return None
    cmd = [str(python), "-m", "export.ort_training", "bench", "--model", spec.name, "--input-shape"]
    cmd += [",".join(map(str, spec.input_shape)), "--num-classes", str(spec.num_classes)]
    cmd += ["--batch", str(batch), "--threads", str(threads), "--repeats", str(repeats)]
    root = _ROOT  # the checkout whose code the other environment must run
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, cwd=root)
    if done.returncode != 0:
        raise ExportError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
