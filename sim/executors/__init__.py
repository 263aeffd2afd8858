"""Client executors: who computes a round's client steps, and where.

A transport (:class:`ExecutorTransport`) hands an executor one round's work as bytes (:class:`ClientJob`: the encoded
task and broadcast) and gets bytes back (:class:`ClientResult`: the encoded reply, or why there is none), so what
crosses a process or machine boundary is exactly what the in-process transport already encodes and counts. Three
executors, one module each:

- :class:`SequentialExecutor` (``sequential``): every client in this process, one after another (the reference);
- :class:`ProcessExecutor` (``processes``): a pool of worker processes on this machine (on Linux forked from a
  forkserver that imported torch once, else spawned), each with its share of threads;
- :class:`RayExecutor` (``ray_actors``): Ray actors on the cores and GPUs of a cluster (the optional extra
  ``fedge[ray]``);
- :class:`BatchedExecutor` (``batched``): every client in this process, their local training stacked into one
  model (torch.func vmap, ``stacked``), for a GPU.

The contract they share is in ``core``; how a worker hosts its clients in ``host``; which worker runs which client in
``placement``.

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

import logging
import os
from collections.abc import Iterable, Mapping

from fedge.errors import ConfigError
from fedge.types import ClientId
from sim.executors.batched import BatchedExecutor
from sim.executors.core import (
    ClientBuilder,
    ClientExecutor,
    ClientFactory,
    ClientJob,
    ClientResult,
    ExecutorError,
    SimClient,
    check_threads,
    decode_state,
    encode_state,
)
from sim.executors.gpu import gpu_sharing_advice, mps_pipe_dir
from sim.executors.host import ExperimentClients
from sim.executors.processes import ProcessExecutor
from sim.executors.ray_actors import RAY_INSTALL_HINT, RayExecutor, import_ray
from sim.executors.sequential import SequentialExecutor
from sim.executors.transport import ExecutorTransport

__all__ = [
    "EXECUTORS",
    "RAY_INSTALL_HINT",
    "BatchedExecutor",
    "ClientBuilder",
    "ClientExecutor",
    "ClientFactory",
    "ClientJob",
    "ClientResult",
    "ExecutorError",
    "ExecutorTransport",
    "ExperimentClients",
    "ProcessExecutor",
    "RayExecutor",
    "SequentialExecutor",
    "SimClient",
    "decode_state",
    "encode_state",
    "gpu_sharing_advice",
    "import_ray",
    "make_executor",
    "mps_pipe_dir",
    "overlap_choice",
    "usable_cores",
]

log = logging.getLogger(__name__)

EXECUTORS = ("sequential", "processes", "ray", "batched", "auto")
"""The names :func:`make_executor` accepts (the choices of ``fedge sim --executor``)."""


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def overlap_choice(executor: ClientExecutor, threads_per_worker: int, requested: bool | None) -> tuple[bool, str]:
    """Whether a round's evaluation overlaps the next round's client steps (:class:`coordinator.engine.RoundPipeline`)
    on ``executor``, and why. ``requested`` None is ``auto``: overlap only where a core is left over beside the workers'
    threads. On a 2-core machine with two 1-thread workers the overlapped evaluation competes with both workers for
    the cores: FedNTD's MNIST round took 9.80 s overlapped against 7.44 s without on an Intel Xeon (Sapphire Rapids),
    so the default would have been the slow choice there (``benchmarks/executors.py --overlap-blocks``)."""
    if executor.name in ("sequential", "batched"):
        # Clients that train in this process would share torch's process-wide settings (MKL's thread count) with
        # the evaluation thread, and their float sums could depend on timing: overlap only elsewhere.
        return False, f"the {executor.name} executor's clients train in this process"
    if requested is not None:
        return requested, "asked for"
    cores, busy = usable_cores(), executor.workers * threads_per_worker
    if cores > busy:
        return True, f"{cores - busy} of {cores} usable core(s) left over beside {busy} worker thread(s)"
    return False, f"no core left over beside {busy} worker thread(s) on {cores} usable core(s)"


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
    check_threads(threads_per_worker)
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
    if name == "batched":  # one process, like sequential: its clients' training runs stacked (sim.executors.stacked)
        return BatchedExecutor(factory, clients=clients, threads_per_worker=threads_per_worker)
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
