"""The parity gate of a set of ONNX Runtime training artifacts against eager PyTorch (:mod:`export.gates`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from edge_client.backends.ort_training import RUNTIME, OrtTrainer
from export.gates.report import ParityReport
from fedge.learning.training import TrainRequest
from fedge.types import StateDict


def check_artifacts(
    directory: Path,
    weights: Mapping[str, torch.Tensor] | None = None,
    *,
    batch_size: int | None = None,
    source: str | None = None,
) -> list[ParityReport]:
    """Logit, stepwise and drift parity of a set of artifacts against eager PyTorch (the gates of :mod:`export.gates`).

    The drift check runs :data:`export.gates.inputs.DRIFT_STEPS` free-running steps of ``batch_size`` (default
    :data:`export.gates.inputs.DRIFT_BATCH`) real-looking samples with momentum 0.9 and weight decay 1e-5, and compares
    the weights and BN statistics with eager float64's, within a tolerance set by eager float32's own distance.

    A failed drift run is repeated on other samples (:func:`export.gates.drift.drift_with_retries`, as the ExecuTorch
    gate does): seen on ORT, 2 of 12 model and loss combinations at the standard samples took the other side of a
    round-off tie from eager float32 (a ReLU input 2e-8 from zero), while ORT's step-by-step gradients there match eager
    to 4e-8.
    Without ``weights`` the seed-0 initialization is the starting point. Does not raise on failure.
    """
    from export.gates.drift import drift_with_retries
    from export.gates.inputs import DRIFT_BATCH, drift_request
    from export.gates.logits import logits_parity
    from export.gates.reference import reference_model
    from export.gates.stepwise import stepwise_parity

    trainer = OrtTrainer(directory, threads=torch.get_num_threads())
    spec = trainer.meta.model
    start: StateDict = dict(weights) if weights is not None else trainer.get_weights()
    source = source or directory.name
    trained: list[StateDict] = []

    def run(request: TrainRequest) -> StateDict:
        trainer.set_weights(start)
        trainer.train(request)
        trained.append(trainer.get_weights())
        return trained[-1]

    def run_from(begin: Mapping[str, torch.Tensor], request: TrainRequest) -> StateDict:
        trainer.set_weights(begin)
        trainer.train(request)
        return trainer.get_weights()

    batch = batch_size or DRIFT_BATCH
    request = drift_request(spec, trainer.loss, batch_size=batch)
    # Stepwise first: each step from float64's weights measures the arithmetic itself, so a wrong gradient or an
    # imprecise kernel fails it whatever the samples; the retries are for drift only.
    stepwise = stepwise_parity(run_from, spec, start, request, source=source, runtime=RUNTIME)
    drift = drift_with_retries(run, spec, start, trainer.loss, batch_size=batch, source=source, runtime=RUNTIME)
    # Eval-mode logits (the eval model) on the trained weights: BN then normalizes with moved running statistics.
    trainer.set_weights(trained[0])
    logits = logits_parity(trainer.logits, reference_model(spec, trained[0]), spec, source=source, runtime=RUNTIME)
    return [logits, stepwise, *drift]
