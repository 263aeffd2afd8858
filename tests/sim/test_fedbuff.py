"""`fedge sim --aggregation fedbuff`: FedBuff on the simulated clock, in real in-process runs (digits, tiny_mlp)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fedge.accounting.ledger import BROADCAST_CLIENT, read_ledger_csv
from fedge.aggregation.server_step import Adaptive
from fedge.algorithms.fedadam import FedAdamSettings
from fedge.config import RunConfig, TrainConfig
from fedge.errors import ConfigError
from fedge.learning.models import exchanged_state
from fedge_cli.main import main
from fedge_io.experiment import prepare
from sim.fedbuff import FedBuffEngine
from sim.report import write_report
from sim.run import run_inprocess

# Per-wall-clock fields differ between two runs of one config; everything else must not.
_WALL = ("wall_s", "exchange_s", "client_compute_s", "client_compute_s_max", "client_cpu_s", "client_comm_s",
         "client_comm_s_max")  # fmt: skip


def _config(**overrides: Any) -> RunConfig:
    base: dict[str, Any] = dict(
        algorithm="fedavg",
        dataset="digits",
        model="tiny_mlp",
        num_clients=12,
        client_fraction=0.25,  # a cohort of 3
        rounds=4,
        partition="shards",
        train=TrainConfig(lr=0.05, local_epochs=1, batch_size=32),
        client_profiles="lognormal:sigma=1,compute=1ms",
        link="lte",
        aggregation="fedbuff",
        buffer_size=3,
        concurrency=6,
        staleness_weight="sqrt",
    )
    base.update(overrides)
    return RunConfig(**base)


def _lines(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _timeless(run_dir: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in line.items() if k not in _WALL} for line in _lines(run_dir)]


def _model(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "global_model.safetensors")


class Interrupted(Exception):
    pass


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted FedBuff run: 4 server steps, 6 clients training at once, K = 3."""
    run_dir = tmp_path_factory.mktemp("fedbuff") / "whole"
    run_inprocess(_config(), run_dir)
    return run_dir


def test_a_fedbuff_run_records_versions_staleness_and_time(whole: Path, tmp_path: Path):
    lines = _lines(whole)
    assert [line["fedbuff_version"] for line in lines] == [1, 2, 3, 4]
    assert all(line["buffer_fill"] == 3 and len(line["replied"]) <= 3 for line in lines)
    assert lines[0]["staleness_max"] == 0  # the first step: every update trained on version 0
    assert any(line["staleness_mean"] > 0 for line in lines)  # 6 at once, a step every 3: stale updates arrive
    assert all(line["staleness_max"] >= line["staleness_mean"] for line in lines)
    clocks = [line["sim_clock_s"] for line in lines]
    assert clocks == sorted(clocks) and clocks[0] > 0
    assert clocks == pytest.approx([sum(line["sim_time_s"] for line in lines[: i + 1]) for i in range(4)])
    # Every transfer is counted, in the step during which it crossed the link: a reply when it arrived.
    ledger = read_ledger_csv(whole / "ledger.csv")
    ups = [e for e in ledger if e.direction == "up"]
    assert len(ups) == sum(len(line["replied"]) + len(line["dropped"]) for line in lines) >= 12
    dispatched = sum(line["dispatched"] for line in lines)
    tasks = [e for e in ledger if e.direction == "down" and e.client != BROADCAST_CLIENT]
    assert len(tasks) == dispatched == len(ups) + lines[-1]["in_flight"]  # the rest still in flight at the end
    assert sum(e.recipients for e in ledger if e.client == BROADCAST_CLIENT) == dispatched
    summary = json.loads((whole / "summary.json").read_text())
    assert set(summary["time_to"]) == set(summary["comu_at"]["unicast"])
    assert summary["fedbuff"]["versions"] == 4 and summary["fedbuff"]["dispatched"] == dispatched
    report = write_report([whole], tmp_path / "report").read_text()
    assert "Staleness mean" in report and "FedBuff K=3" in report
    assert (tmp_path / "report" / "staleness_vs_step.png").stat().st_size > 10_000


def test_a_run_is_deterministic_in_its_seed(whole: Path, tmp_path: Path):
    again = tmp_path / "whole"  # the run's name travels in every message: the same bytes need the same name
    run_inprocess(_config(), again)
    assert _timeless(again) == _timeless(whole)
    assert all(torch.equal(a, b) for a, b in zip(_model(again).values(), _model(whole).values(), strict=True))
    other = tmp_path / "other" / "whole"
    run_inprocess(_config(seed=1), other)
    assert _timeless(other) != _timeless(whole)


def test_resume_mid_buffer_gives_the_uninterrupted_run(whole: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    arrive = FedBuffEngine._arrive
    seen = []

    def arrive_then_die(self: FedBuffEngine, rnd: int, task: Any, out: Any) -> None:
        arrive(self, rnd, task, out)
        seen.append((rnd, len(self.buffered.buffer.buffer)))
        if rnd == 3 and len(self.buffered.buffer.buffer) == 2:  # step 2 committed, step 3's buffer two-thirds full
            raise Interrupted

    monkeypatch.setattr(FedBuffEngine, "_arrive", arrive_then_die)
    run_dir = tmp_path / "whole"  # the run's name travels in every message: the same bytes need the same name
    with pytest.raises(Interrupted):
        run_inprocess(_config(), run_dir)
    assert seen[-1] == (3, 2) and [line["round"] for line in _lines(run_dir)] == [1, 2]
    journal = json.loads((run_dir / "journal.json").read_text())
    saved = journal["values"]["strategy"]["fedbuff"]
    assert saved["version"] == 2 and len(saved["in_flight"]) >= 3  # in-flight tasks with their updates are kept
    monkeypatch.setattr(FedBuffEngine, "_arrive", arrive)
    resumed = run_inprocess(_config(), run_dir, resume=True)
    assert resumed.summary["resumed_after"] == [2]
    assert _timeless(run_dir) == _timeless(whole)
    assert all(torch.equal(a, b) for a, b in zip(_model(run_dir).values(), _model(whole).values(), strict=True))
    assert (run_dir / "ledger.csv").read_text() == (whole / "ledger.csv").read_text()


def test_one_version_with_the_cohort_as_buffer_is_fedavg(tmp_path: Path):
    """K = cohort = concurrency, one server step (one version: no staleness), constant weights, server lr 1: FedAvg's
    round 1. Tolerance: FedBuff adds the mean of the moves w_i - w_0 to w_0, FedAvg averages the w_i; in float32 the
    two differ by round-off, below 1e-6 on these weights (|w| < 2)."""
    common: dict[str, Any] = dict(rounds=1, client_profiles="tail:fraction=0.25,slowdown=10,compute=1ms")
    run_inprocess(_config(aggregation="sync", buffer_size=0, concurrency=0, staleness_weight="constant", **common),
                  tmp_path / "fedavg")  # fmt: skip
    run_inprocess(_config(buffer_size=3, concurrency=3, staleness_weight="constant", server_lr=1.0, **common),
                  tmp_path / "fedbuff")  # fmt: skip
    sync, buffered = _lines(tmp_path / "fedavg")[0], _lines(tmp_path / "fedbuff")[0]
    assert buffered["replied"] == sync["replied"] and buffered["staleness_max"] == 0
    assert buffered["sim_time_s"] == pytest.approx(sync["sim_time_s"], rel=1e-12)  # the slowest of the three
    a, b = _model(tmp_path / "fedavg"), _model(tmp_path / "fedbuff")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=1e-6), k
    initial = prepare(_config()).model_factory().state_dict()
    assert any(not torch.equal(a[k], initial[k]) for k in a)  # it trained


def test_fedadams_server_optimizer_steps_from_the_buffers_average(tmp_path: Path):
    """One server step: FedBuff's buffered average is what FedAdam's Adam step starts from, as a round's average is."""
    common: dict[str, Any] = dict(rounds=1, staleness_weight="constant")
    run_inprocess(_config(**common), tmp_path / "fedavg")
    settings = FedAdamSettings(server_opt_lr=0.1)
    run_inprocess(_config(algorithm="fedadam", algo=settings, **common), tmp_path / "fedadam")
    initial = exchanged_state(prepare(_config()).model_factory())
    averaged, stepped = _model(tmp_path / "fedavg"), _model(tmp_path / "fedadam")
    adam = Adaptive("adam", initial, lr=0.1, beta1=settings.server_beta1, beta2=settings.server_beta2,
                    tau=settings.server_tau)  # fmt: skip
    expected = adam.step(initial, averaged)
    assert all(torch.equal(stepped[k], expected[k]) for k in expected)
    assert any(not torch.allclose(stepped[k], averaged[k], atol=1e-3) for k in expected)


def test_the_staleness_cut_drops_old_updates(tmp_path: Path):
    run_inprocess(_config(max_staleness=0, concurrency=8, rounds=3), tmp_path / "cut")
    lines = _lines(tmp_path / "cut")
    assert all(line["staleness_max"] == 0 for line in lines)  # only updates of the current version are buffered
    assert sum(line["dropped_stale"] for line in lines) > 0
    for line in lines:
        reasons = [r for r in line.get("drop_reasons", {}).values() if r.startswith("stale: ")]
        assert len(reasons) == line["dropped_stale"]
        for reason in reasons:  # "stale: trained on version V, S steps old > --max-staleness 0"
            base = int(reason.split("version ")[1].split(",")[0])
            age = int(reason.split(", ")[1].split(" steps")[0])
            assert age == line["fedbuff_version"] - 1 - base > 0
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert summary["fedbuff"]["dropped_stale"] == sum(line["dropped_stale"] for line in lines)


def test_one_client_at_a_time_steps_at_its_own_time(tmp_path: Path):
    """K = 1, one client at a time: each step takes its one client's transfers, compute and latency (hand-made
    profile file: client c003 slow)."""
    profiles = tmp_path / "profiles.csv"
    rows = ["client,compute_s,up,down,latency"] + [
        f"c{i:03d},{0.05 if i == 3 else 0.002},1Mbit,4Mbit,20ms" for i in range(12)
    ]
    profiles.write_text("\n".join(rows) + "\n")
    cfg = _config(client_profiles=str(profiles), buffer_size=1, concurrency=1, rounds=3)
    run_inprocess(cfg, tmp_path / "run")
    sizes = {c: len(idx) for c, idx in prepare(cfg).parts.items()}
    ledger = read_ledger_csv(tmp_path / "run" / "ledger.csv")
    for line in _lines(tmp_path / "run"):
        (client,) = line["replied"]
        own = [e for e in ledger if e.round == line["round"]]
        down = sum(e.payload_bytes for e in own if e.direction == "down")  # its broadcast and its task
        up = sum(e.payload_bytes for e in own if e.direction == "up")
        compute = 0.05 if client == "c003" else 0.002
        expected = 8 * down / 4e6 + sizes[client] * 1 * compute + 8 * up / 1e6 + 3 * 0.020
        assert line["sim_time_s"] == pytest.approx(expected, rel=1e-9)


def test_a_sync_round_takes_its_slowest_client(tmp_path: Path):
    """The synchronous clock with a hand-made profile file: each round's simulated time is the slowest sampled
    client's compute + transfers + latency, computed here from its own numbers."""
    profiles = tmp_path / "profiles.csv"
    compute = {f"c{i:03d}": 0.001 * (i + 1) for i in range(12)}
    up = {f"c{i:03d}": 1e6 * (12 - i) for i in range(12)}
    rows = ["client,compute_s,up,down,latency"] + [f"{c},{compute[c]},{int(up[c])}bit,8Mbit,30ms" for c in compute]
    profiles.write_text("\n".join(rows) + "\n")
    cfg = _config(client_profiles=str(profiles), aggregation="sync", buffer_size=0, concurrency=0,
                  staleness_weight="constant", rounds=2)  # fmt: skip
    run_inprocess(cfg, tmp_path / "run")
    sizes = {c: len(idx) for c, idx in prepare(cfg).parts.items()}
    ledger = read_ledger_csv(tmp_path / "run" / "ledger.csv")
    for line in _lines(tmp_path / "run"):
        own = [e for e in ledger if e.round == line["round"]]
        broadcast = sum(e.payload_bytes for e in own if e.client == BROADCAST_CLIENT)
        took = {}
        for c in line["sampled"]:
            down = broadcast + sum(e.payload_bytes for e in own if e.direction == "down" and e.client == c)
            sent = sum(e.payload_bytes for e in own if e.direction == "up" and e.client == c)
            took[c] = 8 * down / 8e6 + sizes[c] * compute[c] + 8 * sent / up[c] + 3 * 0.030
        assert len(took) == 3 and len(set(took.values())) == 3
        assert line["sim_time_s"] == pytest.approx(max(took.values()), rel=1e-9)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--aggregation", "fedbuff"], "runs on the simulated clock"),
        (["--buffer-size", "5"], "is a FedBuff setting: add --aggregation fedbuff"),
        (["--aggregation", "fedbuff", "--link", "lte", "--staleness-weight", "poly:x"], "poly needs an exponent"),
        (["--aggregation", "fedbuff", "--link", "lte", "--sim-deadline", "9"], "bound the age of updates"),
        (["--aggregation", "fedbuff", "--link", "lte", "--buffer-size", "3"], "never fill"),
        (["--aggregation", "fedbuff", "--link", "lte", "--robust", "median"], "robust rules"),
        (["--aggregation", "fedbuff", "--link", "lte", "--min-cohort", "1"], "--min-cohort is a synchronous"),
        (["--aggregation", "fedbuff", "--link", "lte", "--algorithm", "scaffold"], "cannot run --algorithm scaffold"),
        (
            ["--aggregation", "fedbuff", "--link", "lte", "--algorithm", "fedadam", "--server-lr", "0.5"],
            "leave --server-lr at 1",
        ),
        (["--aggregation", "fedbuff", "--link", "lte", "--algorithm", "fednova"], "cannot run --algorithm fednova"),
        (["--aggregation", "fedbuff", "--link", "lte", "--transport", "mqtt"], "over MQTT time is real"),
        (["--aggregation", "async"], "aggregation must be sync or fedbuff"),
    ],
)
def test_bad_options_are_one_line_errors(
    flags: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    args = ["sim", "--dataset", "synthetic", "--model", "tiny_mlp", "--num-clients", "2", "--rounds", "1"]
    assert main([*args, "--out", str(tmp_path), "--quiet", "--no-report", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_dsfl_keeps_its_aggregation_flag(tmp_path: Path):
    """--aggregation and --server-lr are shared with DS-FL's and SCAFFOLD's own settings: routed by algorithm."""
    import argparse

    from fedge_cli.main import build_parser, config_from_args

    def parsed(*flags: str) -> RunConfig:
        args: argparse.Namespace = build_parser().parse_args(["sim", *flags])
        return config_from_args(args)

    dsfl = parsed("--algorithm", "dsfl", "--aggregation", "sa")
    assert dsfl.aggregation == "sync" and dsfl.algo.aggregation == "sa"  # type: ignore[attr-defined]
    scaffold = parsed("--algorithm", "scaffold", "--server-lr", "0.5")
    assert scaffold.server_lr == 1.0 and scaffold.algo.server_lr == 0.5  # type: ignore[attr-defined]
    buffered = parsed("--algorithm", "fedntd", "--aggregation", "fedbuff", "--link", "lte", "--server-lr", "0.5")
    assert buffered.buffered and buffered.server_lr == 0.5
    with pytest.raises(ConfigError, match="is a FedBuff setting"):
        parsed("--algorithm", "fedavg", "--server-lr", "0.5")


def test_a_buffer_that_cannot_fill_says_why(tmp_path: Path):
    """Every update refused (an update bound no move passes): once every client has trained on version 0 the step
    can never fill, and the run stops with the reason instead of waiting forever."""
    from fedge.algorithms.fedavg import FedAvgSettings

    with pytest.raises(ConfigError, match="every client trained on version 0, and only 0 of the 3 updates"):
        run_inprocess(_config(algo=FedAvgSettings(max_update_ratio=1e-9)), tmp_path / "run")


def test_a_measured_reference_is_said_to_make_the_run_unreproducible(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    with caplog.at_level("WARNING", logger="sim.run"):
        run_inprocess(_config(client_profiles="", rounds=1), tmp_path / "measured")  # --link alone: measured here
    assert "give compute=SECONDS for a reproducible run" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="sim.run"):
        run_inprocess(_config(rounds=1), tmp_path / "given")
    assert "reproducible" not in caplog.text
