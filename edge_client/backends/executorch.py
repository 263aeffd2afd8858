"""A client runtime that trains inside ExecuTorch training programs: a full client for every algorithm.

One training program per loss (objective kind and its fixed hyperparameters), exported on first use into a shared
cache directory (or given as files), parity-checked before first use. The backend holds the weights on the host;
before a program trains, the weights are copied into the program's parameter tensors, and after it trained, read
back. Teacher logits and predictions come from the programs' eval-mode ``forward`` method.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from edge_client.backends.cache import cached_program, checked_once, default_cache_dir, toolchain_tag
from export.program import FORMAT_VERSION, ModelSpec, TrainingObjective
from export.runners import PteTrainer
from fedge.errors import ConfigError
from fedge.models import exchanged_state, load_exchanged_state
from fedge.training import Objective, SGDSettings, TrainStats
from fedge.types import StateDict

log = logging.getLogger(__name__)

MIN_BATCH_BOUND = 64
"""Smallest batch bound of the programs this backend exports; larger task batch sizes round up to a power of two."""


def program_objective(objective: Objective) -> TrainingObjective:
    """The program computing ``objective``: FedLSD runs in the FedCAD program (same loss; class weights are inputs)."""
    kind = "cad" if objective.kind == "lsd" else objective.kind
    return TrainingObjective(kind, tau=objective.tau, beta=objective.beta, gamma=objective.gamma)


def batch_bound(batch_size: int) -> int:
    """The batch bound of the program used for ``batch_size``: at least 64, a power of two."""
    bound = MIN_BATCH_BOUND
    while bound < batch_size:
        bound *= 2
    return bound


class ExecuTorchBackend:
    """The :class:`fedge.backend.Backend` protocol on ExecuTorch training programs (portable kernels, CPU)."""

    runtime = "executorch"

    def __init__(
        self,
        model: str,
        input_shape: tuple[int, ...],
        num_classes: int,
        *,
        cache_dir: Path | None = None,
        programs: Mapping[TrainingObjective, Path] | None = None,
        verify: bool = True,
    ) -> None:
        """``programs``: training programs to use instead of exporting (checked all the same unless ``verify`` is off).

        ``cache_dir``: where exported programs are kept (default :func:`default_cache_dir`).
        """
        self.spec = ModelSpec(model, tuple(input_shape), num_classes)
        self.cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
        self.verify = verify
        self._given = dict(programs or {})
        self._scratch = self.spec.build(seed=0)  # validates the spec; the eager twin used only to export
        self._state: StateDict = exchanged_state(self._scratch)  # the same start as TorchBackend
        self._trainers: dict[tuple[TrainingObjective, int], PteTrainer] = {}
        self._loaded: dict[tuple[TrainingObjective, int], int] = {}  # which version of the weights each holds
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
        key = next(iter(self._trainers), (TrainingObjective("ce"), MIN_BATCH_BOUND))
        return self._synced(key).logits(x)

    def train(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        objective: Objective,
        sgd: SGDSettings,
        *,
        epochs: int,
        batch_size: int,
        seed: int,
        aux: torch.Tensor | None = None,
        aux_mask: torch.Tensor | None = None,
    ) -> TrainStats:
        key = (program_objective(objective), batch_bound(batch_size))
        trainer = self._synced(key)
        stats = trainer.train(
            x,
            y,
            sgd,
            epochs=epochs,
            batch_size=batch_size,
            seed=seed,
            aux=aux,
            aux_mask=aux_mask,
            class_weights=objective.class_weights,
        )
        self._state = trainer.get_weights()
        self._version += 1
        self._loaded[key] = self._version
        return stats

    # --- programs --------------------------------------------------------------------------------------------------
    def prepare(self, objectives: Iterable[Objective], batch_size: int) -> None:
        """Load (on first use: export and check) the programs for ``objectives`` now rather than in a round."""
        for objective in objectives:
            self._synced((program_objective(objective), batch_bound(batch_size)))

    def program_path(self, objective: TrainingObjective, max_batch: int) -> Path:
        """Where the training program for ``objective`` with batch bound ``max_batch`` is cached."""
        s = self.spec
        shape = "x".join(str(d) for d in s.input_shape)
        name = f"{s.name}-{shape}-c{s.num_classes}-{objective.tag}-b{max_batch}-v{FORMAT_VERSION}"
        return self.cache_dir / f"{name}-{toolchain_tag('executorch')}.pte"

    def _synced(self, key: tuple[TrainingObjective, int]) -> PteTrainer:
        """The trainer for ``key``, holding the current weights."""
        trainer = self._trainers.get(key)
        if trainer is None:
            trainer = self._trainers[key] = PteTrainer(self._program(*key), source=f"{key[0].tag} program")
            self._loaded[key] = -1
        if self._loaded[key] != self._version:
            trainer.set_weights(self._state)
            self._loaded[key] = self._version
        return trainer

    def _program(self, objective: TrainingObjective, max_batch: int) -> bytes:
        from export.parity import check_training, require

        def verify(data: bytes, source: str) -> None:
            for report in require(check_training(data, source=source)):
                log.info("%s", report)

        check = verify if self.verify else None
        given = self._given.get(objective)
        if given is not None:
            data = given.read_bytes()
            checked_once(data, str(given), check)
            return data

        def make() -> bytes:
            from export.executorch import export_training

            return export_training(self.spec.build(seed=0), self.spec, objective, max_batch=max_batch)

        try:
            return cached_program(self.program_path(objective, max_batch), make, check)
        except OSError as exc:
            raise ConfigError(f"cannot use the program cache {self.cache_dir}: {exc}") from exc
