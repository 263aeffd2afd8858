"""`fedge sim --resume`: a run interrupted after round k and resumed ends exactly where an uninterrupted one does.

In process, every algorithm's result is bit for bit the uninterrupted run's: the journal holds the server's state and
the clients' own stores (FD and DS-FL models, SCAFFOLD's c_i).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from fedge.accounting.ledger import read_ledger_csv
from fedge.accounting.records import RoundRecord
from fedge.algorithms.dsfl import DSFLSettings
from fedge.config import RunConfig, TrainConfig
from fedge.errors import JournalError
from fedge_cli.main import main
from fedge_io.experiment import Experiment, prepare
from fedge_io.journal import JOURNAL, PREVIOUS
from sim.run import run_inprocess

_VARYING = {"wall_s", "exchange_s", "drop_after_s", "last_reply_s"}  # and client_*_s: wall-clock timings


class Interrupted(Exception):
    """Raised from on_round: the run stops right after a round's journal was committed."""


def config(algorithm: str, rounds: int = 5) -> RunConfig:
    extra: dict[str, Any] = {}
    if algorithm == "dsfl":
        extra = {"algo": DSFLSettings(open_per_round=50, distill_epochs=1), "open_size": 200}
    return RunConfig(
        algorithm=algorithm,
        dataset="digits",
        model="tiny_mlp",
        num_clients=4,
        client_fraction=0.75,  # 3 of 4 per round: clients miss rounds, so their stores differ
        rounds=rounds,
        train=TrainConfig(local_epochs=1),
        **extra,
    )


def interrupt_after(*rounds: int) -> Any:
    def on_round(r: RoundRecord) -> None:
        if r.round in rounds:
            raise Interrupted(r.round)

    return on_round


def lines(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl without the wall-clock timings."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in _VARYING and not k.startswith("client_")} for row in rows]


def assert_same_result(reference: Path, resumed: Path) -> None:
    model = reference / "global_model.safetensors"
    assert model.exists() == (resumed / "global_model.safetensors").exists()
    if model.exists():
        a, b = load_file(model), load_file(resumed / "global_model.safetensors")
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), "the resumed model differs"
    assert json.dumps(lines(reference)) == json.dumps(lines(resumed))  # accuracy, losses, bytes: every bit (NaN too)
    assert read_ledger_csv(reference / "ledger.csv") == read_ledger_csv(resumed / "ledger.csv")
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (reference, resumed))
    assert {k: v for k, v in sb.items() if k != "resumed_after"} == sa


@pytest.fixture(scope="module")
def experiments() -> dict[str, Experiment]:
    return {}


def experiment(cache: dict[str, Experiment], algorithm: str) -> Experiment:
    if algorithm not in cache:
        cache[algorithm] = prepare(config(algorithm))
    return cache[algorithm]


@pytest.mark.parametrize("algorithm", ["fedntd", "scaffold", "fedadam", "fd", "dsfl"])
def test_an_interrupted_run_resumes_to_the_same_result_bit_for_bit(
    tmp_path: Path, algorithm: str, experiments: dict[str, Experiment]
) -> None:
    exp = experiment(experiments, algorithm)
    reference = run_inprocess(exp.config, tmp_path / "ref", experiment=exp)
    with pytest.raises(Interrupted):
        run_inprocess(exp.config, tmp_path / "run", experiment=exp, on_round=interrupt_after(2))
    assert not (tmp_path / "run" / "summary.json").exists()
    resumed = run_inprocess(exp.config, tmp_path / "run", experiment=exp, resume=True)
    assert [r.round for r in resumed.rounds] == [1, 2, 3, 4, 5]
    assert resumed.summary["resumed_after"] == [2]
    assert_same_result(reference.path, resumed.path)
    assert not list(resumed.path.glob("journal-*.safetensors"))  # a finished run keeps no state tensors


def test_a_run_resumed_twice_is_still_exact(tmp_path: Path, experiments: dict[str, Experiment]) -> None:
    exp = experiment(experiments, "scaffold")
    run_inprocess(exp.config, tmp_path / "ref", experiment=exp)
    with pytest.raises(Interrupted):
        run_inprocess(exp.config, tmp_path / "run", experiment=exp, on_round=interrupt_after(1))
    with pytest.raises(Interrupted):
        run_inprocess(exp.config, tmp_path / "run", experiment=exp, on_round=interrupt_after(3), resume=True)
    assert main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "report")]) == 0  # readable when killed
    resumed = run_inprocess(exp.config, tmp_path / "run", experiment=exp, resume=True)
    assert resumed.summary["resumed_after"] == [1, 3]
    assert_same_result(tmp_path / "ref", tmp_path / "run")


def test_a_run_killed_after_its_last_round_resumes_to_write_its_summary(
    tmp_path: Path, experiments: dict[str, Experiment]
) -> None:
    exp = experiment(experiments, "dsfl")
    run_inprocess(exp.config, tmp_path / "ref", experiment=exp)
    with pytest.raises(Interrupted):
        run_inprocess(exp.config, tmp_path / "run", experiment=exp, on_round=interrupt_after(5))
    resumed = run_inprocess(exp.config, tmp_path / "run", experiment=exp, resume=True)
    assert resumed.summary["resumed_after"] == [5]
    assert_same_result(tmp_path / "ref", tmp_path / "run")


def test_resume_refuses_another_config_a_finished_run_and_a_directory_without_journal(
    tmp_path: Path, experiments: dict[str, Experiment], capsys: pytest.CaptureFixture[str]
) -> None:
    exp = experiment(experiments, "fedntd")
    with pytest.raises(Interrupted):
        run_inprocess(exp.config, tmp_path / "run", experiment=exp, on_round=interrupt_after(1))
    run = str(tmp_path / "run")
    assert main(["sim", "--resume", run, "--rounds", "7", "--quiet", "--no-report"]) == 2
    assert "was written by another config (rounds: 5 in the journal, 7 now)" in capsys.readouterr().err
    with pytest.raises(JournalError, match="another config"):
        run_inprocess(config("fedavg"), tmp_path / "run", resume=True)
    assert main(["sim", "--resume", run, "--quiet", "--no-report"]) == 0
    assert main(["sim", "--resume", run, "--quiet", "--no-report"]) == 2
    assert "is finished: all 5 rounds ran" in capsys.readouterr().err
    assert main(["sim", "--resume", str(tmp_path), "--quiet", "--no-report"]) == 2
    assert "not a run directory (it has no config.json)" in capsys.readouterr().err


def test_an_altered_journal_is_refused_and_the_previous_one_resumes_to_the_same_model(
    tmp_path: Path, experiments: dict[str, Experiment], capsys: pytest.CaptureFixture[str]
) -> None:
    exp = experiment(experiments, "scaffold")
    run_inprocess(exp.config, tmp_path / "ref", experiment=exp)
    with pytest.raises(Interrupted):
        run_inprocess(exp.config, tmp_path / "run", experiment=exp, on_round=interrupt_after(3))
    run = tmp_path / "run"
    tensor_file = run / json.loads((run / JOURNAL).read_text())["tensors"]
    tensors = load_file(tensor_file)
    name = next(k for k in tensors if k.startswith("strategy/") and tensors[k].is_floating_point())
    tensors[name].view(-1)[0] = 123.0  # one weight changed, as a damaged disk or a hand edit would
    save_file(tensors, tensor_file)
    assert main(["sim", "--resume", str(run), "--quiet", "--no-report"]) == 2
    err = capsys.readouterr().err
    assert f"{tensor_file.name} is not the file journal.json recorded (SHA-256 differs)" in err
    assert "the journal of round 2 is kept: add --previous-journal to resume from it" in err
    assert (
        main(["sim", "--resume", str(run), "--previous-journal", "--executor", "sequential", "--quiet", "--no-report"])
        == 0
    )
    assert_same_result(tmp_path / "ref", run)


def test_a_killed_fedge_sim_process_resumes_to_the_same_model(tmp_path: Path) -> None:
    """SIGKILL a real `fedge sim` (DS-FL: server model, soft labels, clients' own models) mid-run, then --resume."""
    flags = ["--algorithm", "dsfl", "--dataset", "digits", "--model", "tiny_mlp", "--num-clients", "3"]
    flags += ["--rounds", "20", "--local-epochs", "1", "--open-size", "200", "--open-per-round", "50"]
    flags += ["--distill-epochs", "1", "--quiet", "--no-report", "--name", "k"]
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}  # same float sums as this process
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedge_cli.main", "sim", *flags, "--out", str(tmp_path / "killed")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        journaled = 0
        deadline = time.monotonic() + 120
        while journaled < 3 and time.monotonic() < deadline and proc.poll() is None:
            for path in (tmp_path / "killed").glob(f"*/{JOURNAL}"):
                with contextlib.suppress(OSError, ValueError):  # not there yet (replaced atomically: never torn)
                    journaled = json.loads(path.read_text())["round"]
            time.sleep(0.01)
        assert proc.poll() is None, "fedge sim ended before it could be killed"
        assert journaled >= 3
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    (killed,) = (tmp_path / "killed").iterdir()
    assert not (killed / "summary.json").exists()
    assert main(["report", str(killed), "--out", str(tmp_path / "report")]) == 0  # a killed run is readable
    assert main(["sim", "--resume", str(killed), "--quiet", "--no-report"]) == 0
    assert main(["sim", *flags, "--out", str(tmp_path / "ref")]) == 0
    (reference,) = (tmp_path / "ref").iterdir()
    assert_same_result(reference, killed)  # run ids (directory names) differ, in time only: same payload bytes


def test_client_stores_are_journaled_per_client_and_only_when_they_changed(tmp_path: Path) -> None:
    cfg = config("fd", rounds=3)
    exp = prepare(cfg)
    run_dir = tmp_path / "run"
    with pytest.raises(Interrupted):
        run_inprocess(cfg, run_dir, experiment=exp, on_round=interrupt_after(2))
    journal = json.loads((run_dir / JOURNAL).read_text())
    files = journal["values"]["client_files"]
    sampled = [json.loads(line)["sampled"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Each client's file is from the last round it was sampled in: stores of clients that sat out were not rewritten.
    for client, name in files.items():
        last = max(r for r, clients in enumerate(sampled, 1) if client in clients)
        assert name == f"{client}-{last:06d}.safetensors"
    # Superseded files are deleted, except those the previous journal (the fallback) names.
    previous = json.loads((run_dir / PREVIOUS).read_text())["values"]["client_files"]
    kept = set(files.values()) | set(previous.values())
    assert sorted(p.name for p in (run_dir / "clients").iterdir()) == sorted(kept)
    assert set(previous.values()) != set(files.values())
    assert set(files) == set().union(*map(set, sampled))
    assert not any(k.startswith("client/") for k in load_file(run_dir / journal["tensors"]))  # not in the big file
    run_inprocess(cfg, run_dir, experiment=exp, resume=True)
    assert not (run_dir / "clients").exists()  # a finished run keeps no client stores


def test_a_client_store_altered_after_the_run_is_refused_naming_it(
    tmp_path: Path, experiments: dict[str, Experiment]
) -> None:
    """The journal signs each client store file's SHA-256 with its own (issue 52): a DS-FL client's own model with one
    weight changed, a valid safetensors file, is refused on resume, not trained on."""
    exp = experiment(experiments, "dsfl")
    with pytest.raises(Interrupted):
        run_inprocess(exp.config, tmp_path / "run", experiment=exp, on_round=interrupt_after(2))
    store = sorted((tmp_path / "run" / "clients").glob("*.safetensors"))[0]
    tensors = load_file(store)
    name = next(k for k, v in tensors.items() if v.is_floating_point())
    tensors[name] = tensors[name] + 1.0
    save_file(tensors, store)
    with pytest.raises(JournalError, match=f"{store.name} is not the file the journal recorded"):
        run_inprocess(exp.config, tmp_path / "run", experiment=exp, resume=True)
