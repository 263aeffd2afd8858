"""Algorithms as (server half, client half) pairs; see :mod:`fedge.algorithms.base` for the round protocol."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fedge.algorithms import dsfl, fd, fedavg
from fedge.algorithms.base import ClientData, ClientStep, ClientStore, Evaluation, RoundPlan, Strategy
from fedge.backend import Backend
from fedge.config import RunConfig
from fedge.errors import CodecError, ConfigError
from fedge.messages import Message

CLIENT_STEPS: dict[str, ClientStep] = {
    "fedavg": fedavg.client_step,
    "fedntd": fedavg.client_step,
    "fedlsd": fedavg.client_step,
    "fedcad": fedavg.client_step,
    "fd": fd.client_step,
    "dsfl": dsfl.client_step,
}


def make_strategy(
    config: RunConfig,
    model_factory: Callable[[], nn.Module],
    num_classes: int,
    *,
    run_id: str = "",
    open_x: torch.Tensor | None = None,
) -> Strategy:
    """The server half for ``config.algorithm``."""
    if config.algorithm in fedavg.OBJECTIVE_OF:
        return fedavg.WeightAveraging(config, model_factory, num_classes, run_id=run_id)
    if config.algorithm == "fd":
        return fd.FederatedDistillation(config, model_factory, num_classes, run_id=run_id)
    if config.algorithm == "dsfl":
        if open_x is None:
            raise ConfigError("DS-FL needs an open dataset on the server")
        return dsfl.DistillationSemiSupervised(config, model_factory, num_classes, run_id=run_id, open_x=open_x)
    raise ConfigError(f"unknown algorithm {config.algorithm!r}")


def run_client_step(
    task: Message, broadcast: Message | None, data: ClientData, backend: Backend, store: ClientStore
) -> Message:
    """Dispatch a task to the client half of the algorithm it names."""
    name = task.param("algorithm")
    try:
        step = CLIENT_STEPS[name]
    except KeyError:
        raise CodecError(f"task names unknown algorithm {name!r}; this client knows {sorted(CLIENT_STEPS)}") from None
    return step(task, broadcast, data, backend, store)


__all__ = [
    "CLIENT_STEPS",
    "ClientData",
    "ClientStore",
    "Evaluation",
    "RoundPlan",
    "Strategy",
    "make_strategy",
    "run_client_step",
]
