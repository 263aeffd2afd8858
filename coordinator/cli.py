"""``fedge coordinator``: run rounds over a broker for clients started elsewhere; user-facing output only here."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from pathlib import Path

from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge_io.connection import add_connection_arguments, connection_from_args
from fedge_io.console import skipped_rounds_status
from fedge_io.tensorboard import TensorBoardLog, add_tensorboard_flag, check_tensorboard

log = logging.getLogger(__name__)


def add_coordinator_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``fedge coordinator`` (the run's config flags are added by fedge_cli.flags)."""
    add_connection_arguments(p)
    p.add_argument(
        "--run",
        default=None,
        help="the run (federation) name: topic prefix fedge/<run>/, same as the clients' --run "
        "(default: the bundle's, else 'default')",
    )
    p.add_argument(
        "--min-clients",
        type=int,
        default=None,
        help="clients that must be online before round 1 (default: --num-clients)",
    )
    p.add_argument("--round-timeout", type=float, default=300.0, help="seconds a round waits for replies")
    p.add_argument("--join-timeout", type=float, default=600.0, help="seconds to wait for --min-clients clients")
    p.add_argument(
        "--rejoin-grace",
        type=float,
        default=5.0,
        help="seconds a client that went offline mid-round may take to return, and one whose reply was refused may "
        "take to send a valid one (it is not waited for until the round's deadline)",
    )
    p.add_argument(
        "--broker-counters",
        choices=["auto", "on", "off"],
        default="auto",
        help="compare our wire bytes with the broker's $SYS byte counters (auto: when the broker publishes them)",
    )
    p.add_argument("--out", type=Path, default=Path("runs"), help="parent directory of the run directory")
    p.add_argument("--name", default="", help="label appended to the run directory's name")
    add_tensorboard_flag(p)
    p.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="continue the killed run in RUN_DIR after its last completed round (its config.json; clients re-sync)",
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="this exact run directory, the same command every time (a service that restarts the coordinator): "
        "the run starts there, resumes from its journal after a kill, and is left alone once finished (exit 0)",
    )


def apply_run_dir(args: argparse.Namespace) -> str | None:
    """``--run-dir``: resume the run there when it has a journal (sets ``args.resume``); a message when the run
    there already finished (nothing to do), else None."""
    from fedge_io.rundir import fixed_run_dir_state

    if args.run_dir is None:
        return None
    if args.resume is not None:
        raise ConfigError("--run-dir and --resume exclude each other: --run-dir resumes by itself")
    state = fixed_run_dir_state(args.run_dir)
    if state == "finished":
        return f"run directory {args.run_dir}: the run has finished (summary.json); nothing to do"
    if state == "resume":
        args.resume = args.run_dir
    return None


def run_coordinator_cli(
    args: argparse.Namespace, config: RunConfig, on_finish: Callable[[Path], None] | None = None
) -> int:
    from coordinator.kit.roster import Roster
    from coordinator.run import run_coordinator
    from coordinator.stopping import GracefulStop
    from fedge.accounting.records import RoundRecord
    from fedge.accounting.units import format_bytes
    from fedge.privacy.summary import privacy_line
    from fedge_io.console import round_line
    from fedge_io.rundir import run_directory

    connection = connection_from_args(args)  # checked before a run directory exists
    bundle = connection.bundle
    if bundle is not None and bundle.role != "coordinator":
        who = f"client {bundle.client_id}'s" if bundle.client_id else f"the {bundle.role}'s"
        raise ConfigError(f"{args.bundle} is {who} bundle; the coordinator needs coordinator/")
    if bundle is not None and args.run not in (None, bundle.run):
        raise ConfigError(f"--run {args.run} differs from the bundle's run {bundle.run!r}")
    resume = args.resume is not None
    if args.tensorboard is not None:
        check_tensorboard()  # before a run directory exists
    tensorboard: TensorBoardLog | None = None

    def on_round(r: RoundRecord) -> None:
        if tensorboard is not None:
            tensorboard.round(r)
        print(f"{time.strftime('%H:%M:%S')} {round_line(r)}", flush=True)  # the time, as the log lines have it

    # A start that fails (the data, the broker, clients that never join) removes the new directory again.
    with run_directory(args.out, config, args.name, resume=args.resume, fixed=args.run_dir) as run_dir:
        print(f"{'resuming run directory' if resume else 'run directory'}: {run_dir}", flush=True)
        if args.tensorboard is not None:
            tensorboard = TensorBoardLog(args.tensorboard, run_dir.name)
        stop = GracefulStop()
        try:
            with stop.installed():
                result = run_coordinator(
                    config,
                    run_dir,
                    broker=connection.address,
                    run=bundle.run if bundle is not None else (args.run or "default"),
                    provisioned=bundle.clients if bundle is not None else None,
                    min_clients=args.min_clients,
                    round_timeout=args.round_timeout,
                    join_timeout=args.join_timeout,
                    rejoin_grace=args.rejoin_grace,
                    broker_counters=args.broker_counters != "off",
                    on_round=on_round,
                    resume=resume,
                    max_packet_size=connection.max_packet_size,
                    stop=stop,
                    roster=Roster(Path(args.bundle)) if bundle is not None else None,
                )
        finally:
            if tensorboard is not None:
                tensorboard.close()
    s = result.summary
    if s.get("final_accuracy") is not None:
        print(f"final accuracy {100 * s['final_accuracy']:.2f}%  best {100 * s['best_accuracy']:.2f}%")
    if (spent := privacy_line(s)) is not None:
        print(spent)
    if s.get("stopped"):
        print(f"stopped early: {s['stopped']}")
    tb = s.get("total_bytes", {})
    print(
        f"communication: tensor {format_bytes(tb.get('tensor_bytes_multicast', 0))} multicast / "
        f"{format_bytes(tb.get('tensor_bytes_unicast', 0))} unicast, wire {format_bytes(s.get('wire_bytes', 0))}"
    )
    bb = s.get("broker_bytes")
    if bb and bb.get("comparable"):
        print(f"broker $SYS: {format_bytes(bb['broker_total'])} ({bb['diff_pct']:+.2f}% vs our wire count)")
    elif bb:
        print(f"broker $SYS: {bb['note']}")
    elif args.broker_counters == "on":
        log.warning("the broker published no $SYS byte counters (mosquitto needs sys_interval > 0)")
    if s.get("drops"):
        print("dropped: " + "; ".join(f"round {d['round']} {d['client']} ({d['reason']})" for d in s["drops"]))
    if s.get("rejected"):
        print(f"rejected messages: {s['rejected']} {s.get('rejected_by_reason', {})}")
    if on_finish is not None:
        on_finish(result.path)
    return skipped_rounds_status(s, allowed=args.allow_skipped_rounds)
