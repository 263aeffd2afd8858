"""The ``fedge`` command: one entry point, a subcommand per role.

The top layer: the only package that reaches into every role (``sim``, ``coordinator``, ``edge_client``,
``export``). It imports them lazily, so a coordinator-only or client-only install needs only its own role. The
flags are built from the algorithm registry, whose modules import torch: ``fedge --help`` pays torch's import
(~2-3 s on a laptop CPU); keeping each algorithm's settings beside its code was worth more than a faster help text.

Each subcommand is one module of :mod:`fedge_cli.commands` (its help line, parser and handler); the flags they share
and the run config they make are :mod:`fedge_cli.flags`. This module assembles the parser, runs the command, and turns
what stops it (a user error, a missing extra, Ctrl-C or SIGTERM) into one line, an exit status and a resume hint.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import shlex
import signal
import sys
import threading
import types
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

from fedge.errors import FedgeError
from fedge.registry import ALGORITHMS
from fedge_cli.commands import client, coordinator, cost, demo, export, kit, provision, report, sim, status
from fedge_cli.flags import DEPLOYMENT_MIN_REPLIES, config_from_args, run_config, use_plugins
from fedge_io.signals import Terminated

# Imported where used, not here: `fedge --help` and `fedge --version` answer without loading torch (2-7 s).
if TYPE_CHECKING:
    from fedge_io.rundir import RunInterrupted

# Importers of the names written here before the commands and flags had their own modules (tests, scripts).
__all__ = ["COMMANDS", "DEPLOYMENT_MIN_REPLIES", "build_parser", "config_from_args", "main", "resume_command"]
_run_config = run_config

_COMMANDS = {
    "sim": sim,
    "demo": demo,
    "cost": cost,
    "report": report,
    "coordinator": coordinator,
    "client": client,
    "provision": provision,
    "status": status,
    "export": export,
    "kit": kit,
}
COMMANDS = {name: command.HELP for name, command in _COMMANDS.items()}
"""Every subcommand and its one-line help, in the order `fedge --help` lists them."""


class _VersionAction(argparse.Action):
    """``--version``: fedge's version and, from a git checkout, its commit (what run directories record)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        from fedge_io.provenance import version_text

        print(version_text())
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose "unrecognized arguments" names the flag meant: a mistyped ``--join-timout`` gets
    "did you mean --join-timeout?" from the flags of the command given (and fedge's own). Python 3.14's
    ``suggest_on_error`` suggests command and choice names only."""

    _words: Sequence[str] = ()

    def parse_known_args(  # type: ignore[override]  # one signature for typeshed's three overloads
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._words = list(sys.argv[1:] if args is None else args)  # for error(): which command was given
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        unrecognized = "unrecognized arguments: "
        if message.startswith(unrecognized):
            flags = set(self._option_string_actions)
            commands = next((a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction)), {})
            given = next((commands[w] for w in self._words if isinstance(commands, dict) and w in commands), None)
            flags |= set(given._option_string_actions) if given is not None else set()
            for word in message.removeprefix(unrecognized).split():
                flag = word.split("=", 1)[0]
                meant = difflib.get_close_matches(flag, flags, n=1) if flag.startswith("--") else []
                message += f"; {flag}: did you mean {meant[0]}?" if meant else ""
        super().error(message)


def _top_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    parser = _Parser(
        prog="fedge",
        description="Federated learning for edge devices: " + ", ".join(ALGORITHMS) + ", "
        "simulated in one process or deployed over MQTT, with every byte accounted for.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    parser.add_argument(
        "--version", action=_VersionAction, nargs=0, help="print fedge's version (and git commit) and exit"
    )
    return parser, parser.add_subparsers(dest="command", metavar="COMMAND", required=True)


def overview_parser() -> argparse.ArgumentParser:
    """The parser of a command line naming no subcommand (`fedge --help`, `fedge --version`, `fedge`): the commands
    and their one-line help, without importing what the commands need (torch, the algorithms)."""
    parser, sub = _top_parser()
    for name, text in COMMANDS.items():
        sub.add_parser(name, help=text)
    return parser


def status_parser() -> argparse.ArgumentParser:
    """The parser of `fedge status ...` alone: an operator's watch command starts without torch (seconds on a
    laptop, more on a small board), since the monitor reads metadata-only messages."""
    parser, sub = _top_parser()
    status.add(sub)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand, in the order of :data:`COMMANDS`."""
    parser, sub = _top_parser()
    for command in _COMMANDS.values():
        command.add(sub)
    return parser


RESUME_FLAGS = {
    "sim": (
        "transport",
        "broker",
        "max_packet_size",
        "executor",
        "workers",
        "threads_per_worker",
        "overlap",
        "device",
        "tensorboard",
    ),
    "coordinator": (
        "bundle",
        "broker",
        "username",
        "password_file",
        "ca_file",
        "cert_file",
        "key_file",
        "allow_plaintext",
        "max_packet_size",
        "run",
        "min_clients",
        "round_timeout",
        "join_timeout",
        "rejoin_grace",
        "broker_counters",
        "tensorboard",
    ),
}
"""The flags a resume command repeats when they were given: how the run reaches its broker and clients and where it
runs. The run's settings come from its config.json, so no config flag is repeated."""

COMMON_RESUME_FLAGS = ("no_report", "allow_skipped_rounds", "quiet", "plugin")


def resume_command(args: argparse.Namespace, run_dir: Path) -> str:
    """The command line that continues the interrupted run in ``run_dir`` as ``args`` started it; a broker login
    never goes into it (the password comes from the same file or environment variable as before)."""
    from fedge.wire.protocol import BrokerAddress

    defaults = vars(build_parser().parse_args([args.command]))
    words = ["fedge", args.command, "--resume", str(run_dir)]
    for dest in (*RESUME_FLAGS[args.command], *COMMON_RESUME_FLAGS):
        value = getattr(args, dest, None)
        if dest not in defaults or value == defaults[dest]:
            continue
        flag = "--" + dest.replace("_", "-")
        if value is True:
            words.append(flag)
        elif isinstance(value, list):  # a repeatable flag
            for item in value:
                words += [flag, str(item)]
        elif dest == "broker":
            address = BrokerAddress.parse(str(value))
            words += [flag, address.url]
            if address.username and not args.username:
                words += ["--username", address.username]
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def _terminate(signum: int, frame: types.FrameType | None) -> None:
    # Imports nothing: it runs wherever the main thread is, in the middle of an import too (see fedge_io.signals).
    raise Terminated()


# The packages outside fedge's base (pyproject.toml) by the extra that installs them: a client-only install
# (`pip install fedge[client]`) that runs another role's command is told what to install, not shown a traceback.
MISSING_EXTRA = {
    "pwdlib": "coordinator",
    "argon2": "coordinator",
    "matplotlib": "coordinator",
    "sklearn": "coordinator",
    "amqtt": "sim",
    "tqdm": "sim",
    "ray": "ray",
    "onnxruntime": "client-onnx",
    "onnx": "client-onnx",
    "onnxscript": "export",
    "executorch": "client-executorch",
    "tensorboard": "tensorboard",
}


def _parser_for(words: Sequence[str]) -> argparse.ArgumentParser:
    """Only as much parser as the command line needs: `fedge status` and `fedge --help` import no torch."""
    if next((word for word in words if not word.startswith("-")), None) == "status":
        return status_parser()
    return build_parser() if any(word in COMMANDS for word in words) else overview_parser()


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    args = _parser_for(words).parse_args(words)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    # SIGTERM (systemd, docker stop, kill) stops a run as Ctrl-C does: cleanup, then a resume hint and status 143.
    in_main = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main else None
    try:
        if getattr(args, "plugin", None):
            use_plugins(args.plugin)
        return int(args.func(args) or 0)
    except FedgeError as exc:
        print(f"fedge: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        extra = MISSING_EXTRA.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        if args.command == "export":  # the exporters need the whole export extra (onnxscript, executorch, ...)
            extra = "export"
        print(
            f"fedge: error: `fedge {args.command}` needs the package {exc.name!r}, which this installation lacks; "
            f"install it with fedge's '{extra}' extra: pip install 'fedge[{extra}]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt as exc:
        # A RunInterrupted comes from fedge_io.rundir: where it was never imported (fedge status), none was raised,
        # and a stop is no time to import torch.
        rundir = sys.modules.get("fedge_io.rundir")
        run = cast("RunInterrupted", exc) if rundir is not None and isinstance(exc, rundir.RunInterrupted) else None
        terminated = isinstance(exc, Terminated) or (run is not None and run.terminated)
        print(f"fedge: {'terminated (SIGTERM)' if terminated else 'interrupted'}", file=sys.stderr)
        if run is not None:
            if run.run_dir is None:
                print("fedge: no round had completed, so there is nothing to resume", file=sys.stderr)
            else:
                print(f"fedge: continue the run with: {resume_command(args, run.run_dir)}", file=sys.stderr)
        return 143 if terminated else 130
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
