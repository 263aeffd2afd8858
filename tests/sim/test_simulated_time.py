"""`fedge sim --client-profiles/--link/--sim-deadline`: the simulated clock of real in-process runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fedge.accounting.ledger import read_ledger_csv
from fedge.accounting.records import RoundRecord
from fedge.accounting.sim_clock import round_time
from fedge.config import RunConfig, TrainConfig
from fedge.errors import ConfigError
from fedge.profiles import ClientProfile, parse_link
from fedge_cli.main import main
from fedge_io.experiment import prepare
from sim.report import write_report
from sim.run import run_inprocess


def _config(**overrides: Any) -> RunConfig:
    base: dict[str, Any] = dict(
        algorithm="fedavg",
        dataset="synthetic",
        model="tiny_mlp",
        num_clients=4,
        rounds=3,
        partition="iid",
        train=TrainConfig(lr=0.05, local_epochs=1, batch_size=32),
        client_profiles="uniform:compute=1ms",
    )
    base.update(overrides)
    return RunConfig(**base)


def _lines(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class Interrupted(Exception):
    pass


def test_a_slower_link_takes_longer_and_the_clock_is_the_ledgers(tmp_path: Path):
    runs = {name: run_inprocess(_config(link=name), tmp_path / name) for name in ("lte", "ethernet")}
    lte, eth = (_lines(tmp_path / name) for name in ("lte", "ethernet"))
    for a, b in zip(lte, eth, strict=True):
        assert a["sim_time_s"] > b["sim_time_s"] + 0.1  # 3 messages x 50 ms of latency alone
        assert a["accuracy"] == b["accuracy"]  # without a deadline, time changes no model
    assert [r["sim_clock_s"] for r in lte] == pytest.approx(
        [sum(r["sim_time_s"] for r in lte[: i + 1]) for i in range(len(lte))]
    )
    # The clock is the time model applied to what the ledger counted, with every client's training-set size.
    exp = prepare(_config(link="lte"))
    sizes = {c: len(idx) for c, idx in exp.parts.items()}
    ledger = read_ledger_csv(tmp_path / "lte" / "ledger.csv")
    profiles = dict.fromkeys(sizes, ClientProfile(0.001, parse_link("lte")))
    for line in lte:
        expected = round_time(line["round"], ledger, line["replied"], profiles, sizes, local_epochs=1)
        assert line["sim_time_s"] == pytest.approx(expected.seconds, rel=1e-12)
    s = runs["lte"].summary
    assert set(s["time_to"]) == set(s["comu_at"]["multicast"]) == set(s["comu_at"]["unicast"])
    assert s["sim_clock"]["total_s"] == pytest.approx(lte[-1]["sim_clock_s"])
    assert s["sim_clock"]["reference_compute"] == "given" and s["sim_clock"]["link"] == "lte"
    reached = [k for k, v in s["comu_at"]["multicast"].items() if v is not None]
    assert reached and all(s["time_to"][k] is not None for k in reached)
    report = write_report([tmp_path / "lte", tmp_path / "ethernet"], tmp_path / "report")
    assert (tmp_path / "report" / "accuracy_vs_sim_time.png").stat().st_size > 10_000
    text = report.read_text()
    assert "accuracy_vs_sim_time.png" in text and "## Simulated time" in text and "`lte`" in text


def test_a_plain_run_keeps_no_clock(tmp_path: Path):
    result = run_inprocess(_config(client_profiles="", rounds=1), tmp_path / "run")
    assert "sim_time_s" not in _lines(tmp_path / "run")[0] and "time_to" not in result.summary
    write_report([tmp_path / "run"], tmp_path / "run")
    assert not (tmp_path / "run" / "accuracy_vs_sim_time.png").exists()


def test_the_deadline_drops_the_slow_tail(tmp_path: Path):
    cfg = _config(
        client_profiles="tail:fraction=0.25,slowdown=1000,compute=1ms", link="ethernet", sim_deadline=5, min_replies=0.5
    )
    run_inprocess(cfg, tmp_path / "run")
    for line in _lines(tmp_path / "run"):
        assert len(line["dropped"]) == 1 and len(line["replied"]) == 3  # one in four is slow: the same one
        (reason,) = line["drop_reasons"].values()
        assert reason.startswith("simulated deadline: ")
        assert line["sim_time_s"] == 5.0 and line["aggregated"]
    without = _config(client_profiles="tail:fraction=0.25,slowdown=1000,compute=1ms", link="ethernet")
    run_inprocess(without, tmp_path / "waits")
    assert all(line["sim_time_s"] > 5 and not line["dropped"] for line in _lines(tmp_path / "waits"))


def test_unavailable_clients_are_not_sampled(tmp_path: Path):
    cfg = _config(client_profiles="uniform:compute=1ms,period=10min,duty=0.5", link="cellular-edge", rounds=4)
    run_inprocess(cfg, tmp_path / "run")
    lines = _lines(tmp_path / "run")
    assert any(len(line["sampled"]) < 4 for line in lines)
    assert all(line["sampled"] for line in lines)


def test_a_resumed_run_continues_the_clock(tmp_path: Path):
    cfg = _config(link="lte")
    run_inprocess(cfg, tmp_path / "whole")

    def stop(r: RoundRecord) -> None:
        if r.round == 2:
            raise Interrupted

    with pytest.raises(Interrupted):
        run_inprocess(cfg, tmp_path / "run", on_round=stop)
    resumed = run_inprocess(cfg, tmp_path / "run", resume=True)
    whole = _lines(tmp_path / "whole")
    assert [r["sim_clock_s"] for r in _lines(tmp_path / "run")] == pytest.approx([r["sim_clock_s"] for r in whole])
    assert resumed.summary["time_to"] == pytest.approx(
        json.loads((tmp_path / "whole" / "summary.json").read_text())["time_to"]
    )


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--link", "5g"], "--link '5g': not a preset"),
        (["--client-profiles", "tail:fraction=2"], "fraction must be in [0, 1]"),
        (["--sim-deadline", "30"], "give --client-profiles or --link"),
        (["--link", "lte", "--transport", "mqtt"], "over MQTT time is real"),
        (["--client-profiles", "missing.csv"], "cannot read it"),
    ],
)
def test_bad_options_are_one_line_errors(
    flags: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    args = ["sim", "--dataset", "synthetic", "--model", "tiny_mlp", "--num-clients", "2", "--rounds", "1"]
    assert main([*args, "--out", str(tmp_path), "--quiet", "--no-report", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_a_coordinator_refuses_simulated_time():
    from coordinator.run import refuse_simulated_time

    refuse_simulated_time(RunConfig())
    with pytest.raises(ConfigError, match="are for fedge sim"):
        refuse_simulated_time(RunConfig(link="lte"))
