"""A client runtime that trains inside ExecuTorch training programs: a full client for every algorithm.

One training program per loss (objective and its fixed hyperparameters, plus FedProx's mu), found through a
:class:`ProgramSource`: on a device, the programs exported beforehand (``fedge export --format pte-train``) in a
directory under one naming scheme (:func:`fedge.programs.spec.program_file_name`); on a workstation the CLI passes a
source that exports a missing program and checks its parity first (:class:`export.cache.ExportingSource`). The
backend holds the weights on the host; before a program trains, the weights are copied into the program's parameter
tensors, and after it trained, read back. Teacher logits and predictions come from the programs' eval-mode
``forward`` method.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from edge_client.backends import RUNTIME_HOOKS
from edge_client.backends.cache_dir import default_cache_dir
from edge_client.backends.runners import PteTrainer
from fedge.algorithms.fedavg import CrossEntropy
from fedge.errors import ConfigError
from fedge.learning.models import exchanged_state, load_exchanged_state
from fedge.learning.training import TrainRequest, TrainStats, check_hooks, fisher_diagonal
from fedge.programs.spec import ModelSpec, TrainingLoss, export_command, program_file_name
from fedge.types import StateDict
from fedge_io import manifest

if TYPE_CHECKING:
    from cryptography.x509 import Certificate

log = logging.getLogger(__name__)

MIN_BATCH_BOUND = 64
"""Smallest batch bound of the training programs; larger task batch sizes round up to a power of two."""


def batch_bound(batch_size: int) -> int:
    """The batch bound of the program used for ``batch_size``: at least 64, a power of two."""
    bound = MIN_BATCH_BOUND
    while bound < batch_size:
        bound *= 2
    return bound


class ProgramSource(Protocol):
    """Where a backend gets the bytes of a training program."""

    def program(self, spec: ModelSpec, loss: TrainingLoss, max_batch: int) -> bytes:
        """The training program of ``spec`` for ``loss`` with batch bound ``max_batch``; ConfigError if none."""
        ...


class ProgramDirectory:
    """Training programs exported beforehand into ``directory`` under :func:`fedge.programs.spec.program_file_name`."""

    def __init__(
        self, directory: Path | None = None, *, unverified: bool = False, trust: Certificate | None = None
    ) -> None:
        self.directory = directory if directory is not None else default_cache_dir()
        self.unverified = unverified
        self.trust = trust  # a CA whose signature the directory's manifest must carry

    def program(self, spec: ModelSpec, loss: TrainingLoss, max_batch: int) -> bytes:
        path = self.directory / program_file_name(spec, loss, max_batch)
        if not path.is_file():
            raise ConfigError(
                f"no training program {path.name} in {self.directory}; export it with "
                f"`{export_command(spec, loss, max_batch, str(self.directory))}`"
            )
        # Checked against the export's manifest before ExecuTorch sees a byte: a damaged .pte can crash the runtime.
        return manifest.verified_read(path, required=not self.unverified, trust=self.trust)


class ExecuTorchBackend:
    """The :class:`fedge.learning.backend.Backend` protocol on ExecuTorch training programs (portable kernels, CPU)."""

    runtime = "executorch"

    def __init__(
        self, model: str, input_shape: tuple[int, ...], num_classes: int, *, programs: ProgramSource | None = None
    ) -> None:
        self.spec = ModelSpec(model, tuple(input_shape), num_classes)
        self.programs: ProgramSource = programs if programs is not None else ProgramDirectory()
        self._scratch = self.spec.build(seed=0)  # validates the spec and weights; never trained
        self._state: StateDict = exchanged_state(self._scratch)  # the same start as TorchBackend
        self._trainers: dict[tuple[TrainingLoss, int], PteTrainer] = {}
        self._prepared = False  # set once programs were prepared before the hello: a later one is made in a round
        self._loaded: dict[tuple[TrainingLoss, int], int] = {}  # which version of the weights each holds
        self._version = 0

    # --- weights ---------------------------------------------------------------------------------------------------
    def set_weights(self, state: StateDict) -> None:
        load_exchanged_state(self._scratch, state)  # validates names, shapes and dtypes like TorchBackend
        self._state = {k: state[k].detach().to(torch.float32).cpu().clone() for k in self._state}
        self._version += 1

    def get_weights(self) -> StateDict:
        return {k: v.clone() for k, v in self._state.items()}

    def init_weights(self, seed: int) -> StateDict:
        return exchanged_state(self.spec.build(seed=seed))

    # --- compute ---------------------------------------------------------------------------------------------------
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Eval-mode logits from the current weights (any loaded program's ``forward``; the CE program if none)."""
        key = next(iter(self._trainers), (TrainingLoss(CrossEntropy()), MIN_BATCH_BOUND))
        return self._synced(key).logits(x)

    def train(self, request: TrainRequest) -> TrainStats:
        check_hooks(request, RUNTIME_HOOKS[self.runtime], self.runtime)  # never drop a term the program lacks
        key = (TrainingLoss.of(request.objective, request.terms), batch_bound(request.batch_size))
        if self._prepared and key not in self._trainers:
            log.warning(
                "making the %s program (batch bound %d) now, in a round: it was not among those prepared from the "
                "run config",
                key[0].tag,
                key[1],
            )
        trainer = self._synced(key)
        try:
            stats = trainer.train(request)
        except BaseException:  # abandoned part-way (a task past its deadline): its weights are no longer ours
            self._loaded[key] = -1
            raise
        self._state = trainer.get_weights()
        self._version += 1
        self._loaded[key] = self._version
        if request.fisher_samples > 0:  # squared gradients of the cross-entropy program at the trained weights
            ce = self._synced((TrainingLoss(CrossEntropy()), key[1]))
            stats = dataclasses.replace(stats, fisher=fisher_diagonal(ce.gradients, request))
        return stats

    # --- programs --------------------------------------------------------------------------------------------------
    def prepare(self, losses: Iterable[TrainingLoss], batch_size: int) -> None:
        """Load the programs for ``losses`` now (before the client says hello) rather than in a round."""
        for loss in losses:
            self._synced((loss, batch_bound(batch_size)))
        self._prepared = True

    def _synced(self, key: tuple[TrainingLoss, int]) -> PteTrainer:
        """The trainer for ``key``, holding the current weights."""
        trainer = self._trainers.get(key)
        if trainer is None:
            loss, bound = key

            trainer = PteTrainer(self.programs.program(self.spec, loss, bound), source=loss.tag)
            _check_program(trainer, self.spec, loss, bound)
            self._trainers[key] = trainer
            self._loaded[key] = -1
        if self._loaded[key] != self._version:
            trainer.set_weights(self._state)
            self._loaded[key] = self._version
        return trainer


def _check_program(trainer: PteTrainer, spec: ModelSpec, loss: TrainingLoss, bound: int) -> None:
    """Refuse, when it is loaded (before the hello for prepared programs), a program that is not the one asked for:
    a file renamed or copied under another program's name would otherwise fail (or train the wrong loss) in a round."""
    meta = trainer.meta
    got = f"{meta.model.name} {meta.model.input_shape} c{meta.model.num_classes}, {trainer.loss.tag}, batch bound "
    got += str(meta.max_batch)
    if meta.model != spec or trainer.loss.tag != loss.tag or meta.max_batch < bound:
        raise ConfigError(
            f"the training program found for {spec.name} {spec.input_shape} c{spec.num_classes}, {loss.tag}, batch "
            f"bound {bound} is a program of {got}: it was renamed or copied under another program's name; export the "
            f"right one with `{export_command(spec, loss, bound, '<program directory>')}`"
        )
