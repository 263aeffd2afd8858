"""Client executors: who computes a round's client steps, and where.

A transport hands an executor one round's work as bytes (:class:`ClientJob`: the encoded task and broadcast) and gets
bytes back (:class:`ClientResult`: the encoded reply, or why there is none), so what crosses a process or machine
boundary is exactly what the in-process transport already encodes and counts. Three executors:

- :class:`SequentialExecutor`: every client in this process, one after another (today's behaviour, the reference);
- :class:`ProcessExecutor`: a pool of worker processes on this machine (spawn), each with its share of threads;
- :class:`RayExecutor`: Ray actors on the cores and GPUs of a cluster (the optional extra ``fedge[ray]``).

Workers build their clients once, from a picklable :data:`ClientFactory` called once per worker (the standard one,
:class:`ExperimentClients`, loads and splits the run's dataset), not once per round. A client whose store is not empty
after a step (FD's and DS-FL's own models, SCAFFOLD's control variate) stays with the worker that holds that state;
a stateless client goes to the least loaded worker of its round. A worker that dies turns its outstanding clients into
errors (the engine records them as failed clients) and is replaced at the next round; the state it held is lost, and
a warning names the clients.

Reproducibility: a client's step is a deterministic function of its task, its data and its stored state, and replies
are aggregated in sorted order, but the float summation order of PyTorch's CPU kernels depends on the intra-op thread
count (fedavg_cnn's weights after one epoch differ by ~1e-7 between 1 and 2 threads). Every executor therefore runs
client steps with the same ``threads_per_worker`` (default 1), and all of them give the same global model bit for bit.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import math
import multiprocessing as mp
import os
import pickle
import signal
import statistics
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TypeVar

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from common.experiment import Experiment, prepare
from coordinator.replies import RoundContext, judge_reply
from coordinator.transport import Exchange, ReplyCheck
from edge_client.client import EdgeClient
from fedge.algorithms.base import RoundPlan
from fedge.backend import TorchBackend
from fedge.config import RunConfig
from fedge.errors import CodecError, ConfigError, FedgeError
from fedge.ledger import BROADCAST_CLIENT, LedgerEntry, uncompressed_bytes
from fedge.messages import Message, decode, encode
from fedge.protocol import error_message
from fedge.records import ClientTiming, Drop
from fedge.types import ClientId
from fedge.wire import printable

log = logging.getLogger(__name__)

EXECUTORS = ("sequential", "processes", "ray", "auto")
"""The names :func:`make_executor` accepts (the choices of ``fedge sim --executor``)."""

RAY_INSTALL_HINT = "pip install 'fedge[ray]'"


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


@dataclass(frozen=True)
class ExperimentClients:
    """The standard client factory: a run's PyTorch clients, as :func:`sim.run.run_inprocess` builds them.

    With ``experiment`` None each worker calls :func:`common.experiment.prepare` on ``config`` (it reads the dataset
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


# --- the executors ------------------------------------------------------------------------------------------------


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


_Self = TypeVar("_Self", bound="_Closing")


class _Closing:
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


class _ClientHost:
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
            return ClientResult(job.client_id, None, _describe(exc), math.nan), False
        started, cpu_started = time.perf_counter(), time.process_time()
        reply_blob, error, compute, cpu = None, None, math.nan, math.nan
        try:
            broadcast = self._decoded_broadcast(job.broadcast, broadcast_key)
            received = decode(job.task)
        except CodecError as exc:  # the coordinator's own bytes, so never in a run; a caller's mistake otherwise
            log.warning("client %s: %s", job.client_id, exc)
            error = _describe(exc)
        else:
            try:
                reply = client.handle(received, broadcast)
            except (CodecError, ConfigError, ValueError) as exc:  # a client that cannot do its task says why
                reply = error_message(received, printable(str(exc)))
            except Exception as exc:  # a bug in a client step: an error for this client, logged with its traceback
                log.exception("client %s failed", job.client_id)
                error = _describe(exc)
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


class SequentialExecutor(_Closing):
    """Every client in this process, one after the other, with ``threads_per_worker`` intra-op threads (the
    reference; the thread count is restored after each round, so the coordinator's own work keeps its threads)."""

    name = "sequential"
    workers = 1

    def __init__(
        self,
        factory: ClientFactory | None = None,
        *,
        clients: Mapping[ClientId, SimClient] | Iterable[SimClient] | None = None,
        threads_per_worker: int = 1,
    ) -> None:
        if factory is None and clients is None:
            raise ConfigError("the sequential executor needs clients or a client factory")
        _check_threads(threads_per_worker)
        self.threads = threads_per_worker
        built = dict(clients.items()) if isinstance(clients, Mapping) else {c.client_id: c for c in clients or ()}
        self._factory = factory
        self._builder: ClientBuilder | None = None
        self._host = _ClientHost(self._build, built)
        self._batch = 0

    def _build(self, client_id: ClientId) -> SimClient:
        """A client not given at construction, from the factory (called on first need: given clients need none)."""
        if self._factory is None:
            raise ConfigError(f"{client_id!r} is not a client of this executor")
        if self._builder is None:
            self._builder = self._factory()
        return self._builder(client_id)

    def load_states(self, states: Mapping[ClientId, bytes]) -> None:
        for client_id, blob in states.items():
            self._host.load_state(client_id, blob)

    def drain_lost_state(self) -> list[ClientId]:
        return []  # nothing is ever lost in this process

    def run(self, jobs: Sequence[ClientJob]) -> list[ClientResult]:
        _check_unique(jobs)
        self._batch += 1
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            # id() of a blob is a fine key within one batch: every job holds a reference to it until the batch ends.
            return [self._host.run(job, (self._batch, id(job.broadcast)))[0] for job in jobs]
        finally:
            torch.set_num_threads(previous)

    def stream(self, jobs: Sequence[ClientJob]) -> Iterator[ClientResult]:
        """One client at a time: each result is handed over before the next client runs."""
        _check_unique(jobs)
        self._batch += 1
        batch = self._batch
        for job in jobs:
            previous = torch.get_num_threads()
            torch.set_num_threads(self.threads)
            try:
                result = self._host.run(job, (batch, id(job.broadcast)))[0]
            finally:
                torch.set_num_threads(previous)
            yield result


class _Assignment:
    """Which worker runs which client: a client with state stays where its state is; the others balance the load.

    The load of a client is its last measured compute time (unknown ones count as the median), and free clients go,
    longest first, to the least loaded worker (LPT). Where a client runs never changes its result, only the speed.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.owner: dict[ClientId, int] = {}
        self.cost: dict[ClientId, float] = {}

    def plan(self, jobs: Sequence[ClientJob]) -> list[list[int]]:
        """Job indices per worker, each list in the round's order."""
        typical = statistics.median(self.cost.values()) if self.cost else 1.0
        load = [0.0] * self.workers
        plan: list[list[int]] = [[] for _ in range(self.workers)]
        free = []
        for i, job in enumerate(jobs):
            owner = self.owner.get(job.client_id)
            if owner is None:
                free.append(i)
            else:
                plan[owner].append(i)
                load[owner] += self.cost.get(job.client_id, typical)
        free.sort(key=lambda i: (-self.cost.get(jobs[i].client_id, typical), jobs[i].client_id))
        for i in free:
            w = min(range(self.workers), key=lambda w: (load[w], w))
            plan[w].append(i)
            load[w] += self.cost.get(jobs[i].client_id, typical)
        return [sorted(p) for p in plan]

    def observe(self, worker: int, result: ClientResult, stateful: bool) -> None:
        if result.error is None and math.isfinite(result.compute_s):
            self.cost[result.client_id] = result.compute_s
        if stateful:
            self.owner[result.client_id] = worker

    def place(self, clients: Iterable[ClientId]) -> dict[ClientId, int]:
        """Pin ``clients`` (given state from outside) to the workers holding the fewest pinned clients."""
        counts = [0] * self.workers
        for w in self.owner.values():
            counts[w] += 1
        placed = {}
        for client in sorted(clients):
            if client not in self.owner:
                self.owner[client] = min(range(self.workers), key=lambda w: (counts[w], w))
                counts[self.owner[client]] += 1
            placed[client] = self.owner[client]
        return placed

    def forget_worker(self, worker: int) -> list[ClientId]:
        """Unpin the clients whose state lived in ``worker``; returns them, sorted."""
        lost = sorted(c for c, w in self.owner.items() if w == worker)
        for c in lost:
            del self.owner[c]
        return lost


@dataclass
class _Worker:
    index: int
    process: BaseProcess
    conn: Connection
    ready: bool = False  # it built its clients


class ProcessExecutor(_Closing):
    """A pool of ``workers`` processes on this machine, started with ``start_method`` (spawn: no inherited threads or
    locks), each building its clients once from ``factory`` and running its jobs with ``threads_per_worker`` threads.

    ``timeout_s``: a round whose jobs are not all back after this many seconds stops the workers still busy and turns
    their outstanding clients into errors (None: wait as long as the workers live; a dead worker is noticed at once).
    """

    name = "processes"

    def __init__(
        self,
        factory: ClientFactory,
        workers: int,
        *,
        threads_per_worker: int = 1,
        timeout_s: float | None = None,
        start_method: str = "spawn",
    ) -> None:
        if workers < 1:
            raise ConfigError(f"the processes executor needs at least 1 worker, got {workers}")
        _check_threads(threads_per_worker)
        self.workers = workers
        self.threads = threads_per_worker
        self.timeout_s = timeout_s
        self._factory = factory
        self._ctx: Any = mp.get_context(start_method)  # typeshed's BaseContext lacks Process
        self._assign = _Assignment(workers)
        self._lost: set[ClientId] = set()
        self._batch = 0
        self._closed = False
        self._slots: list[_Worker | None] = [None] * workers
        try:
            for i in range(workers):
                self._slots[i] = self._start(i)
        except BaseException:
            self._terminate()
            raise
        log.info("processes executor: %d workers x %d thread(s)", workers, threads_per_worker)

    def _start(self, index: int) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=_worker_main,
            args=(index, child, self._factory, self.threads),
            name=f"fedge-worker-{index}",
            daemon=True,  # multiprocessing stops daemonic workers when this process exits
        )
        try:
            process.start()
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # spawn pickles the factory here
            parent.close()
            raise ConfigError(
                f"the client factory cannot be sent to a worker process ({_describe(exc)}); pass a picklable one, "
                "such as sim.executors.ExperimentClients"
            ) from exc
        finally:
            child.close()
        return _Worker(index, process, parent)

    def run(self, jobs: Sequence[ClientJob]) -> list[ClientResult]:
        if self._closed:
            raise ExecutorError("the processes executor is closed")
        _check_unique(jobs)
        try:
            self._replace_dead_workers()
            self._batch += 1
            results: list[ClientResult | None] = [None] * len(jobs)
            batches = {w: indices for w, indices in enumerate(self._assign.plan(jobs)) if indices}
            for w in list(batches):
                if not self._send(w, [jobs[i] for i in batches[w]]):
                    self._check_started(w)
                    self._lose(w, batches.pop(w), jobs, results, "died")
            self._collect(jobs, batches, results)
        except BaseException:  # KeyboardInterrupt, an unusable factory: stop every worker, leave no orphans
            self._terminate()
            raise
        return [r for r in results if r is not None]

    def load_states(self, states: Mapping[ClientId, bytes]) -> None:
        if self._closed:
            raise ExecutorError("the processes executor is closed")
        try:
            self._replace_dead_workers()
            by_worker: dict[int, dict[ClientId, bytes]] = {}
            for client, w in self._assign.place(states).items():
                by_worker.setdefault(w, {})[client] = states[client]
            for w, part in sorted(by_worker.items()):
                slot = self._slots[w]
                assert slot is not None
                with contextlib.suppress(OSError, EOFError):  # it reads this before its next batch; if it dies
                    slot.conn.send(("load", part))  # first, run() reports the loss
        except BaseException:
            self._terminate()
            raise

    def drain_lost_state(self) -> list[ClientId]:
        lost, self._lost = sorted(self._lost), set()
        return lost

    def _replace_dead_workers(self) -> None:
        for i, slot in enumerate(self._slots):
            if slot is None:
                log.warning("restarting worker %d", i)
                self._slots[i] = self._start(i)

    def _send(self, w: int, jobs: list[ClientJob]) -> bool:
        """Send worker ``w`` its jobs of this round; False if it is gone."""
        slot = self._slots[w]
        assert slot is not None
        blobs: list[bytes] = []
        positions: dict[int, int] = {}
        wire_jobs = []
        for job in jobs:  # each distinct broadcast once per worker and round, not once per job
            b = None
            if job.broadcast is not None:
                b = positions.setdefault(id(job.broadcast), len(blobs))
                if b == len(blobs):
                    blobs.append(job.broadcast)
            wire_jobs.append((job.client_id, job.task, b, job.return_state))
        try:
            slot.conn.send(("batch", self._batch, blobs, wire_jobs))
            return True
        except (OSError, EOFError):
            return False

    def _collect(
        self, jobs: Sequence[ClientJob], batches: dict[int, list[int]], results: list[ClientResult | None]
    ) -> None:
        """Wait for every batch's results, or for its worker's death, or for the deadline."""
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        outstanding = {w: set(range(len(indices))) for w, indices in batches.items()}

        def lose(w: int, reason: str) -> None:
            self._lose(w, [batches[w][k] for k in sorted(outstanding.pop(w))], jobs, results, reason)

        while outstanding:
            waitables: dict[Any, int] = {}
            for w in outstanding:
                slot = self._slots[w]
                assert slot is not None
                waitables[slot.conn] = w
                waitables[slot.process.sentinel] = w
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(waitables), timeout)
            if not ready:
                for w in sorted(outstanding):
                    lose(w, f"gave no result within {self.timeout_s} s: stopped")
                return
            for w in sorted({waitables[obj] for obj in ready}):
                slot = self._slots[w]
                assert slot is not None
                try:
                    while outstanding[w] and slot.conn.poll():  # results it sent before dying count
                        self._receive(w, slot.conn.recv(), batches[w], outstanding[w], results)
                except (EOFError, OSError):  # its end of the pipe is closed: it is exiting (or must be stopped)
                    slot.process.join(1.0)
                    if slot.process.is_alive():
                        lose(w, "closed its pipe: stopped")
                        continue
                if not outstanding[w]:
                    del outstanding[w]
                elif not slot.process.is_alive():
                    self._check_started(w)
                    lose(w, _exit_reason(slot.process.exitcode))

    def _check_started(self, w: int) -> None:
        """Worker ``w`` is dead: an ExecutorError if it died before building its clients (it would die again at
        every restart: a set-up problem, not a client's)."""
        slot = self._slots[w]
        assert slot is not None
        with contextlib.suppress(EOFError, OSError):
            while not slot.ready and slot.conn.poll():
                msg = slot.conn.recv()
                if msg[0] == "init-error":
                    raise ExecutorError(f"worker {w} could not build its clients: {msg[1]}")
                slot.ready = msg[0] == "ready"
        slot.process.join(1.0)
        if not slot.ready:
            raise ExecutorError(
                f"worker {w} {_exit_reason(slot.process.exitcode)} while building its clients (its error output "
                "says why; a script that starts executors needs `if __name__ == '__main__':`)"
            )

    def _receive(
        self,
        w: int,
        msg: tuple[Any, ...],
        indices: list[int],
        outstanding: set[int],
        results: list[ClientResult | None],
    ) -> None:
        if msg[0] == "init-error":
            raise ExecutorError(f"worker {w} could not build its clients: {msg[1]}")
        if msg[0] == "ready":
            slot = self._slots[w]
            assert slot is not None
            slot.ready = True
        if msg[0] == "result" and msg[1] == self._batch:
            _, _, k, result, stateful = msg
            results[indices[k]] = result
            outstanding.discard(k)
            self._assign.observe(w, result, stateful)

    def _lose(
        self, w: int, lost: list[int], jobs: Sequence[ClientJob], results: list[ClientResult | None], reason: str
    ) -> None:
        """Worker ``w`` is gone: the jobs ``lost`` become errors, its process is stopped, its clients unpinned."""
        slot = self._slots[w]
        assert slot is not None
        text = f"worker {w} (pid {slot.process.pid}) {reason}"
        _stop(slot)
        self._slots[w] = None
        for i in lost:
            results[i] = ClientResult(jobs[i].client_id, None, text, math.nan)
        log.error("%s; its clients %s get no update this round", text, [jobs[i].client_id for i in lost])
        lost_state = self._assign.forget_worker(w)
        if lost_state:
            self._lost.update(lost_state)
            log.warning("the state kept by clients %s was lost with worker %d", lost_state, w)

    def close(self) -> None:
        """Ask every worker to stop, wait up to 5 s, then terminate what is left."""
        if self._closed:
            return
        self._closed = True
        for slot in self._slots:
            if slot is not None:
                with contextlib.suppress(OSError, EOFError):  # already gone
                    slot.conn.send(("stop",))
        deadline = time.monotonic() + 5.0
        for slot in self._slots:
            if slot is not None:
                slot.process.join(max(0.0, deadline - time.monotonic()))
                _stop(slot)
        self._slots = [None] * self.workers

    def _terminate(self) -> None:
        self._closed = True
        for slot in self._slots:
            if slot is not None:
                _stop(slot)
        self._slots = [None] * self.workers


def _worker_main(index: int, conn: Connection, factory: ClientFactory, threads: int) -> None:
    """A worker process: build the clients' shared data once, then run batches of jobs until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent stops us
    torch.set_num_threads(threads)
    _exit_with_parent()
    try:
        host = _ClientHost(factory())
        _warm_up()
    except Exception as exc:
        log.exception("worker %d could not build its clients", index)
        _send_or_exit(conn, ("init-error", _describe(exc)))
        return
    _send_or_exit(conn, ("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if msg[0] == "load":
            for client_id, blob in msg[1].items():
                try:
                    host.load_state(client_id, blob)
                except Exception:  # the client then runs without its state: say so loudly
                    log.exception("worker %d could not restore the state of client %s", index, client_id)
            continue
        if msg[0] != "batch":
            return
        _, batch, blobs, wire_jobs = msg
        for k, (client_id, task, b, want_state) in enumerate(wire_jobs):
            job = ClientJob(client_id, task, None if b is None else blobs[b], want_state)
            result, stateful = host.run(job, (batch, b))
            _send_or_exit(conn, ("result", batch, k, result, stateful))


def _warm_up() -> None:
    """Pay torch's one-time lazy imports now, while the coordinator sets up, not in the first round: building the
    first optimizer imports torch.distributed (about 1 s)."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def _send_or_exit(conn: Connection, msg: tuple[Any, ...]) -> None:
    try:
        conn.send(msg)
    except (OSError, EOFError):  # the parent is gone: nobody wants the rest
        os._exit(0)


def _exit_with_parent() -> None:
    """Exit within a second of the parent's death, even in the middle of a long client step (no orphans)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="fedge-parent-watch", daemon=True).start()


def _stop(slot: _Worker) -> None:
    """Terminate (then kill) the worker's process if it still runs; close the pipe."""
    if slot.process.is_alive():
        slot.process.terminate()
        slot.process.join(2.0)
    if slot.process.is_alive():
        slot.process.kill()
        slot.process.join(2.0)
    slot.conn.close()


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"died of {signal.Signals(-code).name}"
        except ValueError:
            return f"died of signal {-code}"
    return f"died with exit code {code}"


# --- Ray ------------------------------------------------------------------------------------------------------------


def import_ray() -> Any:
    """The ``ray`` module, or a ConfigError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"the ray executor needs Ray, an optional extra: {RAY_INSTALL_HINT}") from None
    return ray


class _RayClientWorker:
    """The body of a Ray actor: the clients it owns, built once from the factory (which Ray resolves from the object
    store, where the driver put it once)."""

    def __init__(self, factory: ClientFactory, threads: int) -> None:
        torch.set_num_threads(threads)
        self._host = _ClientHost(factory())
        _warm_up()

    def ready(self) -> int:
        return os.getpid()

    def load(self, states: Mapping[ClientId, bytes]) -> None:
        for client_id, blob in states.items():
            self._host.load_state(client_id, blob)

    def run(
        self, client_id: ClientId, task: bytes, broadcast: list[Any], return_state: bool = False
    ) -> tuple[ClientResult, bool]:
        """One job; ``broadcast`` is [] or [the ObjectRef of the round's broadcast] (nested, so Ray does not fetch
        it for every job: it is fetched and decoded once per round)."""
        blob, key = None, None
        if broadcast:
            key = broadcast[0].hex()
            # b"" stands for a broadcast this actor already decoded under ``key``
            blob = b"" if self._host.has_broadcast(key) else import_ray().get(broadcast[0])
        return self._host.run(ClientJob(client_id, task, blob, return_state), key)


class RayExecutor(_Closing):
    """``workers`` Ray actors, each owning its clients, reserving ``threads_per_worker`` CPUs and ``gpus_per_worker``
    (fractional) GPUs. Joins the running Ray instance, or ``address``, or starts a local one (stopped on close).

    The factory is put in the object store once; with :class:`ExperimentClients` carrying a prepared experiment, that
    is where the dataset lives (actors on one node share it), so cluster nodes need no dataset files, only fedge.
    """

    name = "ray"

    def __init__(
        self,
        factory: ClientFactory,
        workers: int,
        *,
        threads_per_worker: int = 1,
        gpus_per_worker: float = 0.0,
        address: str | None = None,
        timeout_s: float | None = None,
        start_timeout_s: float = 300.0,
        max_parallel: int | None = None,
    ) -> None:
        ray = import_ray()
        if workers < 0:
            raise ConfigError(f"the ray executor needs workers >= 0 (0: one per CPU of the cluster), got {workers}")
        _check_threads(threads_per_worker)
        if gpus_per_worker < 0:
            raise ConfigError(f"gpus_per_worker must be >= 0, got {gpus_per_worker}")
        self._ray = ray
        self.workers = workers
        self.threads = threads_per_worker
        self.gpus = gpus_per_worker
        self.timeout_s = timeout_s
        self._closed = False
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=address, include_dashboard=False)
        if not workers:  # one actor per CPU of the cluster, as far as a round has clients for them
            workers = max(1, int(ray.cluster_resources().get("CPU", 1)) // threads_per_worker)
            workers = min(workers, max_parallel or workers)
            self.workers = workers
        self._actors: list[Any] = []
        try:
            self._check_resources()
            self._factory_ref = ray.put(factory)
            self._actor_class = ray.remote(_RayClientWorker)
            self._actors = [self._start() for _ in range(workers)]
            ray.get([a.ready.remote() for a in self._actors], timeout=start_timeout_s)
        except Exception as exc:
            self.close()
            if isinstance(exc, ray.exceptions.GetTimeoutError):
                raise ExecutorError(f"Ray actors were not ready within {start_timeout_s} s") from exc
            if isinstance(exc, ray.exceptions.RayError):
                raise ExecutorError(f"a Ray actor could not build its clients: {exc}") from exc
            raise
        self._assign = _Assignment(workers)
        self._lost: set[ClientId] = set()
        log.info("ray executor: %d actors x %d CPU(s), %.2f GPU(s) each", workers, threads_per_worker, gpus_per_worker)

    def _check_resources(self) -> None:
        """Refuse up front what the cluster cannot place (Ray would leave the actors pending forever)."""
        total = self._ray.cluster_resources()
        cpus, gpus = total.get("CPU", 0.0), total.get("GPU", 0.0)
        if self.workers * self.threads > cpus:
            raise ConfigError(
                f"{self.workers} Ray workers x {self.threads} CPU(s) need {self.workers * self.threads} CPUs; "
                f"the cluster has {cpus:g}"
            )
        if self.gpus > 0 and self.workers * self.gpus > gpus + 1e-9:
            raise ConfigError(f"{self.workers} Ray workers x {self.gpus:g} GPU need more GPUs than the {gpus:g} there")

    def _start(self) -> Any:
        options = {"num_cpus": self.threads, "num_gpus": self.gpus, "max_restarts": 0}
        return self._actor_class.options(**options).remote(self._factory_ref, self.threads)

    def _replace_dead_actors(self) -> None:
        for w, actor in enumerate(self._actors):
            if actor is None:
                log.warning("restarting Ray worker %d", w)
                self._actors[w] = self._start()

    def load_states(self, states: Mapping[ClientId, bytes]) -> None:
        if self._closed:
            raise ExecutorError("the ray executor is closed")
        self._replace_dead_actors()
        by_worker: dict[int, dict[ClientId, bytes]] = {}
        for client, w in self._assign.place(states).items():
            by_worker.setdefault(w, {})[client] = states[client]
        futures = [self._actors[w].load.remote(part) for w, part in sorted(by_worker.items())]
        try:
            self._ray.get(futures, timeout=self.timeout_s)
        except self._ray.exceptions.RayError as exc:
            raise ExecutorError(f"Ray workers could not take the clients' stored state: {exc}") from exc

    def drain_lost_state(self) -> list[ClientId]:
        lost, self._lost = sorted(self._lost), set()
        return lost

    def run(self, jobs: Sequence[ClientJob]) -> list[ClientResult]:
        if self._closed:
            raise ExecutorError("the ray executor is closed")
        _check_unique(jobs)
        ray = self._ray
        try:
            self._replace_dead_actors()
            refs: dict[int, Any] = {}  # id(blob) -> ObjectRef: each broadcast put in the object store once
            futures: list[tuple[int, int, Any]] = []
            for w, indices in enumerate(self._assign.plan(jobs)):
                for i in indices:
                    job = jobs[i]
                    nested = []
                    if job.broadcast is not None:
                        if id(job.broadcast) not in refs:
                            refs[id(job.broadcast)] = ray.put(job.broadcast)
                        nested = [refs[id(job.broadcast)]]
                    remote = self._actors[w].run.remote(job.client_id, job.task, nested, job.return_state)
                    futures.append((w, i, remote))
            return self._collect(jobs, futures)
        except KeyboardInterrupt:
            self.close()
            raise

    def _collect(self, jobs: Sequence[ClientJob], futures: list[tuple[int, int, Any]]) -> list[ClientResult]:
        ray = self._ray
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        results: list[ClientResult | None] = [None] * len(jobs)
        lost: dict[int, str] = {}  # worker -> why
        for w, i, future in futures:
            if w in lost:
                results[i] = ClientResult(jobs[i].client_id, None, lost[w], math.nan)
                continue
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                result, stateful = ray.get(future, timeout=timeout)
                results[i] = result
                self._assign.observe(w, result, stateful)
            except ray.exceptions.GetTimeoutError:
                lost[w] = f"Ray worker {w} gave no result within {self.timeout_s} s: stopped"
            except ray.exceptions.RayError as exc:  # the actor died (or its process did)
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                lost[w] = f"Ray worker {w} died: {printable(first)}"
            if w in lost:
                results[i] = ClientResult(jobs[i].client_id, None, lost[w], math.nan)
        for w, why in sorted(lost.items()):
            log.error("%s", why)
            ray.kill(self._actors[w], no_restart=True)
            self._actors[w] = None
            lost_state = self._assign.forget_worker(w)
            if lost_state:
                self._lost.update(lost_state)
                log.warning("the state kept by clients %s was lost with Ray worker %d", lost_state, w)
        return [r for r in results if r is not None]

    def close(self) -> None:
        """Kill the actors; stop Ray if this executor started it."""
        if self._closed:
            return
        self._closed = True
        for actor in self._actors:
            if actor is not None:
                try:
                    self._ray.kill(actor, no_restart=True)
                except Exception as exc:  # already gone: nothing to stop
                    log.debug("ray.kill: %s", exc)
        self._actors = []
        if self._owns_ray:
            self._ray.shutdown()


# --- the transport and the factory function -------------------------------------------------------------------------


class ExecutorTransport:
    """:class:`sim.inprocess.InProcessTransport` with the client steps handed to an executor: the same messages
    encoded, the same ledger entries in the same order, the same judging of replies.

    ``keep_stores``: keep a copy of every client's store here (:attr:`stores`, one dict per client, updated in place
    after each of its steps), for the run journal (pass ``stores=transport.stores``). What is in the copy before the
    first round (a resumed run's journal) is given to the workers, and so is a client's last state when a worker
    that held it died. Off, the clients' state lives only in the workers (memory for large FD/DS-FL runs).
    """

    def __init__(
        self,
        executor: ClientExecutor,
        clients: Iterable[ClientId],
        *,
        keep_stores: bool = True,
        declared: Mapping[ClientId, int] | None = None,
    ) -> None:
        self.executor = executor
        self.declared = dict(declared or {})  # each client's data size: the most num_examples it may report
        self._clients = sorted(clients)
        self._known = frozenset(self._clients)
        self.keep_stores = keep_stores
        self.stores: dict[ClientId, dict[str, torch.Tensor]] = {c: {} for c in self._clients} if keep_stores else {}
        self._changed: set[ClientId] = set()
        self._started = False

    def pop_changed(self) -> set[ClientId]:
        """The clients whose store copy changed since the last call (what the journal must write again)."""
        changed, self._changed = self._changed, set()
        return changed

    def available_clients(self) -> Sequence[ClientId]:
        return self._clients

    def exchange(self, plan: RoundPlan, check: ReplyCheck) -> Exchange:
        out = Exchange()
        if not plan.tasks:
            return out
        self._restore_states()
        rnd = next(iter(plan.tasks.values())).round
        ctx = RoundContext(
            rnd, frozenset(plan.tasks), check, known=lambda c: c in self._known, declared=self.declared.get
        )
        blob = None
        if plan.broadcast is not None:
            blob = encode(plan.broadcast)
            out.entries.append(LedgerEntry.of(plan.broadcast, "down", BROADCAST_CLIENT, len(blob), len(plan.tasks)))
        ordered = sorted(plan.tasks.items())
        jobs = [ClientJob(client_id, encode(task), blob, self.keep_stores) for client_id, task in ordered]
        # One result at a time: a 1,000-client round would otherwise hold every client's returned store at once.
        for (client_id, task), job, result in zip(ordered, jobs, self.executor.stream(jobs), strict=True):
            out.entries.append(LedgerEntry.of(task, "down", client_id, len(job.task), 1))
            if result.state is not None and client_id in self.stores:
                store = self.stores[client_id]
                store.clear()
                store.update(decode_state(result.state))
                self._changed.add(client_id)
            reply_blob = result.reply
            if reply_blob is None:  # crashed or lost: recorded like a client that reported its failure
                reply_blob = encode(error_message(task, printable(result.error or "no reply")))
            judged = judge_reply(reply_blob, client_id, ctx)
            kind = judged.message.kind if judged.message is not None else "invalid"
            tensor_bytes = judged.message.tensor_bytes if judged.message is not None else 0
            raw = uncompressed_bytes(judged.message) if judged.message is not None else 0
            out.entries.append(LedgerEntry(rnd, "up", client_id, kind, 1, tensor_bytes, len(reply_blob), 0, raw))
            if judged.accepted and judged.message is not None:
                out.replies[client_id] = judged.message
                out.timings.append(ClientTiming(client_id, result.compute_s, result.compute_s, result.cpu_s))
            else:
                assert judged.rejection is not None
                out.rejections.append(judged.rejection)
                out.drops.append(Drop(client_id, judged.rejection.reason))
        return out

    def _restore_states(self) -> None:
        """Before the first round, the copies a journal restored; later, those of clients a dead worker held."""
        lost = self.executor.drain_lost_state()
        if not self.keep_stores:
            return
        wanted = self._clients if not self._started else lost
        self._started = True
        states = {c: encode_state(self.stores[c]) for c in wanted if self.stores.get(c)}
        if states:
            log.info("giving %d client(s) their stored state: %s", len(states), sorted(states)[:10])
            self.executor.load_states(states)


def mps_pipe_dir() -> Path:
    """Where the NVIDIA MPS control daemon keeps its pipes: ``CUDA_MPS_PIPE_DIRECTORY``, else the driver's default."""
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps")


def gpu_sharing_advice(device: str, executor: str, workers: int, pipe_dir: Path | None = None) -> str | None:
    """What to tell a user whose ``workers`` processes will share one CUDA GPU without NVIDIA MPS, else None.

    Without MPS the GPU runs one process's kernels at a time, and a client step is many small kernels, so the
    workers mostly wait for their turn; with MPS (one daemon, started by the GPU's owner) they run side by side.
    """
    if not device.startswith("cuda") or executor == "sequential" or workers < 2:
        return None
    if ((pipe_dir or mps_pipe_dir()) / "control").exists():
        return None
    return (
        f"{workers} worker processes share the GPU without NVIDIA MPS, so their kernels take turns; start MPS first "
        "(`nvidia-cuda-mps-control -d`) to run them side by side (an H200 with 15 workers under MPS ran a round of "
        "100 DS-FL clients in 2.5 s; docs/design.md)"
    )


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def make_executor(
    name: str,
    workers: int = 0,
    factory: ClientFactory | None = None,
    *,
    clients: Mapping[ClientId, SimClient] | Iterable[SimClient] | None = None,
    threads_per_worker: int = 1,
    gpus_per_worker: float = 0.0,
    max_parallel: int | None = None,
    ray_address: str | None = None,
    timeout_s: float | None = None,
) -> ClientExecutor:
    """The executor ``name`` (one of :data:`EXECUTORS`); use it as a context manager (it owns processes or actors).

    - ``workers``: 0 picks one per ``threads_per_worker`` usable cores of this machine (for ray: of the cluster),
      at most ``max_parallel`` (pass the clients per round: more workers than clients would idle);
    - ``factory``: builds the clients in each worker (picklable; needed by processes and ray);
    - ``clients``: clients already built here, for sequential (a generator is only consumed if sequential is chosen);
      without them sequential builds its clients with ``factory``;
    - ``threads_per_worker``: intra-op threads of every client step, in every executor (default 1): results are bit
      for bit the same across executors only with equal values, since thread counts change float summation order;
    - ``gpus_per_worker``: ray only, fractional GPUs per actor (build the clients with device ``cuda``);
    - ``timeout_s``: processes and ray: a round's results not back by then become errors and the workers still
      busy are replaced (None: wait as long as the workers live).

    ``auto`` picks processes when at least two workers fit and a factory is given, else sequential, and logs why.
    """
    if name not in EXECUTORS:
        raise ConfigError(f"unknown executor {name!r}; choose one of {', '.join(EXECUTORS)}")
    _check_threads(threads_per_worker)
    if workers < 0:
        raise ConfigError(f"workers must be >= 0 (0: one per {threads_per_worker} core(s)), got {workers}")
    cores = usable_cores()
    fit = max(1, cores // threads_per_worker)
    if max_parallel is not None:
        fit = max(1, min(fit, max_parallel))
    if name == "auto":
        chosen = workers or fit
        if factory is None:
            name, why = "sequential", "no picklable client factory (clients with their own runtimes)"
        elif chosen < 2:
            name, why = "sequential", f"1 worker fits ({cores} usable core(s), {max_parallel} client(s) per round)"
        else:
            name, why = "processes", f"{chosen} workers x {threads_per_worker} thread(s) on {cores} usable cores"
        log.info("executor auto: %s (%s)", name, why)
    if name == "sequential":
        if workers > 1:
            log.warning("the sequential executor runs one client at a time: --workers %d ignored", workers)
        return SequentialExecutor(factory, clients=clients, threads_per_worker=threads_per_worker)
    if factory is None:
        raise ConfigError(f"the {name} executor needs a picklable client factory")
    if name == "processes":
        return ProcessExecutor(factory, workers or fit, threads_per_worker=threads_per_worker, timeout_s=timeout_s)
    return RayExecutor(  # workers 0: one per CPU of the cluster (not of this machine)
        factory,
        workers,
        threads_per_worker=threads_per_worker,
        gpus_per_worker=gpus_per_worker,
        address=ray_address,
        timeout_s=timeout_s,
        max_parallel=max_parallel,
    )


# --- small helpers --------------------------------------------------------------------------------------------------


def _check_threads(threads: int) -> None:
    if threads < 1:
        raise ConfigError(f"threads_per_worker must be >= 1, got {threads}")


def _check_unique(jobs: Sequence[ClientJob]) -> None:
    ids = [j.client_id for j in jobs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"a round gives each client at most one job; got {sorted(ids)}")


def _describe(exc: BaseException) -> str:
    return printable(f"{type(exc).__name__}: {exc}")
