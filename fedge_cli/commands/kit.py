"""``fedge kit``: devices added to and revoked from a live fleet (:mod:`coordinator.kit.cli`)."""

from __future__ import annotations

import argparse

from fedge_cli.flags import HelpFormatter

HELP = "devices come and go in a live fleet: `kit add-client ID`, `kit revoke ID` (--kit OUT/kit)"
"""The one-line help of ``fedge kit`` (``fedge --help`` lists it)."""


def add(sub: argparse._SubParsersAction) -> None:
    """The ``kit`` subcommand and its flags."""
    from coordinator.kit.cli import add_kit_arguments

    p = sub.add_parser("kit", help=HELP, formatter_class=HelpFormatter)
    add_kit_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``fedge kit``: its exit status."""
    from coordinator.kit.cli import run_kit_cli

    return run_kit_cli(args)
