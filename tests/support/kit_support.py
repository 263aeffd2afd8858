"""Following ``fedge provision``'s printed broker commands in tests, exactly as a user runs them."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from sim.brokers import stop_process, wait_for_port

START_HEADER = "start the broker on this machine with:"


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user can enter (unlike pytest's tmp_path under a 0700 parent)."""
    folder = Path(tempfile.mkdtemp(prefix="fedge-kit-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def fedge_provision(argv: Sequence[str]) -> str:
    """``fedge provision ARGV`` in a new process; its standard output."""
    done = subprocess.run(
        [sys.executable, "-m", "fedge_cli.main", "provision", *argv], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def printed_commands(out: str) -> list[str]:
    """The indented command lines ``fedge provision`` prints under its 'start the broker' line."""
    lines = out.splitlines()
    start = lines.index(START_HEADER) + 1
    commands = []
    for line in lines[start:]:
        if not line.startswith("    "):
            break
        commands.append(line.strip())
    return commands


def start_as_printed(commands: Sequence[str], port: int, *, user: str | None = None) -> subprocess.Popen[bytes]:
    """Run every printed command in order with a shell (as ``user``); the last one, mosquitto, in the background.
    Stop it with :func:`sim.brokers.stop_process` (``bash -c`` execs a single command, so the PID is mosquitto's)."""
    wrap = (lambda c: ["runuser", "-u", user, "--", "bash", "-c", c]) if user else (lambda c: ["bash", "-c", c])
    for command in commands[:-1]:
        subprocess.run(wrap(command), check=True, timeout=30)
    assert commands[-1].startswith("mosquitto -c "), commands
    broker = subprocess.Popen(wrap(commands[-1]), stderr=subprocess.PIPE)
    if not wait_for_port("127.0.0.1", port, 10.0):
        stop_process(broker)
        stderr = broker.stderr.read().decode() if broker.stderr is not None else ""
        raise AssertionError(f"mosquitto did not start: {stderr[-1000:]}")
    return broker
