"""docs/deployment.md's "A first secure fleet on one machine, step by step", run as the doc prints it.

The commands are read from the doc itself: every fenced block after a ``<!-- walkthrough: STEP -->`` marker. Each
block runs with ``bash -c`` in an empty directory every user can enter, with a normal user's ``PATH`` and ``fedge``
on it (mosquitto, in /usr/sbin, is not: the doc names it by its full path, as ``fedge provision`` prints it); the only
substitution is a free port for ``8883``. Blocks the doc runs "in a terminal of its own" run in the
background, each in a process group of its own that the test stops at the end. A doc that breaks (a command that
fails, a broker block that is not what ``fedge provision`` prints, a missing step) fails this test.

The whole walkthrough runs as user ``nobody`` when the test runs as root (every step, the broker included), else as
the test's own user; as root, a shorter test runs the doc's root broker block (mosquitto drops to user ``mosquitto``
and must still read the kit: the bug of issue 31) and logs in to it with the doc's status command. The test prints
the walkthrough's times (``pytest -s``): from ``fedge provision`` to the coordinator's first aggregated round and to
its exit; it asserts no time.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from kit_support import USER_PATH, fedge_command, open_dir, printed_commands  # noqa: F401 - a fixture
from mqtt_support import require_mosquitto
from signal_support import default_sigint

from sim.brokers import free_port, wait_for_port

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deployment.md"
STEPS = ("provision", "broker", "broker-as-root", "coordinator", "clients", "status", "resume", "report")
DOC_PORT = "--fleet-port 8883"  # the one placeholder the test fills (the doc says so)
ROUNDS = 3  # the doc's --rounds
_MARKED = re.compile(r"^<!-- walkthrough: ([\w-]+) -->\n```bash\n(.*?)\n```$", re.S | re.M)


def walkthrough(doc: Path = DOC) -> dict[str, str]:
    """The doc's marked blocks by step name, in the doc's order (which must be :data:`STEPS`)."""
    found = _MARKED.findall(doc.read_text())
    assert tuple(name for name, _ in found) == STEPS, f"{doc}: walkthrough steps {[n for n, _ in found]}"
    return dict(found)


def commands_of(block: str, cwd: Path) -> list[list[str]]:
    """A broker block's commands as argument lists, ``$PWD`` expanded and a trailing ``&`` dropped (to compare them
    with what ``fedge provision`` printed)."""
    lines = [line.strip().removesuffix("&").strip() for line in block.splitlines() if line.strip()]
    return [shlex.split(line.replace("$PWD", str(cwd))) for line in lines]


@dataclass
class Shell:
    """Runs the doc's blocks as a user would in a terminal: ``bash -c BLOCK`` in ``cwd``, as ``user``."""

    cwd: Path
    env: dict[str, str]
    user: str | None = None
    groups: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, block: str, log: Path) -> subprocess.Popen[bytes]:
        """Start a block in a process group of its own (its background jobs stay in it), output to ``log``."""
        ids = {}
        if self.user is not None:
            account = pwd.getpwnam(self.user)
            ids = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                ["bash", "-c", block],
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=default_sigint,  # Ctrl-C must work even under a pytest started in the background
                **ids,  # type: ignore[arg-type]
            )
        self.groups.append(proc)
        return proc

    def run(self, block: str, log: Path, timeout: float = 300) -> str:
        """Run a block to its end; its output (exit status 0 asserted)."""
        proc = self.start(block, log)
        rc = proc.wait(timeout)
        out = log.read_text()
        assert rc == 0, f"{block!r} exited {rc}:\n{out[-3000:]}"
        return out

    def signal(self, proc: subprocess.Popen[bytes], sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)  # the block's process group: bash and every job it started

    def stop_all(self) -> None:
        for proc in self.groups:
            self.signal(proc, signal.SIGTERM)
        for proc in self.groups:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                self.signal(proc, signal.SIGKILL)
                proc.wait(5)
        # Background jobs outlive their bash: make sure nothing of the group is left.
        for proc in self.groups:
            self.signal(proc, signal.SIGKILL)


def wait_for_text(path: Path, pattern: str, proc: subprocess.Popen[bytes], timeout: float) -> float:
    """time.monotonic() when ``pattern`` first appears in ``path`` (polled every 0.1 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, path.read_text(), re.M):
            return time.monotonic()
        if proc.poll() is not None and not re.search(pattern, path.read_text(), re.M):
            raise AssertionError(f"exited {proc.returncode} before {pattern!r}:\n{path.read_text()[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} never appeared in {path}:\n{path.read_text()[-3000:]}")


@pytest.fixture
def shells() -> Iterator[list[Shell]]:
    made: list[Shell] = []
    yield made
    for shell in made:
        shell.stop_all()


def test_the_steps_are_read_from_the_doc_and_a_changed_doc_fails(tmp_path: Path) -> None:
    steps = walkthrough()
    assert "fedge coordinator --bundle fleet/kit/coordinator" in steps["coordinator"]
    assert steps["resume"] == steps["coordinator"]  # the same command continues the run
    broker = [["/usr/sbin/mosquitto", "-c", "/w/fleet/kit/broker/mosquitto.conf"]]
    assert commands_of(steps["broker"], Path("/w")) == broker
    doc = tmp_path / "deployment.md"
    doc.write_text(DOC.read_text().replace("<!-- walkthrough: status -->\n", ""))  # a step lost its marker
    with pytest.raises(AssertionError, match="walkthrough steps"):
        walkthrough(doc)


_INSTALL = re.compile(r"^<!-- install -->\n```bash\n(.*?)\n```$", re.S | re.M)


def test_the_walkthrough_installs_fedge_onto_path_before_its_first_command() -> None:
    """A fresh clone has no ``fedge`` on ``PATH``: followed as a new user, the walkthrough's first block was
    ``fedge: command not found``. Its install block comes first, makes the venv it activates, and installs fedge with
    its dependencies and the coordinator extra (whose commands ``tests/fedge_cli/test_packaging.py`` runs in an
    environment of that extra alone), pinned by the constraints file of this repository."""
    text = DOC.read_text()
    found = _INSTALL.search(text)
    assert found and found.start() < text.index("<!-- walkthrough: provision -->"), "no install block before provision"
    install, activate = found.group(1).splitlines()
    made = re.fullmatch(r"python3 -m venv (\S+) && (\S+)/bin/pip install -c (\S+) -e '\.\[(\w+)\]'", install)
    assert made, install
    venv, pip_venv, constraints, extra = made.groups()
    assert pip_venv == venv and activate == f". {venv}/bin/activate"
    assert (ROOT / constraints).is_file() and "--no-deps" not in install
    extras = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
    assert extra == "coordinator" and re.search(rf"^{extra} = \[", extras, re.M), extras
    assert subprocess.run(["bash", "-n", "-c", found.group(1)]).returncode == 0


@dataclass
class Walk:
    """A walkthrough under way: its shell, steps, log folder, broker port and times."""

    shell: Shell
    steps: dict[str, str]
    logs: Path
    port: int
    user: str | None
    broker: subprocess.Popen[bytes]
    started: float
    provisioned: float
    listening: float


def provision_and_start_broker(folder: Path, shells: list[Shell], user: str | None) -> Walk:
    """The doc's first two steps as ``user`` (None: this process's user): the kit, then the broker it printed."""
    is_root = os.geteuid() == 0
    steps = walkthrough()
    work, logs, bin_dir = folder / "walk", folder / "logs", folder / "bin"
    for d in (work, logs, bin_dir):
        d.mkdir()
    if user is not None:  # as if that user had made the directory it works in
        account = pwd.getpwnam(user)
        os.chown(work, account.pw_uid, account.pw_gid)
    env = {
        # A normal user's PATH: no /usr/sbin, so the doc and provision name mosquitto by its full path.
        "PATH": os.pathsep.join([str(bin_dir), USER_PATH]),
        "HOME": str(work),
        "LANG": "C.UTF-8",
        **fedge_command(bin_dir, user),
    }
    shell = Shell(work, env, user)
    shells.append(shell)
    port = free_port()
    assert DOC_PORT in steps["provision"], f"the provision step must name {DOC_PORT!r} (the test replaces it)"

    started = time.monotonic()
    printed = shell.run(steps["provision"].replace(DOC_PORT, f"--fleet-port {port}"), logs / "provision.log")
    provisioned = time.monotonic()

    # The broker: the doc's commands are the ones fedge provision printed, and they start it.
    broker_block = steps["broker-as-root" if is_root and user is None else "broker"]
    assert commands_of(broker_block, work) == [shlex.split(c) for c in printed_commands(printed)], printed
    broker = shell.start(broker_block, logs / "broker.log")
    assert wait_for_port("127.0.0.1", port, 20), (logs / "broker.log").read_text()[-2000:]
    return Walk(shell, steps, logs, port, user, broker, started, provisioned, time.monotonic())


@pytest.mark.broker
def test_as_root_the_brokers_block_serves_the_kit_after_dropping_to_its_user(
    open_dir: Path,  # noqa: F811
    shells: list[Shell],
) -> None:
    """Issue 31's bug: mosquitto started as root drops to user ``mosquitto`` and must still read the kit. The doc's
    root broker block, then the doc's status login over TLS with its password and ACL: it connects and subscribes,
    and waits for a run status that no coordinator sends (exit 2 with that reason, not a connection error). The whole
    walkthrough runs unprivileged below (one full run per suite: it starts a dozen processes)."""
    require_mosquitto()
    if os.geteuid() != 0:
        pytest.skip("needs root: mosquitto started as root drops to its own user")
    walk = provision_and_start_broker(open_dir, shells, None)
    status = walk.steps["status"].strip() + " --once --timeout 2"
    proc = walk.shell.start(status, walk.logs / "status.log")
    assert proc.wait(120) == 2
    assert "fedge: error: no run status on fedge/lab/run-status" in (walk.logs / "status.log").read_text()


@pytest.mark.broker
def test_the_docs_walkthrough_runs_as_printed(open_dir: Path, shells: list[Shell]) -> None:  # noqa: F811
    """Every step, as user ``nobody`` when the suite runs as root (the broker included), else as this user."""
    require_mosquitto()
    user = "nobody" if os.geteuid() == 0 else None
    if user is not None:
        try:
            pwd.getpwnam(user)
        except KeyError:
            pytest.skip(f"no user {user} to run the walkthrough unprivileged")
    walk = provision_and_start_broker(open_dir, shells, user)
    shell, steps, logs, broker = walk.shell, walk.steps, walk.logs, walk.broker
    started, provisioned, listening = walk.started, walk.provisioned, walk.listening
    is_root = os.geteuid() == 0

    coordinator = shell.start(steps["coordinator"], logs / "coordinator.log")
    clients = shell.start(steps["clients"], logs / "clients.log")
    status = shell.start(steps["status"], logs / "status.log")

    first = wait_for_text(logs / "coordinator.log", r"^\d\d:\d\d:\d\d round +1  acc", coordinator, 300)
    # Stopped after round 1 (Ctrl-C), the doc's resume step continues the run from its journal.
    shell.signal(coordinator, signal.SIGINT)
    assert coordinator.wait(120) == 130, (logs / "coordinator.log").read_text()[-3000:]
    before = (logs / "coordinator.log").read_text()
    done_before = len(re.findall(r"^\d\d:\d\d:\d\d round +\d+  acc", before, re.M))
    assert 1 <= done_before < ROUNDS, before
    resumed = shell.start(steps["resume"], logs / "resume.log")
    assert resumed.wait(300) == 0, (logs / "resume.log").read_text()[-3000:]
    ended = time.monotonic()
    out = (logs / "resume.log").read_text()
    after = [int(n) for n in re.findall(r"^\d\d:\d\d:\d\d round +(\d+)  acc", out, re.M)]
    assert after == list(range(done_before + 1, ROUNDS + 1)), out  # each round once, over both sessions
    assert "SKIPPED" not in before + out and "final accuracy" in out, out

    # The live view saw the rounds and the end; Ctrl-C leaves it with status 0.
    wait_for_text(logs / "status.log", rf"finished after round {ROUNDS} of {ROUNDS}", status, 30)
    shell.signal(status, signal.SIGINT)
    assert status.wait(10) == 0
    seen = (logs / "status.log").read_text()
    assert re.search(rf"round 1 of {ROUNDS}, (training|aggregating|round done)", seen), seen

    report = shell.run(steps["report"], logs / "report.log")
    assert "report:" in report, report

    # Every client did its part; stopped (SIGTERM, as `kill %1 %2 %3`) they leave cleanly.
    shell.signal(clients, signal.SIGTERM)
    client_out = (logs / "clients.log").read_text()
    assert len(re.findall(r"round 1: task received", client_out)) == 3, client_out[-3000:]
    assert len(re.findall(rf"round {ROUNDS}: sent update", client_out)) == 3, client_out[-3000:]
    shell.signal(broker, signal.SIGTERM)
    print(
        f"\nwalkthrough ({user or ('root' if is_root else 'this user')}), seconds after `fedge provision` started: "
        f"kit written {provisioned - started:.1f}, broker listening {listening - started:.1f}, first aggregated "
        f"round {first - started:.1f}, coordinator exited {ended - started:.1f}"
    )
