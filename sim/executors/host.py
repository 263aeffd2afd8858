"""Where a worker's clients live: the standard client factory, the host that runs one client's job the way the
in-process transport does, what the executors that run clients in this process share, and the memory housekeeping of
a worker that keeps hundreds of clients' stores."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass

from edge_client.client import EdgeClient
from fedge.config import RunConfig
from fedge.errors import CodecError, ConfigError
from fedge.learning.backend import TorchBackend
from fedge.types import ClientId
from fedge.wire.fields import printable
from fedge.wire.message import Message, decode, encode
from fedge.wire.protocol import error_message
from fedge_io.experiment import Experiment, prepare
from sim.executors.core import (
    ClientBuilder,
    ClientFactory,
    ClientJob,
    ClientResult,
    ExecutorBase,
    SimClient,
    check_threads,
    decode_state,
    describe,
    encode_state,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExperimentClients:
    """The standard client factory: a run's PyTorch clients, as :func:`sim.run.run_inprocess` builds them.

    With ``experiment`` None each worker calls :func:`fedge_io.experiment.prepare` on ``config`` (it reads the dataset
    files itself, about 1 s for MNIST). With an experiment, that experiment is shipped instead: pickled to each
    process, or put once in Ray's object store, where actors of a node share it (cluster nodes need no dataset files).
    """

    config: RunConfig
    device: str = "cpu"
    experiment: Experiment | None = None

    def __call__(self) -> ClientBuilder:
        exp = self.experiment if self.experiment is not None else prepare(self.config)
        backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes, device=self.device)  # shared in turn
        open_x = exp.open_x()

        def build(client_id: ClientId) -> SimClient:
            if client_id not in exp.parts:
                raise ConfigError(f"{client_id!r} is not a client of this run")
            return EdgeClient(client_id, exp.client_data(client_id, open_x), backend)

        return build


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None off glibc (macOS, musl)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _load_malloc_trim()


_TRIM_SLACK_BYTES = 256 << 20
"""How far the resident set may grow past its size after the last trim before the next one."""


def _resident_bytes() -> int | None:
    """This process's resident set size from /proc (Linux), else None."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class _FreeMemoryRelease:
    """Gives the pages of freed heap memory back to the OS when the resident set has grown by a slack (glibc).

    Why: a worker keeps every client's store (a few MB each) for the whole run, and allocates and frees training
    activations between them. glibc raises its mmap threshold to the largest block freed (up to 32 MB), so after the
    first step those activations come from the heap too, and the long-lived stores scattered through it keep freed
    pages resident: a 200-client DS-FL run grew by ~8 MB per client step in its second round (3.7 GB after two rounds
    instead of 1.8). ``malloc_trim(0)`` returns every free page (madvise) without moving anything; done after every
    step it cost ~30% of the step time (the next step faults its activation pages in again), so it runs only when
    the resident set grew by :data:`_TRIM_SLACK_BYTES` since the last trim.
    """

    def __init__(self) -> None:
        self.baseline = _resident_bytes() or 0

    def __call__(self) -> None:
        if _MALLOC_TRIM is None:
            return
        rss = _resident_bytes()
        if rss is None or rss - self.baseline < _TRIM_SLACK_BYTES:
            return
        _MALLOC_TRIM(0)
        self.baseline = _resident_bytes() or rss


release_free_memory = _FreeMemoryRelease()


class ClientHost:
    """The clients one worker owns, built on first use, and the round's decoded broadcast.

    Runs a job the way :class:`sim.inprocess.InProcessTransport` does: decode the task, call the client, encode the
    reply; a client that cannot do its task (CodecError, ConfigError, ValueError) replies with an ERROR message.
    """

    def __init__(self, build: ClientBuilder, clients: Mapping[ClientId, SimClient] | None = None) -> None:
        self._build = build
        self.clients: dict[ClientId, SimClient] = dict(clients or {})
        self._broadcast_key: Hashable = None
        self._broadcast: Message | None = None

    def run(self, job: ClientJob, broadcast_key: Hashable) -> tuple[ClientResult, bool]:
        """The job's result and whether the client now keeps state (it must stay in this worker)."""
        try:
            client = self.clients.get(job.client_id)
            if client is None:
                client = self.clients[job.client_id] = self._build(job.client_id)
        except Exception as exc:  # this client cannot be built: its result says why, the others go on
            log.exception("client %s could not be built", job.client_id)
            return ClientResult(job.client_id, None, describe(exc), math.nan), False
        started, cpu_started = time.perf_counter(), time.process_time()
        reply_blob, error, compute, cpu = None, None, math.nan, math.nan
        try:
            broadcast = self._decoded_broadcast(job.broadcast, broadcast_key)
            received = decode(job.task)
        except CodecError as exc:  # the coordinator's own bytes, so never in a run; a caller's mistake otherwise
            log.warning("client %s: %s", job.client_id, exc)
            error = describe(exc)
        else:
            try:
                reply = client.handle(received, broadcast)
            except (CodecError, ConfigError, ValueError) as exc:  # a client that cannot do its task says why
                reply = error_message(received, printable(str(exc)))
            except Exception as exc:  # a bug in a client step: an error for this client, logged with its traceback
                log.exception("client %s failed", job.client_id)
                error = describe(exc)
            compute, cpu = time.perf_counter() - started, time.process_time() - cpu_started
            if error is None:
                reply_blob = encode(reply)
        # The store goes back whatever happened, so the coordinator's copy always equals the worker's.
        state = encode_state(client.store) if job.return_state else None
        release_free_memory()
        return ClientResult(job.client_id, reply_blob, error, compute, cpu, state), bool(client.store)

    def load_state(self, client_id: ClientId, blob: bytes) -> None:
        """Replace the client's store with ``blob`` (:func:`encode_state`)."""
        client = self.clients.get(client_id)
        if client is None:
            client = self.clients[client_id] = self._build(client_id)
        client.store.clear()
        client.store.update(decode_state(blob))

    def has_broadcast(self, key: Hashable) -> bool:
        """Whether the broadcast of ``key`` is decoded already."""
        return key is not None and key == self._broadcast_key

    def _decoded_broadcast(self, blob: bytes | None, key: Hashable) -> Message | None:
        if blob is None:
            return None
        if key is None or key != self._broadcast_key:  # decoded once per round and worker, shared by its clients
            self._broadcast, self._broadcast_key = decode(blob), key
        return self._broadcast


class LocalExecutor(ExecutorBase):
    """What the executors that run their clients in this process share (:class:`~sim.executors.sequential.
    SequentialExecutor`, :class:`~sim.executors.batched.BatchedExecutor`): the clients given at construction, the
    rest built from ``factory`` on first need, one :class:`ClientHost`, ``threads_per_worker`` intra-op threads."""

    name = "local"
    workers = 1

    def __init__(
        self,
        factory: ClientFactory | None = None,
        *,
        clients: Mapping[ClientId, SimClient] | Iterable[SimClient] | None = None,
        threads_per_worker: int = 1,
    ) -> None:
        if factory is None and clients is None:
            raise ConfigError(f"the {self.name} executor needs clients or a client factory")
        check_threads(threads_per_worker)
        self.threads = threads_per_worker
        self._given = dict(clients.items()) if isinstance(clients, Mapping) else {c.client_id: c for c in clients or ()}
        self._factory = factory
        self._builder: ClientBuilder | None = None
        self._host = ClientHost(self._build)
        self._batch = 0  # rounds run: with id() of a round's broadcast blob, the key of its decoded copy

    def _client(self, client_id: ClientId) -> SimClient:
        """The client given at construction, or one from the factory (called once, on first need: given clients
        need none)."""
        given = self._given.get(client_id)
        if given is not None:
            return given
        if self._factory is None:
            raise ConfigError(f"{client_id!r} is not a client of this executor")
        if self._builder is None:
            self._builder = self._factory()
        return self._builder(client_id)

    def _build(self, client_id: ClientId) -> SimClient:
        """What the host runs for ``client_id`` (an executor may wrap the client)."""
        return self._client(client_id)

    def load_states(self, states: Mapping[ClientId, bytes]) -> None:
        for client_id, blob in states.items():
            self._host.load_state(client_id, blob)

    def drain_lost_state(self) -> list[ClientId]:
        return []  # nothing is ever lost in this process
