"""``fedge report``: Markdown tables and plots for run directories."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedge_cli.flags import HelpFormatter

HELP = "Markdown tables and PNG plots for one or more run directories"
"""The one-line help of ``fedge report`` (``fedge --help`` lists it)."""


def add(sub: argparse._SubParsersAction) -> None:
    """The ``report`` subcommand and its flags."""
    p = sub.add_parser("report", help=HELP, formatter_class=HelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run directories (written by fedge sim or fedge coordinator)")
    p.add_argument(
        "--out", type=Path, default=None, help="output directory (default: the run directory if one, else ./report)"
    )
    p.add_argument(
        "--accounting",
        choices=["multicast", "unicast"],
        default="multicast",
        help="bytes of a broadcast counted once (multicast, as the papers do) or once per recipient (unicast)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``fedge report``: its exit status."""
    from sim.cli import run_report

    return run_report(args)
