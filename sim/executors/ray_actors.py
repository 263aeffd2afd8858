"""The ray executor: Ray actors on the cores and GPUs of a cluster (the optional extra ``fedge[ray]``)."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fedge.errors import ConfigError
from fedge.types import ClientId
from fedge.wire.fields import printable
from sim.executors.core import (
    ClientFactory,
    ClientJob,
    ClientResult,
    ExecutorBase,
    ExecutorError,
    check_threads,
    check_unique,
)
from sim.executors.host import ClientHost
from sim.executors.placement import Assignment

log = logging.getLogger(__name__)

RAY_INSTALL_HINT = "pip install 'fedge[ray]'"


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
        self._host = ClientHost(factory())

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


class RayExecutor(ExecutorBase):
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
        check_threads(threads_per_worker)
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
        self._assign = Assignment(workers)
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
        check_unique(jobs)
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
