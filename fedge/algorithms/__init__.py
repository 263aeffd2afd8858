"""The algorithm registry: one module per algorithm, listed once here; config, CLI, reports and cost tables read it.

Adding an algorithm is one new module under ``fedge/algorithms/`` that defines ``ALGORITHM``
(:class:`fedge.algorithms.base.Algorithm`) and one entry in ``_MODULES``.
"""

from __future__ import annotations

from importlib import import_module

from fedge.algorithms.base import (
    Algorithm,
    ClientData,
    ClientStore,
    Evaluation,
    RoundPlan,
    ServerContext,
    Strategy,
)
from fedge.errors import CodecError, ConfigError
from fedge.learning.backend import Backend
from fedge.wire.message import Message

_MODULES = (
    "fedavg",
    "fedntd",
    "fedlsd",
    "fedcad",
    "fedprox",
    "scaffold",
    "fedadam",
    "fednova",
    "feddyn",
    "fedcurv",
    "moon",
    "fd",
    "dsfl",
)

ALGORITHMS: dict[str, Algorithm] = {
    spec.name: spec for spec in (import_module(f"fedge.algorithms.{m}").ALGORITHM for m in _MODULES)
}
"""Every algorithm by its config name, in the order above."""


def get_algorithm(name: str) -> Algorithm:
    """The registry entry for ``name``; a ConfigError listing the known ones otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(f"unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}") from None


def make_strategy(config: object, context: ServerContext) -> Strategy:
    """The server half of ``config.algorithm``."""
    from fedge.compression.strategy import compressed
    from fedge.config import RunConfig

    assert isinstance(config, RunConfig)
    return compressed(get_algorithm(config.algorithm).server(config, context), config)


def run_client_step(
    task: Message, broadcast: Message | None, data: ClientData, backend: Backend, store: ClientStore
) -> Message:
    """Dispatch a task to the client half of the algorithm it names, decoding and encoding what the run compresses
    (:mod:`fedge.compression.strategy`): the client half sees float32 tensors only."""
    name = task.param("algorithm")
    if name not in ALGORITHMS:
        raise CodecError(f"task names unknown algorithm {name[:40]!r}; this client knows {', '.join(ALGORITHMS)}")
    from fedge.compression.strategy import decode_broadcast, encode_update

    plain = decode_broadcast(broadcast) if broadcast is not None else None
    update = ALGORITHMS[name].client.step(task, plain, data, backend, store)
    return encode_update(task, update, plain, store)


__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "ClientData",
    "ClientStore",
    "Evaluation",
    "RoundPlan",
    "ServerContext",
    "Strategy",
    "get_algorithm",
    "make_strategy",
    "run_client_step",
]
