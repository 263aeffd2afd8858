"""experiments/export_sweep.py's command list: every model's fresh and trained commands, and --weights picking one."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "export_sweep.py"
spec = importlib.util.spec_from_file_location("export_sweep", SCRIPT)
assert spec is not None and spec.loader is not None
sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sweep)


def test_a_trained_model_adds_its_commands_and_weights_selects_fresh_or_trained():
    trained = {"dsfl_mnist_cnn": Path("w.safetensors")}
    both = [name for name, _ in sweep.commands(trained, {"dsfl_mnist_cnn"})]
    assert both == [
        "dsfl_mnist_cnn-1x28x28-fresh",
        "dsfl_mnist_cnn-1x28x28-fresh-prox0.01",
        "dsfl_mnist_cnn-1x28x28-trained",
        "dsfl_mnist_cnn-1x28x28-trained-prox0.01",
    ]
    only_trained = sweep.commands(trained, {"dsfl_mnist_cnn"}, {"trained"})
    assert [name for name, _ in only_trained] == both[2:]
    assert all(args[args.index("--weights") + 1] == "w.safetensors" for _, args in only_trained)
    assert [name for name, _ in sweep.commands(trained, {"dsfl_mnist_cnn"}, {"fresh"})] == both[:2]


def test_list_prints_the_trained_commands_alone():
    out = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--list",
            "--only",
            "fedavg_cnn",
            "--weights",
            "trained",
            "--trained",
            "fedavg_cnn=w.safetensors",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert len(out) == 2 and all("--weights w.safetensors" in line and "-trained" in line for line in out), out


def test_trained_weights_without_a_trained_model_is_an_error_not_an_empty_sweep():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--list", "--weights", "trained"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "needs at least one --trained" in done.stderr, done.stderr


def test_a_slow_model_gets_one_command_per_loss_so_a_stopped_sweep_keeps_each_one():
    cmds = dict(sweep.commands({}, {"imdb_lstm"}))
    assert list(cmds) == [
        "imdb_lstm-default-fresh",
        *(f"imdb_lstm-default-fresh-{kind}" for kind in sweep.OBJECTIVES),
        "imdb_lstm-default-fresh-prox0.01",
    ]
    for kind in sweep.OBJECTIVES:
        args = cmds[f"imdb_lstm-default-fresh-{kind}"]
        assert args[args.index("--objective") + 1 :] == [kind, "--max-batch", *sweep.BOUNDS]
        assert args[args.index("--format") + 1] == "pte-train"
    inference = cmds["imdb_lstm-default-fresh"]
    assert inference[inference.index("--format") + 1 : inference.index("--max-batch")] == ["onnx", "pte"]
    # Other models keep one command for every loss.
    (_fresh, args), _prox = sweep.commands({}, {"dsfl_mnist_cnn"})
    assert args[args.index("--objective") + 1 : args.index("--max-batch")] == list(sweep.OBJECTIVES)
