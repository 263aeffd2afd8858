"""In-process simulation: all clients in this process, messages really encoded and decoded."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coordinator.engine import RoundEngine
from coordinator.resume import RunJournal
from coordinator.transport import Transport
from edge_client.client import EdgeClient
from fedge.accounting.records import RoundRecord
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.learning.backend import Backend, TorchBackend
from fedge.privacy.summary import privacy_summary
from fedge.types import ClientId
from fedge_io.experiment import Experiment, prepare
from fedge_io.rundir import COMU_THRESHOLDS, RunResult
from sim.clock import SimClockTransport, load_profiles, measure_compute, time_summary
from sim.executors import ExecutorTransport, ExperimentClients, gpu_sharing_advice, make_executor, overlap_choice
from sim.fedbuff import FedBuffEngine, fedbuff_engine, fedbuff_summary

log = logging.getLogger(__name__)


def _measure(exp: Experiment, threads: int) -> float:
    """Seconds per sample-step of the run's model measured on this machine (``compute=measure``)."""
    model = exp.model_factory()
    return measure_compute(model, exp.input_shape, exp.num_classes, exp.config.train.batch_size, threads=threads)


def _stamped(
    prepare: Callable[[int], Callable[[RoundRecord], None]], clock: SimClockTransport, engine: RoundEngine
) -> Callable[[int], Callable[[RoundRecord], None]]:
    """``prepare`` whose commit writes the record with its simulated time (and keeps that record in the history)."""

    def prepared(rnd: int) -> Callable[[RoundRecord], None]:
        commit = prepare(rnd)

        def stamped(record: RoundRecord) -> None:
            timed = clock.stamp(record)
            rounds = engine.history.rounds
            if rounds and rounds[-1] is record:  # conclusions run in round order: this one was just appended
                rounds[-1] = timed
            commit(timed)

        return stamped

    return prepared


def _then(
    first: Callable[[RoundRecord], RoundRecord], then: Callable[[RoundRecord], None]
) -> Callable[[RoundRecord], None]:
    return lambda record: then(first(record))


def run_inprocess(
    config: RunConfig,
    run_dir: Path,
    *,
    device: str = "cpu",
    on_round: Callable[[RoundRecord], None] | None = None,
    experiment: Experiment | None = None,
    backend_for: Callable[[ClientId], Backend] | None = None,
    resume: bool = False,
    executor: str = "sequential",
    workers: int = 0,
    threads_per_worker: int = 1,
    overlap: bool | None = None,
) -> RunResult:
    """Run ``config`` with every client in this process and write ``run_dir``.

    ``backend_for``: each client's own runtime (e.g. a mixed fleet of PyTorch and ExecuTorch clients); by default all
    clients share one PyTorch backend, used in turn.
    ``resume``: continue the killed run in ``run_dir`` after its last completed round, from its journal (server and
    clients' state), with the same result bit for bit as a run that was never interrupted.
    ``executor``: who runs the clients' steps (:mod:`sim.executors`): ``sequential`` in this process, ``processes``
    (``workers`` processes), ``ray``, or ``auto``; every client step uses ``threads_per_worker`` torch threads, so all
    executors give the same model bit for bit.
    ``overlap``: when the clients train in other processes (not ``sequential``), evaluate each round's global model
    (and write the round's files) while the next round's clients train (:class:`coordinator.engine.RoundPipeline`):
    the same files, bit for bit, as without. None (auto): only where a core is left over beside the workers
    (:func:`sim.executors.overlap_choice`).
    """
    exp = experiment or prepare(config)
    config = exp.config  # resolved (e.g. DS-FL open-set sizes fitted to the dataset)
    run_id = run_dir.name
    open_x = exp.open_x()
    if backend_for is not None and executor not in ("sequential", "auto"):
        raise ConfigError(f"clients with their own runtimes (a mixed fleet) run only sequentially, not on {executor!r}")
    backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes, device=device)  # one runtime, shared in turn
    clients = (
        EdgeClient(c, exp.client_data(c, open_x), backend_for(c) if backend_for else backend) for c in sorted(exp.parts)
    )  # built only if the sequential executor is chosen
    factory = None
    if backend_for is None:
        factory = ExperimentClients(
            config, device, experiment=exp if experiment is not None or executor == "ray" else None
        )
    if config.buffered and not config.simulated_time:
        raise ConfigError(
            "--aggregation fedbuff in process runs on the simulated clock of fedge sim (each update arrives when its "
            "client's compute and transfers are done): give --client-profiles or --link (with compute=SECONDS for a "
            "reproducible run), or run it over MQTT on the real clock (--transport mqtt, fedge coordinator)"
        )
    strategy = exp.strategy(run_id, evaluation_device=device)  # a GPU run evaluates there too
    test_x, test_y = exp.test_tensors()
    sizes = {c: len(idx) for c, idx in exp.parts.items()}
    with make_executor(
        executor,
        workers,
        factory,
        clients=clients,
        threads_per_worker=threads_per_worker,
        max_parallel=config.clients_per_round,
    ) as exe:
        advice = gpu_sharing_advice(device, exe.name, exe.workers)
        if advice:
            log.warning(advice)
        inner = ExecutorTransport(exe, sorted(exp.parts), declared=sizes)
        transport: Transport = inner
        clock: SimClockTransport | None = None
        clock_about: dict[str, Any] = {}
        fedbuff: FedBuffEngine | None = None
        if config.simulated_time:  # docs/simulated_time.md
            profiles, clock_about = load_profiles(config, sorted(exp.parts), lambda: _measure(exp, threads_per_worker))
            if config.buffered:  # FedBuff keeps the clock itself, event by event
                if clock_about.get("reference_compute") != "given":
                    log.warning(
                        "FedBuff on a reference compute measured on this machine: the order in which updates arrive, "
                        "hence the model, depends on the measurement; give compute=SECONDS for a reproducible run"
                    )
                fedbuff = fedbuff_engine(
                    config, strategy, inner, test_x, test_y, profiles=profiles, samples=sizes,
                    initial_bytes=exp.initial_bytes(),
                )  # fmt: skip
            else:
                clock = SimClockTransport(
                    inner, profiles, sizes, config.train.local_epochs, deadline_s=config.sim_deadline
                )
                transport = clock
        engine = fedbuff or RoundEngine(config, strategy, transport, test_x, test_y, initial_bytes=exp.initial_bytes())
        overlap, why = overlap_choice(exe, threads_per_worker, overlap)
        log.info("evaluation %s the next round's clients: %s", "overlaps" if overlap else "runs before", why)
        journal = RunJournal(
            run_dir,
            config,
            exp.partition_summary(),
            engine,
            resume=resume,
            stores=inner.stores,
            changed=inner.pop_changed,
        )
        commits: Callable[[int], Callable[[RoundRecord], None]] = journal.prepare
        if clock is not None:
            clock.resume_at(engine.history.rounds)
            commits = _stamped(journal.prepare, clock, engine)
            if on_round is not None:  # the progress line and TensorBoard see the simulated time too
                on_round = _then(clock.stamp, on_round)
        history = engine.run(on_round, overlap=overlap, prepare=commits)
        extra = {
            "model": exp.model,
            "transport": "inprocess",
            "executor": exe.name,
            "workers": exe.workers,
            "device": device,
            "threads_per_worker": threads_per_worker,
            "overlap": overlap,
            "overlap_why": why,
        }
    summary = journal.finish(
        strategy.global_weights(),
        initial_bytes=exp.initial_bytes(),
        extra={
            **extra,
            **({"resumed_after": journal.resumed_after} if journal.resumed_after else {}),
            **privacy_summary(config, history.rounds, history.stopped),
            **(time_summary(history.rounds, COMU_THRESHOLDS, clock_about) if config.simulated_time else {}),
            **(fedbuff_summary(config, fedbuff) if fedbuff is not None else {}),
        },
    )
    return RunResult(run_dir, config, history.rounds, summary)
