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
    trained = {("dsfl_mnist_cnn", "1,28,28"): Path("w.safetensors")}
    both = [name for name, _ in sweep.commands(trained, {"dsfl_mnist_cnn"})]
    per_weights = len(sweep.OBJECTIVES) + 2  # inference files, one command per loss, FedProx
    assert [both[0], both[per_weights - 1], both[per_weights]] == [
        "dsfl_mnist_cnn-1x28x28-fresh",
        "dsfl_mnist_cnn-1x28x28-fresh-prox0.01",
        "dsfl_mnist_cnn-1x28x28-trained",
    ]
    assert len(both) == 2 * per_weights
    only_trained = sweep.commands(trained, {"dsfl_mnist_cnn"}, {"trained"})
    assert [name for name, _ in only_trained] == both[per_weights:]
    assert all(args[args.index("--weights") + 1] == "w.safetensors" for _, args in only_trained)
    assert [name for name, _ in sweep.commands(trained, {"dsfl_mnist_cnn"}, {"fresh"})] == both[:per_weights]


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
    assert len(out) == len(sweep.OBJECTIVES) + 2, out
    assert all("--weights w.safetensors" in line and "-trained" in line for line in out), out


def test_trained_weights_without_a_trained_model_is_an_error_not_an_empty_sweep():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--list", "--weights", "trained"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "needs at least one --trained" in done.stderr, done.stderr


def test_each_loss_is_its_own_command_so_a_stopped_sweep_keeps_each_finished_one():
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
    prox = cmds["imdb_lstm-default-fresh-prox0.01"]
    assert prox[prox.index("--objective") + 1 :] == ["ce", "--prox-mu", sweep.PROX_MU, "--max-batch", *sweep.BOUNDS]


def test_shards_split_the_commands_without_overlap_and_a_bad_shard_is_an_error():
    whole = sweep.commands({}, {"imdb_lstm"})
    parts = [sweep.shard(whole, f"{k}/2") for k in (1, 2)]
    assert sorted(name for part in parts for name, _ in part) == sorted(name for name, _ in whole)
    assert [name for name, _ in parts[1]] == [f"imdb_lstm-default-fresh-{kind}" for kind in ("ce", "lsd", "soft")]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--list", "--shard", "3/2"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "want K/N" in done.stderr, done.stderr


def test_a_trained_model_is_swept_at_its_shape_and_a_shape_not_swept_is_an_error():
    assert sweep.parse_trained("fedavg_cnn=a.safetensors") == (("fedavg_cnn", "1,28,28"), Path("a.safetensors"))
    assert sweep.parse_trained("tiny_mlp=b.safetensors") == (("tiny_mlp", "1,8,8"), Path("b.safetensors"))
    digits = dict([sweep.parse_trained("fedavg_cnn@1x8x8=c.safetensors")])
    names = [name for name, _ in sweep.commands(digits, {"fedavg_cnn"}, {"trained"})]
    assert names[0] == "fedavg_cnn-1x8x8-trained" and all("1x28x28" not in n for n in names), names
    for bad, says in (
        ("fedavg_cnn@1x16x16=w", "swept at 1x28x28 or 1x8x8"),
        ("nope=w", "want MODEL"),
        ("tiny_mlp", "want"),
    ):
        done = subprocess.run(
            [sys.executable, str(SCRIPT), "--list", "--trained", bad], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2 and says in done.stderr, done.stderr
