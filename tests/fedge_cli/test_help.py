"""``fedge <command> --help``: text on every flag, each default said once."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from fedge_cli.main import build_parser

COMMANDS = ("sim", "demo", "cost", "report", "coordinator", "client", "provision", "export")


def _help(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare words


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_text_and_states_its_default_at_most_once(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for action in sub.choices[command]._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
            continue
        text = re.sub(r"\(default: [^)]*\)|\[[^]]*\]", "", action.help or "").strip()
        assert text, f"fedge {command} {'/'.join(action.option_strings) or action.dest} has no help text"
    out = _help(command, capsys)
    assert "(default: None)" not in out and "(default: False)" not in out
    for entry in re.split(r"\s(?=--[a-z])", out):  # one flag's entry at a time
        assert entry.count("(default:") <= 1, entry


def test_a_setting_shows_its_real_default_and_the_model_its_rule(capsys: pytest.CaptureFixture[str]) -> None:
    out = _help("sim", capsys)
    assert "--lr LR local learning rate (default: 0.01)" in out
    assert "tiny_mlp, or a plugin's (default: per dataset) --num-clients" in out
    assert "--round-timeout ROUND_TIMEOUT seconds a round waits for replies (default: 300.0)" in _help(
        "coordinator", capsys
    )


def test_the_overview_help_and_the_version_answer_without_importing_torch() -> None:
    """`fedge --help` and `fedge --version` list the commands without loading torch or any algorithm module."""
    probe = (
        "import contextlib, io, sys\n"
        "from fedge_cli.main import main\n"
        "for argv in (['--help'], ['--version']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "        main(argv)\n"
        "    assert 'sim' in out.getvalue() or 'fedge' in out.getvalue(), out.getvalue()\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('fedge.algorithms.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.parametrize(
    ("argv", "meant"),
    [
        (["coordinator", "--join-timout", "5"], "--join-timout: did you mean --join-timeout?"),
        (["sim", "--roundz=3"], "--roundz: did you mean --rounds?"),  # a value glued on with '='
        (["status", "--onse"], "--onse: did you mean --once?"),  # status's own parser, without torch
        (["report", "run", "--verbos"], "--verbos: did you mean --verbose?"),  # fedge's own flags too
    ],
)
def test_a_mistyped_flag_is_answered_with_the_flag_meant(
    argv: list[str], meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedge_cli.main import main

    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and meant in err, err


def test_a_flag_like_none_other_gets_no_guess(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["report", "run", "--zzzzzz"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zzzzzz" in err and "did you mean" not in err
