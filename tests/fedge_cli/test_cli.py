"""The ``fedge`` command as a user runs it."""

import json
import subprocess
from pathlib import Path

import pytest

import fedge
from fedge_cli.main import build_parser, config_from_args, main


def test_sim_writes_a_run_directory_with_report(tmp_path: Path, capsys):
    code = main(
        [
            "sim",
            "--dataset",
            "synthetic",
            "--model",
            "tiny_mlp",
            "--num-clients",
            "4",
            "--rounds",
            "2",
            "--partition",
            "iid",
            "--out",
            str(tmp_path),
            "--quiet",
        ]
    )
    assert code == 0
    (run,) = tmp_path.iterdir()
    out = capsys.readouterr().out
    assert str(run) in out and "final accuracy" in out and "round   1" not in out  # --quiet: no per-round lines
    config = json.loads((run / "config.json").read_text())
    assert config["num_clients"] == 4
    # Which fedge wrote it: the version, and the commit of this checkout, in config.json and summary.json alike.
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert config["fedge"]["version"] == fedge.__version__ and config["fedge"]["commit"] == head
    assert json.loads((run / "summary.json").read_text())["fedge"] == config["fedge"]
    assert (run / "report.md").exists() and (run / "accuracy_vs_bytes.png").exists()
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2


def test_sim_logs_one_line_per_round_and_no_bar_when_output_is_not_a_terminal(tmp_path: Path, capsys):
    flags = ["--dataset", "synthetic", "--model", "tiny_mlp", "--num-clients", "4", "--rounds", "3"]
    assert main(["sim", *flags, "--partition", "iid", "--out", str(tmp_path), "--no-report"]) == 0
    captured = capsys.readouterr()
    rounds = [line for line in captured.out.splitlines() if line.startswith("round ")]
    assert [line.split()[1] for line in rounds] == ["1", "2", "3"]
    assert all("acc" in line and line.endswith(" s") for line in rounds)  # accuracy and the round's wall time
    assert "\r" not in captured.err and "round/s" not in captured.err  # no tqdm bar in a log file


def test_flags_override_a_config_file(tmp_path: Path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"algorithm": "dsfl", "rounds": 9, "algo": {"aggregation": "sa"}}))
    args = build_parser().parse_args(["sim", "--config", str(path), "--rounds", "3", "--lr", "0.2"])
    cfg = config_from_args(args)
    assert (cfg.algorithm, cfg.rounds, cfg.train.lr, cfg.algo.aggregation) == ("dsfl", 3, 0.2, "sa")


def test_a_deployment_clips_updates_by_default_and_the_simulator_keeps_the_plain_mean(tmp_path: Path):
    from fedge_cli.main import _run_config

    def clip(*argv: str) -> float:
        """The clip under the mean (the default rule is in test_deployment_defaults)."""
        args = build_parser().parse_args([*argv, "--robust", "mean"])
        config = _run_config(args, deployment=argv[0] == "coordinator" or "mqtt" in argv)
        assert config.algo.robust == "mean"
        return float(config.algo.clip_factor)

    for algorithm in ("fedavg", "fedntd", "fedcad", "scaffold"):
        assert clip("coordinator", "--algorithm", algorithm) == 1.0
        assert clip("sim", "--algorithm", algorithm, "--transport", "mqtt") == 1.0
        assert clip("sim", "--algorithm", algorithm) == 0.0  # the papers' aggregation
        assert clip("coordinator", "--algorithm", algorithm, "--clip-factor", "0") == 0.0  # asked for
    path = tmp_path / "c.json"  # a config file's choice stands; a file that does not choose gets the default
    path.write_text(json.dumps({"algorithm": "fedavg", "algo": {"clip_factor": 0.0}}))
    assert clip("coordinator", "--config", str(path)) == 0.0
    path.write_text(json.dumps({"algorithm": "fedavg", "algo": {"weighting": "uniform"}}))
    assert clip("coordinator", "--config", str(path)) == 1.0
    args = build_parser().parse_args(["coordinator", "--config", str(path)])
    assert _run_config(args, deployment=True).algo.weighting == "uniform"  # the file's other settings kept
    args = build_parser().parse_args(["coordinator", "--algorithm", "fd"])  # FD has no robust rule: nothing changes
    assert _run_config(args, deployment=True).algo == _run_config(args).algo
    # The quorum: half the sampled clients over a broker, every one in fedge sim, whatever a flag or file says.
    for argv, quorum in (
        (["coordinator"], 0.5),
        (["sim", "--transport", "mqtt"], 0.5),
        (["sim"], 1.0),
        (["coordinator", "--min-replies", "0.8"], 0.8),
        (["coordinator", "--config", str(path)], 0.5),
    ):
        args = build_parser().parse_args(argv)
        assert _run_config(args, deployment=argv[0] == "coordinator" or "mqtt" in argv).min_replies == quorum
    path.write_text(json.dumps({"algorithm": "fedavg", "min_replies": 1.0}))
    assert (
        _run_config(build_parser().parse_args(["coordinator", "--config", str(path)]), deployment=True).min_replies == 1
    )


def test_cost_reproduces_the_dsfl_tables(capsys):
    assert main(["cost"]) == 0
    out = capsys.readouterr().out
    for figure in ("236.1 MB", "1.1 GB", "40.4 kB", "4.0 MB", "176 B"):
        assert figure in out
    # Table III's ComU@I (0.016, 0.031, 0.063 and 0.13 GB for MNIST; IMDb 4.0 MB; Reuters 6.3 MB), one line each.
    comu = out[out.index("ComU@I") :]
    for figure in ("15.7 MB", "31.4 MB", "62.7 MB", "125.4 MB", "4.0 MB", "6.3 MB"):
        assert figure in comu
    assert comu.count("| MNIST ") == 4 and comu.count("| IMDb ") == 1 and comu.count("| Reuters ") == 1


def test_cost_under_secure_aggregation_prices_fd_s_holds_and_needs_a_model(capsys):
    flags = ["cost", "--model", "tiny_mlp", "--input-shape", "64", "--num-clients", "10"]
    rows = {}
    for extra in ([], ["--secure-aggregation"]):
        assert main([*flags, *extra]) == 0
        out = capsys.readouterr().out
        cells = [[c.strip() for c in line.split("|")] for line in out.splitlines() if line.count("|") > 4]
        rows[bool(extra)] = {c[2]: c[3:] for c in cells}  # method: upload, download, totals
    assert (rows[False]["FD"][0], rows[True]["FD"][0]) == ("4.0 kB", "4.4 kB")  # 10 x (400 + 40) B up
    assert {m: r for m, r in rows[True].items() if m != "FD"} == {m: r for m, r in rows[False].items() if m != "FD"}
    with pytest.raises(SystemExit, match="--secure-aggregation prices the algorithms of a --model"):
        main(["cost", "--secure-aggregation"])


def test_missing_dataset_is_a_clear_error_not_a_traceback(tmp_path: Path, capsys):
    code = main(["sim", "--dataset", "mnist", "--data-dir", str(tmp_path), "--out", str(tmp_path / "runs"), "--quiet"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("fedge: error:") and "train-images-idx3-ubyte" in err


def test_invalid_setting_is_a_clear_error(capsys):
    assert main(["sim", "--algorithm", "fedbogus", "--quiet"]) == 2
    assert "unknown algorithm 'fedbogus'" in capsys.readouterr().err
    # A setting of another algorithm is refused and names the algorithms it belongs to.
    assert main(["sim", "--algorithm", "fedavg", "--ntd-beta", "2", "--quiet"]) == 2
    assert "--ntd-beta is a setting of fedntd, not of fedavg" in capsys.readouterr().err


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("sim", "cost", "report"):
        assert command in out


def test_version_prints_the_version_and_the_checkouts_commit(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"fedge {fedge.__version__} (commit {head[:12]}")
