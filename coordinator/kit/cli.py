"""``fedge kit add-client ID`` and ``fedge kit revoke ID``: devices come and go in a live fleet
(:mod:`coordinator.kit.membership`); user-facing output only here."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path


def add_kit_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommands of ``fedge kit``."""
    sub = p.add_subparsers(dest="kit_command", required=True, metavar="{add-client,revoke}")
    add = sub.add_parser(
        "add-client",
        help="issue a new device's bundle into a live fleet: it can log in at once (the broker is reloaded, not "
        "restarted) and a running coordinator admits it",
    )
    add.add_argument("client", metavar="ID", help="the new device's client id, e.g. c010 (never one used before)")
    add.add_argument("--kit", type=Path, required=True, help="the fleet kit (fedge provision's OUT/kit)")
    add.add_argument(
        "--data-from",
        default=None,
        metavar="ID",
        help="also write the new device's data file beside the others, as a copy of this client's (a board that "
        "replaces a lost one takes over its data); default: no data file (the device brings its own)",
    )
    revoke = sub.add_parser(
        "revoke",
        help="cut a lost or stolen device off at once: its login refused, its open connection dropped, the running "
        "coordinator told",
    )
    revoke.add_argument("client", metavar="ID", help="the client id to revoke")
    revoke.add_argument("--kit", type=Path, required=True, help="the fleet kit (fedge provision's OUT/kit)")
    revoke.add_argument("--reason", default="", help="why (recorded in the kit and in the coordinator's log)")


def run_kit_cli(args: argparse.Namespace) -> int:
    from coordinator.kit.membership import Membership, add_client, revoke_client
    from fedge.errors import ConfigError

    try:
        if args.kit_command == "add-client":
            done: Membership = add_client(args.kit, args.client, data_from=args.data_from)
        else:
            done = revoke_client(args.kit, args.client, reason=args.reason)
    except OSError as exc:  # e.g. a kit whose broker files belong to another user: one line, not a traceback
        raise ConfigError(
            f"cannot change the fleet kit {args.kit}: {exc}; run fedge kit as the user that owns the kit (root for a "
            "kit whose broker/ was given to mosquitto)"
        ) from None
    if args.kit_command == "add-client":
        print(f"client {done.client} added to the fleet: its bundle is {done.bundle}")
        if done.data is not None:
            print(f"its data file: {done.data}")
        data = f"{done.client}.safetensors"
        command = ["fedge", "client", "--bundle", f"clients/{done.client}", "--data", data, "--device", "auto"]
        print(f"on the device, with clients/{done.client}/ and {data} (and shared.safetensors, if there is one):")
        print(f"    {shlex.join(command)}")
    else:
        print(f"client {done.client} revoked: its login is gone from the broker's files and the coordinator's list")
    if done.reloaded:
        print(f"broker reloaded (SIGHUP to mosquitto, pid {', '.join(map(str, done.reloaded))})")
    for line in done.todo:
        print(f"to do: {line}")
    return 0
