"""A whole deployment on one machine: a broker, N ``fedge client`` processes and the coordinator in this process.

``run_over_mqtt`` is what ``fedge sim --transport mqtt`` runs. It writes each client's data file (the DS-FL open set
and FD's test set once, in a shared file), starts the clients as real processes talking to a real broker, runs the
coordinator here and always stops the clients at the end, on errors and on Ctrl-C alike.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO

from coordinator.run import provision_fleet, refuse_secure_aggregation, run_coordinator
from fedge.accounting.records import RoundRecord
from fedge.config import RunConfig
from fedge.types import ClientId
from fedge.wire.protocol import BrokerAddress
from fedge_io.credentials import load_bundle
from fedge_io.experiment import Experiment, prepare
from fedge_io.mqtt import PacketLimit
from fedge_io.rundir import RunResult
from sim.brokers import embedded_broker, free_port, stop_process
from sim.provision import write_client_files

log = logging.getLogger(__name__)


def run_over_mqtt(
    config: RunConfig,
    run_dir: Path,
    *,
    broker: str | None = None,
    device: str = "cpu",
    on_round: Callable[[RoundRecord], None] | None = None,
    client_faults: Mapping[ClientId, int] | None = None,
    client_runtimes: Mapping[ClientId, str] | None = None,
    client_pythons: Mapping[ClientId, str] | None = None,
    round_timeout: float = 300.0,
    join_timeout: float | None = None,
    client_threads: int = 1,
    broker_counters: bool | None = None,
    experiment: Experiment | None = None,
    resume: bool = False,
    max_packet_size: PacketLimit = "auto",
) -> RunResult:
    """Run ``config`` as a coordinator and ``config.num_clients`` client processes over a broker; write ``run_dir``.

    ``broker``: ``mqtt://HOST:PORT`` of a running broker, or None for an embedded one on loopback, secured like a
    deployment: a fleet kit generated for this run (one random password per process, the least-privilege ACL, client
    ids bound to users; no TLS on loopback), so another local user cannot read or poison the run.
    ``client_faults``: client -> round; that client exits hard when its task of that round arrives (tests).
    ``client_runtimes``: client -> ``fedge client --runtime`` (torch, executorch, onnxruntime); default torch.
    ``client_pythons``: client -> the Python that runs it (e.g. ``.venv-ort-training/bin/python`` for
    onnxruntime-training); default this one.
    ``client_threads``: torch CPU threads per client process (1 keeps N clients from oversubscribing the cores).
    ``broker_counters``: read the broker's $SYS byte counters (default: when ``broker`` is given).
    ``resume``: continue the killed run in ``run_dir`` (see :func:`coordinator.run.run_coordinator`); the client
    processes are new, so clients that keep state (SCAFFOLD, FD, DS-FL) start theirs afresh.
    ``max_packet_size``: the coordinator's and every client's ``--max-packet-size`` (larger messages are chunked).
    """
    refuse_secure_aggregation(config)  # before a client process starts
    exp = experiment or prepare(config)
    config = exp.config
    run_dir.mkdir(parents=True, exist_ok=True)
    run = run_dir.name
    # Generous: N processes importing torch on a small laptop take a while, and a crashed one aborts the wait anyway.
    join_timeout = join_timeout if join_timeout is not None else 120.0 + 10.0 * config.num_clients
    counters = broker is not None if broker_counters is None else broker_counters
    with contextlib.ExitStack() as stack:
        data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fedge-clients-")))
        files = write_client_files(exp, data_dir)
        # Beside the data files, as `fedge provision` writes it: on-device clients prepare their programs from it.
        (data_dir / "config.json").write_text(config.to_json() + "\n")
        bundles: dict[ClientId, Path] | None = None
        address: str | BrokerAddress | None = broker
        provisioned: tuple[ClientId, ...] | None = None
        if broker is None:
            port = free_port()
            kit = provision_fleet(  # no TLS: its listener must stay on loopback, where the embedded broker binds
                exp,
                data_dir / "kit",
                run=run,
                broker_hosts=["127.0.0.1"],
                port=port,
                tls=False,
                bind_address="127.0.0.1",
            )
            url = stack.enter_context(embedded_broker(port, fleet=kit.broker_dir))
            coordinator = load_bundle(kit.coordinator_dir, broker=url)
            address, provisioned = coordinator.address, coordinator.clients
            bundles = {c: kit.root / "clients" / c for c in files}
        else:
            url = broker
        procs = stack.enter_context(
            client_processes(
                files,
                url,
                run,
                log_dir=run_dir / "logs",
                device=device,
                threads=client_threads,
                faults=client_faults or {},
                runtimes=client_runtimes or {},
                bundles=bundles,
                pythons=client_pythons,
                max_packet_size=max_packet_size,
            )
        )

        def dead_client() -> str | None:
            for cid, proc in procs.items():
                if proc.poll() is not None:
                    # Its log goes with the run directory of a failed start: the error carries its last line.
                    return f"client {cid} exited with code {proc.returncode} before the run started: " + _last_line(
                        run_dir / "logs" / f"{cid}.log"
                    )
            return None

        result = run_coordinator(
            config,
            run_dir,
            broker=address if address is not None else url,
            run=run,
            provisioned=provisioned,
            min_clients=config.num_clients,
            round_timeout=round_timeout,
            join_timeout=join_timeout,
            broker_counters=counters,
            on_round=on_round,
            experiment=exp,
            abort=dead_client,
            resume=resume,
            max_packet_size=max_packet_size,
        )
    return result


@contextlib.contextmanager
def client_processes(
    files: Mapping[ClientId, Path],
    broker: str,
    run: str,
    *,
    log_dir: Path,
    device: str = "cpu",
    threads: int = 1,
    faults: Mapping[ClientId, int] | None = None,
    stage_faults: Mapping[ClientId, str] | None = None,
    runtimes: Mapping[ClientId, str] | None = None,
    bundles: Mapping[ClientId, Path] | None = None,
    pythons: Mapping[ClientId, str] | None = None,
    max_packet_size: PacketLimit = "auto",
) -> Iterator[dict[ClientId, subprocess.Popen[bytes]]]:
    """Start one ``fedge client`` process per data file; on exit stop them all (SIGTERM, then SIGKILL).

    ``bundles``: each client's fleet-kit bundle, which carries its login (no secret goes on a command line).
    ``pythons``: the Python executable of some clients (default: this one).
    ``faults``: clients that exit hard at that round's task, or with ``stage_faults`` at that secure-aggregation stage
    of it ("share", "upload" or "unmask").
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: dict[ClientId, subprocess.Popen[bytes]] = {}
    logs: list[IO[bytes]] = []
    try:
        for cid, path in sorted(files.items()):
            python = (pythons or {}).get(cid, sys.executable)
            cmd = [python, "-m", "fedge_cli.main", "client", "--broker", broker, "--run", run, "--client-id", cid]
            if bundles is not None:
                cmd += ["--bundle", str(bundles[cid])]
            cmd += ["--data", str(path), "--device", device, "--threads", str(threads)]
            if faults and cid in faults:
                cmd += ["--fail-at-round", str(faults[cid])]
                if stage_faults and cid in stage_faults:  # vanish at that secure-aggregation stage of the round
                    cmd += ["--fail-at-stage", stage_faults[cid]]
            if runtimes and cid in runtimes:
                cmd += ["--runtime", runtimes[cid]]
            if max_packet_size != "auto":
                cmd += ["--max-packet-size", str(max_packet_size)]
            fh = open(log_dir / f"{cid}.log", "wb")  # noqa: SIM115 - closed in finally, after the process
            logs.append(fh)
            procs[cid] = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        log.info("started %d client processes (logs in %s)", len(procs), log_dir)
        yield procs
    finally:
        for proc in procs.values():  # SIGTERM all first, so they leave in parallel
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for cid, proc in procs.items():
            code = stop_process(proc)
            if code not in (0, None, -signal.SIGTERM):
                log.info("client %s exited with code %s", cid, code)
        for log_file in logs:
            log_file.close()


def _resolve_prctl() -> Callable[..., int] | None:
    # Looked up here, in the parent: after fork() only the call itself is safe (other threads may hold loader locks).
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _resolve_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the parent dies, so a killed run leaves no orphan clients (Linux)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _last_line(path: Path) -> str:
    """The last non-empty line of a client's log (at most 300 characters), or a note that there is none."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - 4096))
            lines = [line.strip() for line in fh.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    return lines[-1][:300] if lines else "its log is empty"
