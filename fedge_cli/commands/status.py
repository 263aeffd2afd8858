"""``fedge status``: the live run status the coordinator keeps on the broker; its parser imports no torch."""

from __future__ import annotations

import argparse

HELP = "watch a run live: round, phase, deadline, clients, accuracy, bytes (e.g. --bundle KIT/monitor)"
"""The one-line help of ``fedge status`` (``fedge --help`` lists it)."""


def add(sub: argparse._SubParsersAction) -> None:
    """The ``status`` subcommand (its own parser too: :func:`fedge_cli.main.status_parser`)."""
    from fedge_io.monitor import add_status_arguments

    p = sub.add_parser(
        "status",
        help=HELP,
        description="Show the run status the coordinator keeps on the broker, redrawn as it changes; --once prints "
        "one snapshot. With a fleet kit, log in with its read-only monitor/ bundle.",
    )
    add_status_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``fedge status``: its exit status."""
    from fedge_io.monitor import run_status_cli

    return run_status_cli(args)
