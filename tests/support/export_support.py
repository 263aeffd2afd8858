"""Shared, cached exports for the tests of ``export/`` and the on-device backends (imported by tests/export/).

Exports take seconds each, so every export is made once per test session (process-wide caches; pytest fixtures in a
module imported by several test files would be instantiated once per file). Shapes are small: the checks are about
what the runtimes compute, not about model size.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch

from fedge.algorithms.catalog import make_objective
from fedge.learning.models import exchanged_state
from fedge.programs.spec import ModelSpec, TrainingLoss
from fedge.types import StateDict

SPECS: dict[str, ModelSpec] = {
    "dsfl_mnist_cnn": ModelSpec("dsfl_mnist_cnn", (1, 16, 16), 10),  # BN + max pooling; 16x16 is its smallest input
    "dsfl_fmnist_cnn": ModelSpec("dsfl_fmnist_cnn", (1, 8, 8), 10),
    "fedavg_cnn": ModelSpec("fedavg_cnn", (1, 8, 8), 10),  # max pooling, no BN
    "reuters_mlp": ModelSpec("reuters_mlp", (50,), 10),
    "imdb_lstm": ModelSpec("imdb_lstm", (4,), 2),  # the LSTM unrolls over the sequence: keep it short
    "tiny_mlp": ModelSpec("tiny_mlp", (1, 8, 8), 10),  # the digits shape, as in the fleet runs
}


def weights(name: str) -> StateDict:
    """Seed-1 weights with non-trivial BN running statistics (so eval-mode BN is not an identity)."""
    model = SPECS[name].build(seed=1)
    gen = torch.Generator().manual_seed(7)
    state = exchanged_state(model)
    for k, v in state.items():
        if k.endswith("running_mean"):
            state[k] = 0.3 * torch.randn(v.shape, generator=gen)
        elif k.endswith("running_var"):
            state[k] = 0.5 + torch.rand(v.shape, generator=gen)
    return state


def model_with(name: str) -> torch.nn.Module:
    model = SPECS[name].build(seed=1)
    from fedge.learning.models import load_exchanged_state

    load_exchanged_state(model, weights(name))
    return model


@functools.cache
def program_cache() -> Path:
    """One program cache directory per test session, shared by backends (and client processes) under test."""
    path = Path(tempfile.mkdtemp(prefix="fedge-test-programs-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def onnx_export(name: str) -> bytes:
    from export.onnx import export_onnx

    return export_onnx(model_with(name), SPECS[name])


@functools.cache
def pte_export(name: str) -> bytes:
    from export.executorch import export_inference

    return export_inference(model_with(name), SPECS[name], max_batch=8)  # under XNNPACK's narrowed bounds


NON_DEFAULT = {"tau": "2.0", "beta": "0.5", "gamma": "0.7"}
"""Hyperparameters that are not the defaults: they must reach the loss baked into a program."""


def loss_of(kind: str, prox_mu: float = 0.0) -> TrainingLoss:
    """The objective ``kind`` with the non-default hyperparameters it has, and FedProx's term with ``prox_mu`` > 0."""
    import dataclasses

    from fedge.algorithms.catalog import objective_classes, terms_from_flags

    names = {f.name for f in dataclasses.fields(objective_classes()[kind])}
    objective = make_objective(kind, {k: v for k, v in NON_DEFAULT.items() if k in names})
    return TrainingLoss(objective, terms_from_flags((), prox_mu))


@functools.cache
def training_program(
    name: str, kind: str, max_pool_workaround: bool = True, prox_mu: float = 0.0, lower: bool = True
) -> bytes:
    """A training program exported without the parity gate (the tests run the checks themselves)."""
    from export.executorch import export_training

    spec = SPECS[name]
    loss = loss_of(kind, prox_mu)
    return export_training(
        spec.build(seed=1), spec, loss, max_batch=16, max_pool_workaround=max_pool_workaround, lower=lower
    )
