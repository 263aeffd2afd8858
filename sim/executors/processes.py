"""The processes executor: a pool of worker processes on this machine, each owning the clients whose state it holds.

A worker that dies turns its outstanding clients into errors (the engine records them as failed clients) and is
replaced at the next round; the state it held is lost, and a warning names the clients.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from fedge.errors import ConfigError
from fedge.types import ClientId
from sim.executors.core import (
    ClientFactory,
    ClientJob,
    ClientResult,
    ExecutorBase,
    ExecutorError,
    check_threads,
    check_unique,
    describe,
)
from sim.executors.host import ClientHost
from sim.executors.placement import Assignment

log = logging.getLogger(__name__)


@dataclass
class _Worker:
    index: int
    process: BaseProcess
    conn: Connection
    ready: bool = False  # it built its clients


class ProcessExecutor(ExecutorBase):
    """A pool of ``workers`` processes on this machine, each building its clients once from ``factory`` and running its
    jobs with ``threads_per_worker`` threads.

    ``start_method``: ``forkserver`` on Linux (Jetson boards included), else ``spawn``. Both start workers with no
    inherited threads or locks. macOS keeps spawn, Python's default there: a fork of a process that loaded Apple's
    system frameworks (as torch does) is not safe on macOS. A forkserver imports this module (torch and fedge's
    training stack) once (:mod:`sim.executors.forkserver_preload`), and each worker is a fork of it, so a worker
    starts without paying the seconds of CPU these imports cost a fresh interpreter. The forkserver lives as long as
    this process and keeps the environment it started with, so each worker is sent this process's environment at its
    start (``FEDGE_PLUGINS``, which ``--plugin`` sets, reaches it).

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
        start_method: str | None = None,
    ) -> None:
        if workers < 1:
            raise ConfigError(f"the processes executor needs at least 1 worker, got {workers}")
        check_threads(threads_per_worker)
        self.workers = workers
        self.threads = threads_per_worker
        self.timeout_s = timeout_s
        self._factory = factory
        method = start_method or default_start_method()
        if method not in mp.get_all_start_methods():
            raise ConfigError(
                f"start method {method!r} is not available here; choose one of {', '.join(mp.get_all_start_methods())}"
            )
        self.start_method = method
        self._ctx: Any = mp.get_context(method)  # typeshed's BaseContext lacks Process
        if method == "forkserver":  # only the first executor of a process starts the server: later calls change nothing
            self._ctx.set_forkserver_preload(["sim.executors.forkserver_preload"])
        self._assign = Assignment(workers)
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
        log.info("processes executor: %d workers x %d thread(s) (%s)", workers, threads_per_worker, method)

    def _start(self, index: int) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=_worker_main,
            args=(index, child, self._factory, self.threads, dict(os.environ)),
            name=f"fedge-worker-{index}",
            daemon=True,  # multiprocessing stops daemonic workers when this process exits
        )
        try:
            process.start()
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # spawn and forkserver pickle the factory here
            parent.close()
            raise ConfigError(
                f"the client factory cannot be sent to a worker process ({describe(exc)}); pass a picklable one, "
                "such as sim.executors.ExperimentClients"
            ) from exc
        finally:
            child.close()
        return _Worker(index, process, parent)

    def run(self, jobs: Sequence[ClientJob]) -> list[ClientResult]:
        return list(self.stream(jobs))

    def stream(self, jobs: Sequence[ClientJob]) -> Iterator[ClientResult]:
        """The results in the jobs' order, each as soon as it and every one before it are back: the caller decodes and
        judges the first replies while the workers still train the round's last clients, instead of all of them
        after the last one (CPU seconds the coordinator spent with every worker idle: ~25 ms a fedavg_cnn reply)."""
        if self._closed:
            raise ExecutorError("the processes executor is closed")
        check_unique(jobs)
        try:
            self._replace_dead_workers()
            self._batch += 1
            results: list[ClientResult | None] = [None] * len(jobs)
            batches = {w: indices for w, indices in enumerate(self._assign.plan(jobs)) if indices}
            for w in list(batches):
                if not self._send(w, [jobs[i] for i in batches[w]]):
                    self._check_started(w)
                    self._lose(w, batches.pop(w), jobs, results, "died")
            done = 0
            for _ in self._collect(jobs, batches, results):
                while done < len(jobs) and (result := results[done]) is not None:
                    done += 1
                    yield result
        except GeneratorExit:  # the caller stopped reading: a later batch ignores this one's late results
            raise
        except BaseException:  # KeyboardInterrupt, an unusable factory: stop every worker, leave no orphans
            self._terminate()
            raise

    @property
    def pids(self) -> list[int]:
        """The live workers' process ids (for CPU accounting from outside, as ``benchmarks/executors.py`` does)."""
        return [slot.process.pid for slot in self._slots if slot is not None and slot.process.pid is not None]

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
    ) -> Iterator[None]:
        """Wait for every batch's results, or for its worker's death, or for the deadline; yields whenever ``results``
        may have grown (and once at the end: every job then has its result)."""
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        outstanding = {w: set(range(len(indices))) for w, indices in batches.items()}

        def lose(w: int, reason: str) -> None:
            self._lose(w, [batches[w][k] for k in sorted(outstanding.pop(w))], jobs, results, reason)

        yield  # results of workers that died at the send
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
                yield
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
            yield

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


def default_start_method() -> str:
    """``forkserver`` on Linux, else ``spawn`` (see :class:`ProcessExecutor`)."""
    linux = sys.platform.startswith("linux")
    return "forkserver" if linux and "forkserver" in mp.get_all_start_methods() else "spawn"


def _worker_main(index: int, conn: Connection, factory: ClientFactory, threads: int, environ: dict[str, str]) -> None:
    """A worker process: build the clients' shared data once, then run batches of jobs until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent stops us
    os.environ.clear()  # the parent's environment now, not the forkserver's from when it started
    os.environ.update(environ)
    torch.set_num_threads(threads)
    _exit_with_parent()
    try:
        host = ClientHost(factory())
    except Exception as exc:
        log.exception("worker %d could not build its clients", index)
        _send_or_exit(conn, ("init-error", describe(exc)))
        return
    _send_or_exit(conn, ("ready", os.getpid()))
    results = _ResultSender(conn)
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
            results.send(("result", batch, k, result, stateful))


class _ResultSender:
    """Sends a worker's results to the parent from a thread of its own, in order. Why: a result carries the reply (a
    few MB) and a pipe holds 64 KB, so a send lasts until the parent has read it all, and the parent reads while it
    judges the replies before it (:meth:`ProcessExecutor.stream`): sent from the training thread, the next client's
    step would wait for that."""

    def __init__(self, conn: Connection) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        threading.Thread(target=self._run, args=(conn,), name="fedge-result-sender", daemon=True).start()

    def send(self, msg: tuple[Any, ...]) -> None:
        self._queue.put(msg)

    def _run(self, conn: Connection) -> None:
        while True:
            _send_or_exit(conn, self._queue.get())


def _send_or_exit(conn: Connection, msg: tuple[Any, ...]) -> None:
    try:
        conn.send(msg)
    except (OSError, EOFError):  # the parent is gone: nobody wants the rest
        os._exit(0)


def _exit_with_parent() -> None:
    """Exit within a second of the parent's death, even in the middle of a long client step (no orphans). A forked
    worker's parent is the forkserver, which exits when the process that started it dies."""
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
