"""Following ``fedge provision``'s printed broker commands in tests, exactly as a user runs them."""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import site
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


USER_PATH = "/usr/local/bin:/usr/bin:/bin"
"""A normal user's PATH (Debian's default for users who are not root): no /usr/sbin, where mosquitto is."""


def start_as_printed(commands: Sequence[str], port: int, *, user: str | None = None) -> subprocess.Popen[bytes]:
    """Run every printed command in order with a shell (as ``user``, with a normal user's PATH); the last one,
    mosquitto, in the background. Stop it with :func:`sim.brokers.stop_process` (``bash -c`` execs a single command,
    so the PID is mosquitto's)."""
    as_user = ["runuser", "-u", str(user), "--", "env", f"PATH={USER_PATH}"]
    wrap = (lambda c: [*as_user, "bash", "-c", c]) if user else (lambda c: ["bash", "-c", c])
    for command in commands[:-1]:
        subprocess.run(wrap(command), check=True, timeout=30)
    binary = shlex.split(commands[-1])[0]
    assert Path(binary).is_absolute() and Path(binary).name == "mosquitto", commands  # found without /usr/sbin on PATH
    broker = subprocess.Popen(wrap(commands[-1]), stderr=subprocess.PIPE)
    if not wait_for_port("127.0.0.1", port, 10.0):
        stop_process(broker)
        stderr = broker.stderr.read().decode() if broker.stderr is not None else ""
        raise AssertionError(f"mosquitto did not start: {stderr[-1000:]}")
    return broker


ROOT = Path(__file__).resolve().parents[2]


def _runs_python(user: str, python: str, pythonpath: str) -> bool:
    account = pwd.getpwnam(user)
    probe = [python, "-c", "import fedge_cli.main, torch"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath, "HOME": "/tmp"}
    try:
        done = subprocess.run(probe, env=env, user=account.pw_uid, group=account.pw_gid, extra_groups=[], timeout=120)
    except OSError:  # PermissionError: the interpreter lies under a directory this user cannot enter (/root)
        return False
    return done.returncode == 0


def fedge_command(bin_dir: Path, user: str | None) -> dict[str, str]:
    """Put a ``fedge`` on ``bin_dir`` that ``user`` can run; the environment it needs (PYTHONPATH).

    This venv's ``fedge`` where that user can run its interpreter; else (a venv built from a Python under /root) the
    system's python3 of the same version with this venv's packages on PYTHONPATH; else the test is skipped."""
    pythonpath = os.pathsep.join([str(ROOT), *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])])
    python = sys.executable
    if user is not None and not _runs_python(user, python, pythonpath):
        python = "/usr/bin/python3"
        pythonpath = os.pathsep.join([pythonpath, *site.getsitepackages()])
        same = (
            Path(python).exists()
            and subprocess.run(
                [python, "-c", f"import sys; sys.exit(sys.version_info[:2] != {tuple(sys.version_info[:2])})"]
            ).returncode
            == 0
        )
        if not same or not _runs_python(user, python, pythonpath):
            pytest.skip(f"user {user} can run neither {sys.executable} nor a python3 {sys.version_info[:2]} with it")
    script = bin_dir / "fedge"
    script.write_text(f'#!/bin/sh\nexec {shlex.quote(python)} -m fedge_cli.main "$@"\n')
    script.chmod(0o755)
    return {"PYTHONPATH": pythonpath}
