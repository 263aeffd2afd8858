"""A coordinator run over MQTT: the experiment's strategy and test data, the round engine, the run directory.

The same set-up as :func:`sim.run.run_inprocess` (``fedge_io.experiment.prepare``), with :class:`MqttTransport` in place
of the in-process transport, so both write the same run directory and, for the same config and seeds, the same
global model.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from coordinator.broker_counters import compare_with_broker
from coordinator.engine import RoundEngine
from coordinator.fedbuff import buffered_strategy, fedbuff_summary
from coordinator.fleet_view import FleetMemory, about
from coordinator.kit.accounts import FleetSpec, admit_provisioned
from coordinator.kit.roster import Roster
from coordinator.kit.writer import FleetKit, generate_fleet_kit
from coordinator.mqtt import MAX_PAYLOAD_SLACK, MqttTransport
from coordinator.mqtt_fedbuff import MqttFedBuffEngine
from coordinator.resume import RunJournal
from coordinator.secagg_stages import MqttStages
from coordinator.stopping import GracefulStop
from fedge.accounting.records import RoundRecord
from fedge.algorithms.base import Strategy
from fedge.algorithms.catalog import get_algorithm
from fedge.algorithms.differential_privacy import DifferentialPrivacyStrategy
from fedge.algorithms.secure_aggregation import SecureAggregationStrategy
from fedge.config import RunConfig
from fedge.errors import ConfigError, FedgeError
from fedge.privacy.summary import privacy_summary
from fedge.wire.fields import printable
from fedge.wire.message import encode
from fedge.wire.protocol import BrokerAddress, ClientStatus
from fedge_io.console import round_line
from fedge_io.experiment import Experiment, prepare
from fedge_io.mqtt import PacketLimit
from fedge_io.rundir import RunResult
from fedge_io.signals import Terminated

log = logging.getLogger(__name__)

COORDINATOR_LOG = "coordinator.log"
STOPPED = (
    "run stopped by %s: leaving now (the round under way is not kept; the clients stay, waiting for a coordinator); "
    "the journal keeps the completed rounds, and the same command with --run-dir (or --resume RUN_DIR) continues after"
    " them"
)
STOPPED_AFTER = (
    "run stopped by %s %s: the journal keeps it; the clients stay, waiting for a coordinator; the same command with "
    "--run-dir (or --resume RUN_DIR) continues after it"
)


def refuse_secure_aggregation(config: RunConfig) -> None:
    """ConfigError for what secure aggregation cannot do over MQTT: simulated dropouts (the simulator's)."""
    if config.secure_aggregation and config.simulate_dropouts:
        raise ConfigError(
            "--simulate-dropouts is for fedge sim without --transport mqtt: over MQTT the clients that vanish are real"
        )


def refuse_noise_seed(config: RunConfig) -> None:
    """ConfigError when a deployment (``fedge coordinator``, ``fedge provision``) is given ``--dp-noise-seed``: a
    seeded noise is a simulation's, reproducible by anyone who reads config.json, so it protects nothing."""
    if config.dp_noise_seed is not None:
        raise ConfigError("--dp-noise-seed makes the noise predictable: it is for fedge sim only, not a deployment")


def refuse_simulated_time(config: RunConfig) -> None:
    """ConfigError when ``config`` asks for a simulated clock: a coordinator runs on the real one."""
    if config.simulated_time or config.sim_deadline:
        raise ConfigError(
            "--client-profiles, --link and --sim-deadline are for fedge sim (simulated time); a coordinator's "
            "rounds take real time (see --round-timeout)"
        )


def admission_rule(exp: Experiment) -> Callable[[ClientStatus], str | None]:
    """Refuse clients whose model, input shape, classes, open set or algorithms do not match this run."""
    algorithm = exp.config.algorithm
    open_x = exp.open_x()

    def admit(s: ClientStatus) -> str | None:
        if s.model and s.model != exp.model:
            return f"its data is for model {s.model!r}, this run trains {exp.model!r}"
        if s.input_shape and tuple(s.input_shape) != tuple(exp.input_shape):
            return f"input shape {list(s.input_shape)} differs from the run's {list(exp.input_shape)}"
        if s.num_classes and s.num_classes != exp.num_classes:
            return f"{s.num_classes} classes, the run has {exp.num_classes}"
        if algorithm not in s.capabilities:  # e.g. an inference-only client in a training run: it would stall rounds
            what = ", ".join(s.capabilities) or "no algorithm"
            hooks = sorted(get_algorithm(algorithm).hooks)
            needs = f"; {algorithm} needs the training hook(s) {', '.join(hooks)}" if hooks else ""
            return f"its {s.runtime or 'unknown'} runtime cannot run {algorithm!r} (it can run {what}){needs}"
        own = exp.parts.get(s.client)
        if own is not None and s.dataset_size != len(own):
            # Its data size is its averaging weight: it must be the size of the data provisioned for it.
            return f"it declares {s.dataset_size} samples, the data provisioned for {s.client} has {len(own)}"
        if open_x is not None and s.open_size != len(open_x):
            return f"DS-FL needs the {len(open_x)}-sample open set on the client, it holds {s.open_size}"
        return None

    return admit


def run_coordinator(
    config: RunConfig,
    run_dir: Path,
    *,
    broker: str | BrokerAddress,
    run: str | None = None,
    provisioned: Sequence[str] | None = None,
    min_clients: int | None = None,
    round_timeout: float = 300.0,
    join_timeout: float = 600.0,
    rejoin_grace: float = 5.0,
    broker_counters: bool = False,
    on_round: Callable[[RoundRecord], None] | None = None,
    experiment: Experiment | None = None,
    abort: Callable[[], str | None] | None = None,
    resume: bool = False,
    max_packet_size: PacketLimit = "auto",
    stop: GracefulStop | None = None,
    roster: Roster | None = None,
) -> RunResult:
    """Wait for clients on ``broker``, run ``config.rounds`` rounds over MQTT, write ``run_dir``.

    ``broker``: a URL or an address with its login and TLS settings (e.g. from a fleet bundle).
    ``run`` names the federation (topic prefix and message run id; default: the run directory's name).
    ``provisioned``: the client ids of the run's fleet kit; hellos of any other id are refused and never sampled.
    ``min_clients`` (default ``config.num_clients``) must be online before round 1. A client whose connection
    drops mid-round has ``rejoin_grace`` seconds to come back before it counts as dropped. ``abort`` is polled
    while waiting and returns a reason to give up (e.g. a client process died).
    ``resume``: continue the killed run in ``run_dir`` after its last completed round, from its journal. The new
    coordinator is a new session: clients drop their own state and answer the interrupted round again.
    ``max_packet_size``: the largest MQTT packet to publish (``auto``: the broker's announced limit, else none;
    ``off``: never chunk); larger messages travel as chunks. ``stop``: the SIGTERM handler that lets a round under
    way finish before the run stops (:mod:`coordinator.stopping`). ``roster``: the kit's client list as
    ``fedge kit add-client`` and ``revoke`` change it during the run (:mod:`coordinator.kit.roster`); it takes the
    place of ``provisioned`` for admission.
    """
    refuse_secure_aggregation(config)
    refuse_simulated_time(config)
    exp = experiment or prepare(config)
    config = exp.config
    run = run or run_dir.name
    if config.differential_privacy and config.secure_aggregation:
        log.info(
            "DP under secure aggregation: each client clips its update, adds its share of the noise and masks it on "
            "its device; this coordinator sees only the noised sum (docs/privacy.md, docs/secure_aggregation.md)"
        )
    elif config.differential_privacy:
        log.info(
            "central DP: this coordinator clips and noises each round's updates before they touch the model; the "
            "model it releases is (epsilon, delta)-DP, but the updates reach it in the clear (docs/privacy.md)"
        )
    strategy = exp.strategy(run)
    test_x, test_y = exp.test_tensors()
    needed = min_clients if min_clients is not None else config.num_clients
    address = broker if isinstance(broker, BrokerAddress) else BrokerAddress.parse(broker)
    admit = admission_rule(exp)
    if roster is not None:
        admit = roster.admit(then=admit)
    elif provisioned is not None:
        admit = admit_provisioned(provisioned, then=admit)
    transport = MqttTransport(
        address,
        run,
        round_timeout=round_timeout,
        rejoin_grace=rejoin_grace,
        admit=admit,
        broker_counters=broker_counters,
        max_packet_size=max_packet_size,
    )
    transport.max_payload = largest_update(strategy)
    transport.roster = roster
    if config.secure_aggregation:  # the clients run their own parties; the server's drives the stages over MQTT
        assert isinstance(strategy, (SecureAggregationStrategy, DifferentialPrivacyStrategy))
        strategy.use_channel(MqttStages(transport, stage_timeout=round_timeout))
    if not config.differential_privacy:  # DP's rounds take any number of replies (its noise is sized for that)
        transport.min_available = config.cohort_floor  # a round waits for the floor before it samples
    engine: RoundEngine
    if config.buffered:  # FedBuff on the real clock: its rounds are server steps (coordinator/mqtt_fedbuff.py)
        log.info(
            "FedBuff: a server step every %d updates, %d clients training at once; its step is a weighted mean of "
            "the buffered moves (no robust rule or server-side clipping: each reply is still checked as in a round)",
            config.fedbuff_buffer_size,
            config.fedbuff_concurrency,
        )
        engine = MqttFedBuffEngine(
            config, buffered_strategy(config, strategy), transport, test_x, test_y, initial_bytes=exp.initial_bytes()
        )
    else:
        engine = RoundEngine(config, strategy, transport, test_x, test_y, initial_bytes=exp.initial_bytes())
    # Restored before connecting: a journal that cannot be resumed fails here, not after the clients joined.
    journal = RunJournal(run_dir, config, exp.partition_summary(), engine, resume=resume)
    if isinstance(engine, MqttFedBuffEngine):
        fedbuff = engine

        def checkpoint() -> None:  # the buffer, with every accepted update; each move in a side file, written once
            journal.checkpoint(fedbuff.buffered.buffer.move_group)

        engine.checkpoint = checkpoint
    if journal.resumed_after:
        log.info("resuming %s after round %d (session %s)", run_dir, journal.resumed_after[-1], transport.session)
    remaining = len(engine.history.rounds) < config.rounds  # no round left: killed before writing its summary
    board = transport.board
    if stop is not None:  # a round is under way from its tasks to its record
        stop.round_under_way = lambda: board.status.round if board.status.phase in ("training", "aggregating") else 0
    memory = FleetMemory()  # the view's history and client table (fedge status)

    def view() -> dict[str, Any]:
        return memory.fields(engine.history.rounds, engine.history.ledger.entries, transport.presence)

    board.update(rounds=config.rounds, round=len(engine.history.rounds), **_progress(engine.history.rounds))
    board.update(about=about(config, exp.model), started=round(time.time(), 3), **view())
    with coordinator_log(run_dir) as logfile, transport:
        try:
            if remaining:
                # Without a kit, the clients the config's partition was written for: the wait fails at once when
                # refusals (or --min-clients itself) leave too few of them, as with a kit.
                among = provisioned if provisioned is not None else sorted(exp.parts)
                transport.wait_for_clients(needed, join_timeout, abort=abort, among=among)
            board.update(**view())  # who joined, with their runtime, device and samples
            before = transport.broker_counters() if broker_counters and remaining else None
            status_before = board.wire_bytes

            def record(r: RoundRecord) -> None:
                journal.round(r)
                memory.round_done(r, time.time())
                board.update(phase="done", **_progress(engine.history.rounds), **view())
                # The console's round line, timestamped, into the run's log too (the CLI prints it on stdout).
                logfile.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, "%s", (round_line(r),), None))
                if on_round is not None:
                    on_round(r)
                if stop is not None:
                    stop.check()  # a SIGTERM during this round: it is committed, now leave

            history = engine.run(record)
            board.update(phase="finished")
            after, lost = None, ""
            if broker_counters and before is not None:
                try:
                    after = transport.broker_counters()
                except FedgeError as exc:  # the rounds are done and written: a lost broker only loses the comparison
                    lost = f"the broker's counters could not be read after the run ({exc}): not comparable"
                    log.warning("wire bytes: %s", lost)
            status_wire = board.wire_bytes - status_before
        except BaseException as exc:
            board.update(phase="stopped", note=printable(str(exc) or type(exc).__name__))
            raise

    wire = sum(e.wire_bytes for e in history.ledger.entries)
    # The broker's counters were read in this session only: compare them with this session's rounds.
    first = journal.resumed_after[-1] + 1 if journal.resumed_after else 1
    session_wire = sum(e.wire_bytes for e in history.ledger.entries if e.round >= first)
    # The run-status messages (fedge status) are not part of any round, but the broker counts them too.
    compared_wire = session_wire + status_wire
    extra: dict[str, Any] = {
        "model": exp.model,
        "transport": "mqtt",
        "broker": address.url,
        "run": run,
        "clients": {c: _describe(s) for c, s in sorted(transport.presence.clients.items())},
        "refused": dict(sorted(transport.presence.refused.items())),
        "outside_rounds": dict(transport.outside_rounds),  # messages on update topics while no round was open
        "statuses_ignored": transport.presence.ignored,  # hellos beyond the client or rate limits
        "wire_bytes": wire,
        # The packet limit this coordinator sent within (None: none), the broker's own (MQTT 5 CONNACK), and how
        # many of its messages travelled as chunks.
        "max_packet_size": transport.link.packet_limit,
        "broker_max_packet_size": transport.link.broker_max_packet_size,
        "chunked_messages_sent": transport.link.chunked,
        "reassembly_peak_bytes": transport.reassembly_peak,
    }
    if journal.resumed_after:
        extra["resumed_after"] = journal.resumed_after
    if isinstance(engine, MqttFedBuffEngine):
        extra.update(fedbuff_summary(config, engine.buffered, len(engine.tasks)))
    if history.state_lost:
        extra["client_state_lost"] = dict(history.state_lost)
    extra["run_status_messages"] = {"published": board.published, "wire_bytes": status_wire}
    extra.update(privacy_summary(config, history.rounds, history.stopped))
    if lost:
        extra["broker_bytes"] = {"ledger_wire": compared_wire, "comparable": False, "note": lost}
    if before is not None and after is not None:
        extra["broker_bytes"] = bb = compare_with_broker(compared_wire, before, after)
        if bb["comparable"]:
            log.info("wire bytes: ours %d, broker's %d (%+.2f%%)", compared_wire, bb["broker_total"], bb["diff_pct"])
        else:
            log.warning("wire bytes: ours %d; %s", compared_wire, bb["note"])
    summary = journal.finish(strategy.global_weights(), initial_bytes=exp.initial_bytes(), extra=extra)
    return RunResult(run_dir, config, history.rounds, summary)


def _progress(rounds: Sequence[RoundRecord]) -> dict[str, Any]:
    """The run-status fields that follow from the completed rounds: last accuracy, skipped rounds, bytes so far."""
    evaluated = [r for r in rounds if r.accuracy is not None]
    last = rounds[-1].bytes if rounds else None
    return {
        "accuracy": evaluated[-1].accuracy if evaluated else -1.0,
        "accuracy_round": evaluated[-1].round if evaluated else 0,
        "skipped": sum(not r.aggregated for r in rounds),
        "wire_bytes": last.cum_wire if last else 0,
        "tensor_bytes": last.cum_tensor["multicast"] if last else 0,
    }


@contextlib.contextmanager
def coordinator_log(run_dir: Path) -> Iterator[logging.Handler]:
    """Everything logged while the run goes on, also appended to ``run_dir/coordinator.log`` (a resumed run adds to
    it): what the console showed, kept with the run's results. Yields the file's handler, for lines meant for the
    file only."""
    handler = logging.FileHandler(run_dir / COORDINATOR_LOG, encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)  # at the level the CLI set (INFO, or DEBUG with -v)
    try:
        yield handler
    except KeyboardInterrupt as exc:
        # Asked to stop (Ctrl-C, or SIGTERM: systemd, docker stop, kill): no error. Into the file only, as below.
        how = "SIGTERM" if isinstance(exc, Terminated) or getattr(exc, "terminated", False) else "Ctrl-C"
        after = str(exc) if isinstance(exc, Terminated) else ""  # "after finishing round 3": a graceful stop
        text, args = (STOPPED_AFTER, (how, after)) if after else (STOPPED, (how,))
        handler.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, text, args, None))
        raise
    except BaseException as exc:
        # Why the run stopped, into the file only: the CLI prints the error itself, the console needs no copy.
        why = printable(str(exc) or type(exc).__name__, 1000)
        handler.handle(log.makeRecord(log.name, logging.ERROR, __file__, 0, "run stopped: %s", (why,), None))
        raise
    finally:
        root.removeHandler(handler)
        handler.close()


def largest_update(strategy: Strategy) -> int:
    """Bytes of the largest legitimate update of this run: its tensors, their headers, and metadata slack."""
    wire = strategy.wire_reply_tensors()  # coded parts when the run compresses its uploads
    tensors = sum(math.prod(shape) * dtype.itemsize for shape, dtype in wire.values())
    return tensors + 256 * len(wire) + MAX_PAYLOAD_SLACK


def _describe(s: ClientStatus) -> dict[str, Any]:
    return {
        "state": s.state,
        "runtime": printable(s.runtime, 40),
        "device": printable(s.device, 40),
        "dataset_size": s.dataset_size,
        **({"reason": printable(s.reason)} if s.reason else {}),
        **({"host": printable(s.extra["host"], 64)} if "host" in s.extra else {}),
    }


def provision_fleet(
    exp: Experiment,
    out: Path,
    *,
    run: str,
    broker_hosts: Sequence[str],
    port: int = 8883,
    tls: bool = True,
    client_certificates: bool = False,
    signed_programs: bool = False,
    broker_config_dir: Path | None = None,
    max_packet_size: int | None = None,
    bind_address: str | None = None,
) -> FleetKit:
    """A fleet kit for ``exp``'s clients, its broker's message limit sized to this run's largest legitimate message,
    or ``max_packet_size`` bytes, to which the roles then chunk larger messages.

    ``broker_config_dir``: where the kit's ``broker/`` directory will be on the broker host (its mosquitto.conf names
    its files by absolute path; default: where it is written). ``bind_address``: the one interface its listener
    binds (default: every interface)."""
    refuse_secure_aggregation(exp.config)
    strategy = exp.strategy(run)
    plan = strategy.configure(1, sorted(exp.parts))
    planned = [len(encode(m)) for m in (plan.broadcast, *plan.tasks.values()) if m is not None]
    largest = max([largest_update(strategy), *planned])
    spec = FleetSpec(
        run,
        sorted(exp.parts),
        tuple(broker_hosts),
        largest,
        port=port,
        tls=tls,
        client_certificates=client_certificates,
        signed_programs=signed_programs,
        chunk_packet_size=max_packet_size,
        bind_address=bind_address,
    )
    return generate_fleet_kit(spec, out, broker_config_dir=broker_config_dir)
