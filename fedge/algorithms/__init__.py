"""The algorithms, one module each, and the two calls that dispatch a round to them: :func:`make_strategy` (the
server half of a run's algorithm, wrapped in the run's compression and secure aggregation or differential privacy) and
:func:`run_client_step` (a task to the client half it names). Which algorithms exist is :mod:`fedge.registry`'s list;
their whole entries are read through :mod:`fedge.algorithms.catalog`.
"""

from __future__ import annotations

from fedge.algorithms.base import ClientData, ClientStore, ServerContext, Strategy
from fedge.algorithms.catalog import ALGORITHMS, get_algorithm
from fedge.algorithms.compressed import compressed
from fedge.algorithms.differential_privacy import privatized
from fedge.algorithms.secure_aggregation import secured
from fedge.compression.strategy import decode_broadcast, encode_update
from fedge.config import AlgorithmSettings, RunConfig
from fedge.errors import CodecError
from fedge.learning.backend import Backend
from fedge.wire.message import Message


def make_strategy(config: RunConfig, context: ServerContext) -> Strategy[AlgorithmSettings]:
    """The server half of ``config.algorithm``, as the run's compression and secure aggregation (or DP-FedAvg, which
    runs secure aggregation itself) wrap it. Typed by the settings base: what an algorithm's own settings add is its
    module's to read (``strategy.settings.prox_mu`` does not pass the type checker here)."""
    inner = compressed(get_algorithm(config.algorithm).server(config, context), config)
    return privatized(inner, config) if config.differential_privacy else secured(inner, config)


def run_client_step(
    task: Message, broadcast: Message | None, data: ClientData, backend: Backend, store: ClientStore
) -> Message:
    """Dispatch a task to the client half of the algorithm it names, decoding and encoding what the run compresses
    (:mod:`fedge.compression.strategy`): the client half sees float32 tensors only."""
    name = task.param("algorithm")
    if name not in ALGORITHMS:
        raise CodecError(f"task names unknown algorithm {name[:40]!r}; this client knows {', '.join(ALGORITHMS)}")
    plain = decode_broadcast(broadcast) if broadcast is not None else None
    update = ALGORITHMS[name].client.step(task, plain, data, backend, store)
    return encode_update(task, update, plain, store)


__all__ = ["make_strategy", "run_client_step"]
