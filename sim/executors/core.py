"""The executors' contract: what crosses a process or machine boundary (jobs and results as bytes), what a client
must offer, and what every executor does."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, TypeVar

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedge.errors import ConfigError, FedgeError
from fedge.types import ClientId
from fedge.wire.fields import printable
from fedge.wire.message import Message


class ExecutorError(FedgeError):
    """The executor itself cannot run: a worker could not build its clients, or the cluster lacks the resources."""


# --- what crosses the boundary ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientJob:
    """One client's work of a round: its encoded task and the round's encoded broadcast (None: no broadcast)."""

    client_id: ClientId
    task: bytes
    broadcast: bytes | None
    return_state: bool = False  # send the client's store back after the step (see ExecutorTransport.stores)


@dataclass(frozen=True)
class ClientResult:
    """What one job produced: the encoded reply, or ``error`` saying why there is none (a crash, a lost worker).

    A client that cannot do its task (bad task, wrong settings) still replies: an encoded ERROR message, as in-process.
    """

    client_id: ClientId
    reply: bytes | None
    error: str | None
    compute_s: float  # wall seconds of decoding the task and the client step (NaN: the job never ran)
    cpu_s: float = math.nan  # CPU seconds of the worker process over the same span
    state: bytes | None = None  # the client's store after the job (encode_state), when the job asked for it


class SimClient(Protocol):
    """What an executor needs of a client (:class:`edge_client.client.EdgeClient`)."""

    @property
    def client_id(self) -> ClientId: ...

    @property
    def store(self) -> MutableMapping[str, Any]: ...

    def handle(self, task: Message, broadcast: Message | None) -> Message: ...


ClientBuilder = Callable[[ClientId], SimClient]
"""Builds one client (its data and runtime) by id; called once per client and worker."""

ClientFactory = Callable[[], ClientBuilder]
"""Picklable; called once in each worker to load what its clients share (dataset, runtime) and return a builder."""


def encode_state(store: Mapping[str, torch.Tensor]) -> bytes:
    """A client's store as safetensors bytes (what crosses the boundary when the coordinator keeps a copy)."""
    return st_save({k: v.detach().contiguous().clone() for k, v in store.items()})  # clone: no shared storage


def decode_state(blob: bytes) -> dict[str, torch.Tensor]:
    """The store :func:`encode_state` encoded."""
    return st_load(blob)


class ClientExecutor(Protocol):
    """Runs one round's client jobs; results come back in the jobs' order, one per job, whatever happened."""

    @property
    def name(self) -> str: ...

    @property
    def workers(self) -> int: ...

    def run(self, jobs: Sequence[ClientJob]) -> list[ClientResult]:
        """Each job's result, in the order of ``jobs`` (client ids must be distinct)."""
        ...

    def stream(self, jobs: Sequence[ClientJob]) -> Iterator[ClientResult]:
        """:meth:`run`'s results one by one, as soon as the executor can give them (the transport handles each
        before the next: a round of 1,000 stateful clients never holds all their returned states at once)."""
        ...

    def load_states(self, states: Mapping[ClientId, bytes]) -> None:
        """Give clients their stored state (:func:`encode_state`; a resumed run, or one a dead worker lost) before
        the next round; each then stays with the worker that holds it."""
        ...

    def drain_lost_state(self) -> list[ClientId]:
        """Clients whose stored state was lost with a worker since the last call, sorted."""
        ...

    def close(self) -> None:
        """Stop the workers; idempotent."""
        ...

    def __enter__(self) -> ClientExecutor: ...

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


_Self = TypeVar("_Self", bound="ExecutorBase")


class ExecutorBase:
    """Context-manager plumbing shared by the executors."""

    def run(self, jobs: Sequence[ClientJob]) -> list[ClientResult]:
        raise NotImplementedError

    def stream(self, jobs: Sequence[ClientJob]) -> Iterator[ClientResult]:
        """All results of one :meth:`run` (executors that run clients side by side finish them together)."""
        yield from self.run(jobs)

    def close(self) -> None:
        """Nothing to stop."""

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def check_threads(threads: int) -> None:
    """A ConfigError unless ``threads`` (intra-op threads of a client step) is at least 1."""
    if threads < 1:
        raise ConfigError(f"threads_per_worker must be >= 1, got {threads}")


def check_unique(jobs: Sequence[ClientJob]) -> None:
    """A ValueError if two jobs of one round are for the same client (a caller's bug, never a peer's input)."""
    ids = [j.client_id for j in jobs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"a round gives each client at most one job; got {sorted(ids)}")


def describe(exc: BaseException) -> str:
    """An exception as one printable line, for a result's ``error`` and the logs."""
    return printable(f"{type(exc).__name__}: {exc}")
