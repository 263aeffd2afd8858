"""A run's directory from start to stop: a failed start leaves none, and Ctrl-C or SIGTERM says how to resume."""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mqtt_support import mosquitto_url  # noqa: F401 - a pytest fixture
from signal_support import default_sigint

from coordinator.run import COORDINATOR_LOG, coordinator_log
from fedge_cli.main import _terminate, main
from fedge_io.journal import JOURNAL
from fedge_io.signals import Terminated

FLAGS = ["--dataset", "synthetic", "--model", "tiny_mlp", "--num-clients", "3", "--partition", "iid"]


def test_a_sim_that_fails_to_start_leaves_no_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "runs"
    code = main(["sim", "--dataset", "mnist", "--data-dir", str(tmp_path / "nowhere"), "--out", str(out), "--quiet"])
    assert code == 2 and "fedge: error:" in capsys.readouterr().err
    assert not out.exists() or list(out.iterdir()) == []


def test_a_coordinator_whose_clients_never_join_leaves_no_run_directory(
    tmp_path: Path,
    mosquitto_url: str,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "runs"
    argv = [
        "coordinator",
        "--broker",
        mosquitto_url,
        "--run",
        "empty",
        "--join-timeout",
        "1",
        *FLAGS,
        "--out",
        str(out),
    ]
    assert main([*argv, "--rounds", "1", "--no-report"]) == 2
    assert "only 0 of 3 clients joined run 'empty'" in capsys.readouterr().err
    assert list(out.iterdir()) == []


def _start(tmp_path: Path, *flags: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "fedge_cli.main", "sim", *FLAGS, *flags, "--executor", "sequential", "--quiet"]
    return subprocess.Popen(
        [*argv, "--no-report", "--out", str(tmp_path / "runs")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        preexec_fn=default_sigint,
    )


def _wait_for_round(tmp_path: Path, proc: subprocess.Popen[str], rnd: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        for path in (tmp_path / "runs").glob(f"*/{JOURNAL}"):
            with contextlib.suppress(OSError, ValueError):  # replaced atomically: absent or whole
                if json.loads(path.read_text())["round"] >= rnd:
                    return
        time.sleep(0.05)
    raise AssertionError(f"fedge sim did not reach round {rnd}")


@pytest.mark.parametrize(
    ("sig", "code", "said"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_ctrl_c_and_sigterm_print_the_command_that_resumes_the_run(
    tmp_path: Path, sig: signal.Signals, code: int, said: str
) -> None:
    proc = _start(tmp_path, "--rounds", "30")
    try:
        _wait_for_round(tmp_path, proc, 1)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    (run,) = (tmp_path / "runs").iterdir()
    assert proc.returncode == code, err
    assert f"fedge: {said}" in err and "Traceback" not in err
    hint = next(line for line in err.splitlines() if "continue the run with: " in line)
    command = shlex.split(hint.split("continue the run with: ", 1)[1])
    assert command == ["fedge", "sim", "--resume", str(run), "--executor", "sequential", "--no-report", "--quiet"]
    assert json.loads((run / JOURNAL).read_text())["round"] < 30
    assert main(command[1:]) == 0  # the printed command finishes the run
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 30 and (run / "summary.json").is_file()


def test_an_interrupt_before_the_first_round_says_there_is_nothing_to_resume(tmp_path: Path) -> None:
    proc = _start(tmp_path, "--rounds", "2", "--local-epochs", "300")  # a first round of seconds
    try:
        deadline = time.monotonic() + 60
        while not list((tmp_path / "runs").glob("*/config.json")) and time.monotonic() < deadline:
            time.sleep(0.01)  # the directory exists: the run is starting, its first round not done
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143 and "Traceback" not in err
    assert "fedge: terminated (SIGTERM)\nfedge: no round had completed, so there is nothing to resume" in err
    assert list((tmp_path / "runs").iterdir()) == []  # and no half-written directory


def test_the_sigterm_handler_imports_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """It runs wherever the main thread is, in the middle of an import too, where an import of its own can meet a
    partly initialized module and fail with an ImportError instead of stopping (`fedge status`, 2 tries in 4)."""

    def no_import(name: str, *args: object, **kwargs: object) -> None:
        raise ImportError(f"the SIGTERM handler imported {name}")

    monkeypatch.setattr(builtins, "__import__", no_import)
    with pytest.raises(Terminated):
        _terminate(signal.SIGTERM, None)


@pytest.mark.parametrize(("stop", "how"), [(Terminated(), "SIGTERM"), (KeyboardInterrupt(), "Ctrl-C")])
def test_the_coordinator_logs_a_stop_it_was_asked_for_as_info_with_what_comes_next(
    tmp_path: Path, stop: KeyboardInterrupt, how: str
) -> None:
    with pytest.raises(KeyboardInterrupt), coordinator_log(tmp_path):
        raise stop
    logged = (tmp_path / COORDINATOR_LOG).read_text()
    assert f"INFO coordinator.run: run stopped by {how}: leaving now" in logged and "ERROR" not in logged
    assert "continues after them" in logged
    with pytest.raises(TimeoutError), coordinator_log(tmp_path):  # a failure is still an error
        raise TimeoutError("the broker went away")
    assert "ERROR coordinator.run: run stopped: the broker went away" in (tmp_path / COORDINATOR_LOG).read_text()


def test_the_coordinators_resume_command_repeats_how_it_ran_but_never_a_password() -> None:
    from fedge_cli.main import build_parser, resume_command

    argv = ["coordinator", "--broker", "mqtt://alice:s3cret@10.0.0.5:1883", "--run", "lab", "--round-timeout", "60"]
    args = build_parser().parse_args([*argv, "--rounds", "5", "--lr", "0.1", "--allow-plaintext", "--no-report"])
    command = resume_command(args, Path("runs/x"))
    assert command == (
        "fedge coordinator --resume runs/x --broker mqtt://10.0.0.5:1883 --username alice --allow-plaintext "
        "--run lab --round-timeout 60.0 --no-report"
    )
    bundle = build_parser().parse_args(["coordinator", "--bundle", "kit/coordinator", "--min-clients", "3"])
    assert resume_command(bundle, Path("r")) == "fedge coordinator --resume r --bundle kit/coordinator --min-clients 3"


def test_the_resume_command_repeats_the_plugins_and_the_tensorboard_folder() -> None:
    from fedge_cli.main import build_parser, resume_command

    args = build_parser().parse_args(["sim", "--plugin", "a.py", "--plugin", "pkg.b", "--tensorboard", "tb"])
    assert resume_command(args, Path("r")) == "fedge sim --resume r --tensorboard tb --plugin a.py --plugin pkg.b"
