"""What an edge client says while it computes: a runtime wrapper that logs each epoch and times each part of a task.

:class:`ObservedBackend` wraps any :class:`fedge.learning.backend.Backend` for one task. It gives every training call an
``on_epoch`` observer (:class:`fedge.learning.training.EpochProgress`) that logs the epoch's loss and time, then asks
the client whether the task is still wanted: a :class:`TaskAbandoned` raised there ends the training between two epochs
(the task's deadline passed, or a newer coordinator session spoke). It also adds up the seconds spent training and
running inference, for the task's closing line. Results are unchanged: the wrapper only observes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from fedge.learning.backend import Backend
from fedge.learning.training import EpochProgress, TrainRequest, TrainStats
from fedge.types import StateDict

log = logging.getLogger(__name__)


class TaskAbandoned(Exception):
    """A task stopped part-way, because its reply could no longer be used; the message says why."""


class ObservedBackend:
    """``inner`` for one task of round ``rnd``, saying what it does; ``check`` returns why to stop, or None."""

    def __init__(self, inner: Backend, rnd: int, check: Callable[[], str | None] | None = None) -> None:
        self.inner = inner
        self.runtime = inner.runtime
        self.rnd = rnd
        self.check = check
        self.train_s = 0.0  # seconds in training calls
        self.infer_s = 0.0  # seconds in inference calls
        self.epochs = 0  # epochs finished, over every training call of the task
        self._epoch_started = 0.0
        self._samples = 0

    def set_weights(self, state: StateDict) -> None:
        self.inner.set_weights(state)

    def get_weights(self) -> StateDict:
        return self.inner.get_weights()

    def init_weights(self, seed: int) -> StateDict:
        return self.inner.init_weights(seed)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        try:
            return self.inner.logits(x)
        finally:
            self.infer_s += time.perf_counter() - started

    def train(self, request: TrainRequest) -> TrainStats:
        started = self._epoch_started = time.perf_counter()
        self._samples = len(request.x)
        try:
            return self.inner.train(dataclasses.replace(request, on_epoch=self._on_epoch))
        finally:
            self.train_s += time.perf_counter() - started

    def __getattr__(self, name: str) -> Any:  # what a runtime offers beyond the protocol (prepare, device ...)
        return getattr(self.inner, name)

    def _on_epoch(self, progress: EpochProgress) -> None:
        now = time.perf_counter()
        self.epochs += 1
        log.info(
            "round %d: epoch %d/%d on %d samples: loss %.4f, %.1f s",
            self.rnd,
            progress.epoch,
            progress.epochs,
            self._samples,
            progress.mean_loss,
            now - self._epoch_started,
        )
        self._epoch_started = now
        reason = self.check() if self.check is not None else None
        if reason:
            raise TaskAbandoned(reason)
