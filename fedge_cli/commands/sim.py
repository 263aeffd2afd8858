"""``fedge sim``: an algorithm run in one process (or over a broker on this machine), written to a run directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedge_cli.flags import (
    HelpFormatter,
    add_config_flags,
    add_plugin_flag,
    add_previous_journal_flag,
    packet_limit,
    run_config,
)

HELP = "run an algorithm in one process and write a run directory with a report"
"""The one-line help of ``fedge sim`` (``fedge --help`` lists it)."""


def add(sub: argparse._SubParsersAction) -> None:
    """The ``sim`` subcommand and its flags."""
    from fedge_io.console import add_skipped_rounds_flag
    from fedge_io.tensorboard import add_tensorboard_flag

    p = sub.add_parser(
        "sim",
        help=HELP,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--out", type=Path, default=Path("runs"), help="parent directory of the run directory")
    p.add_argument("--name", default="", help="label appended to the run directory's name")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument(
        "--transport",
        choices=["inprocess", "mqtt"],
        default="inprocess",
        help="inprocess: all clients in this process; mqtt: a coordinator and client processes over a broker",
    )
    p.add_argument(
        "--executor",
        choices=["auto", "sequential", "processes", "ray", "batched"],
        default="auto",
        help="who runs the clients' steps in process: auto (processes when two or more workers fit the cores), "
        "sequential, processes (a worker pool), ray (a Ray cluster: pip install 'fedge[ray]'); same model either way; "
        "batched (the round's clients as one stacked model, for a GPU: same model up to float round-off)",
    )
    p.add_argument("--workers", type=int, default=0, help="executor workers (0: one per core, at most the clients)")
    p.add_argument(
        "--threads-per-worker", type=int, default=1, help="torch threads of every client step (results depend on it)"
    )
    p.add_argument(
        "--overlap",
        choices=["auto", "on", "off"],
        default="auto",
        help="evaluate each round while the next round's clients train in the executor's worker processes (on), or "
        "before the next round starts (off); auto: on only where a core is left over for the evaluation beside the "
        "workers (on 2 cores with 2 workers it would compete with them); same results either way",
    )
    p.add_argument("--no-overlap", dest="overlap", action="store_const", const="off", help="the same as --overlap off")
    p.add_argument(
        "--broker",
        default=None,
        help="with --transport mqtt: mqtt://HOST:PORT of an existing broker (default: an embedded broker on loopback)",
    )
    p.add_argument(
        "--max-packet-size",
        type=packet_limit,
        default="auto",
        metavar="auto|off|BYTES",
        help="with --transport mqtt: the largest MQTT packet the coordinator and clients publish; larger messages "
        "travel as chunks (auto: the broker's announced limit, else none; off: never chunk)",
    )
    p.add_argument("--no-report", action="store_true", help="skip the Markdown report and plots")
    add_tensorboard_flag(p)
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no per-round lines and no progress bar (the bar is drawn only when stderr is a terminal)",
    )
    p.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="continue the killed run in RUN_DIR after its last completed round, from its journal (its config.json)",
    )
    add_previous_journal_flag(p)
    add_skipped_rounds_flag(p)
    add_config_flags(p)
    add_plugin_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``fedge sim``: its exit status."""
    from sim.cli import run_sim

    return run_sim(args, run_config(args, deployment=args.transport == "mqtt"))  # over a broker: a deployment
