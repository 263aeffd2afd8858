"""``fedge sim --dp-noise-multiplier`` end to end on the bundled digits: epsilon per round is dp-accounting's, in
metrics.jsonl, summary.json, the console and the report; the same seeds give the same model bit for bit and other
options another; a killed run resumes to the same model and ledger; the budget stop; the one-line refusals."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fedge.accounting.ledger import read_ledger_csv
from fedge.config import RunConfig, TrainConfig
from fedge.privacy.accountant import Ledger
from fedge.secagg.messages import MaskedInput
from fedge_cli.main import main
from fedge_io.rundir import RunResult
from sim.report import write_report
from sim.run import run_inprocess
from tests.sim.test_resume import Interrupted, interrupt_after, lines

TRAIN = TrainConfig(lr=0.05, momentum=0.9, local_epochs=1, batch_size=32)
BASE = ["sim", "--dataset", "digits", "--model", "tiny_mlp", "--num-clients", "20", "--client-fraction", "0.5"]


def _config(**overrides: object) -> RunConfig:
    base: dict[str, object] = dict(
        algorithm="fedavg",
        dataset="digits",
        model="tiny_mlp",
        num_clients=20,
        client_fraction=0.5,
        rounds=3,
        partition="iid",
        train=TRAIN,
        dp_noise_multiplier=0.3,
        dp_clip="1.0",
        dp_noise_seed=1,
    )
    base.update(overrides)
    return RunConfig(**base)  # type: ignore[arg-type]


def _run(tmp_path: Path, name: str, **overrides: object) -> RunResult:
    return run_inprocess(_config(**overrides), tmp_path / name, executor="sequential")


def _same_model(a: RunResult, b: RunResult) -> bool:
    x, y = load_file(a.path / "global_model.safetensors"), load_file(b.path / "global_model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_epsilon_per_round_is_the_accountants_everywhere(tmp_path: Path) -> None:
    result = _run(tmp_path, "dp")
    ledger = Ledger(0.5, 0.3, 1 / 20**1.1)
    rows = [json.loads(line) for line in (result.path / "metrics.jsonl").read_text().splitlines()]
    assert [row["dp_epsilon"] for row in rows] == [ledger.epsilon(t) for t in (1, 2, 3)]
    assert all(row["dp_clip"] == 1.0 and row["dp_noise_std"] == 0.3 for row in rows)
    assert [row["dp_cohort"] for row in rows] == [len(r.sampled) for r in result.rounds]
    s = result.summary
    assert s["dp_epsilon"] == ledger.epsilon(3) and s["dp_delta"] == 1 / 20**1.1 and "stopped" not in s
    report = write_report([result.path], tmp_path / "report")
    text = report.read_text()
    assert "DP-FedAvg (noise multiplier 0.3, clip 1, Poisson q = 0.5, epsilon" in text
    assert (tmp_path / "report" / "epsilon_vs_round.png").is_file()
    assert (tmp_path / "report" / "accuracy_vs_epsilon.png").is_file()


def test_same_seeds_same_model_and_options_change_it(tmp_path: Path) -> None:
    a = _run(tmp_path, "a")
    assert _same_model(a, _run(tmp_path, "b"))
    assert not _same_model(a, _run(tmp_path, "z", dp_noise_multiplier=0.6))
    assert not _same_model(a, _run(tmp_path, "clip", dp_clip="0.2"))
    adaptive = _run(tmp_path, "adaptive", dp_clip="adaptive:1.0", dp_noise_multiplier=0.5, rounds=2)
    clips = [r.metrics["dp_clip"] for r in adaptive.rounds]
    assert clips[0] == 1.0 and clips[1] != 1.0  # the clip moved after round 1
    secure = _run(tmp_path, "secure", secure_aggregation=True, rounds=2)
    assert secure.rounds[0].metrics["dp_epsilon"] == a.rounds[0].metrics["dp_epsilon"]
    pld = _run(tmp_path, "pld", dp_accountant="pld", rounds=1)
    assert pld.rounds[0].metrics["dp_epsilon"] < a.rounds[0].metrics["dp_epsilon"]


def test_an_interrupted_run_resumes_to_the_same_model_and_ledger(tmp_path: Path) -> None:
    cfg = _config(dp_clip="adaptive:1.0", dp_noise_multiplier=0.5)  # the clip is state: it must survive the restart
    reference = run_inprocess(cfg, tmp_path / "ref" / "run", executor="sequential")
    with pytest.raises(Interrupted):
        run_inprocess(cfg, tmp_path / "killed" / "run", executor="sequential", on_round=interrupt_after(1))
    resumed = run_inprocess(cfg, tmp_path / "killed" / "run", executor="sequential", resume=True)
    assert resumed.summary["resumed_after"] == [1]
    assert _same_model(reference, resumed)
    assert lines(reference.path) == lines(resumed.path)  # dp_epsilon, dp_clip, accuracy: every round
    assert resumed.summary["dp_epsilon"] == reference.summary["dp_epsilon"]


def test_the_budget_stops_the_run_with_exit_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ledger = Ledger(0.5, 0.3, 1 / 20**1.1)
    budget = (ledger.epsilon(2) + ledger.epsilon(3)) / 2
    flags = ["--rounds", "5", "--dp-noise-multiplier", "0.3", "--dp-clip", "1", "--dp-epsilon-budget", f"{budget}"]
    assert main([*BASE, *flags, "--quiet", "--no-report", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "stopped early: privacy budget: round 3 would spend epsilon" in out
    assert f"privacy: epsilon {ledger.epsilon(2):.3f}" in out
    (run_dir,) = tmp_path.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"].startswith("privacy budget: round 3") and summary["dp_rounds"] == 2
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize(("algorithm", "copies"), [("fedavg", 1), ("scaffold", 2), ("feddyn", 1)])
def test_the_ledger_counts_every_masked_value_of_a_secure_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, algorithm: str, copies: int
) -> None:
    """Each client masks its clipped update and one value more (the clipped-count bit, 0 under a fixed clip): the
    ledger's upload of each client that uploaded (its update message and any masked-input entry) is the masked
    vector it sent, 4 bytes a value, as the protocol packed it. SCAFFOLD's vector is its move and control delta
    (twice the model's values, as its update message), FedDyn's its move once (h reuses its sum)."""
    import fedge.algorithms.differential_privacy as dp

    sent: dict[str, int] = {}  # client: bytes of the masked vector it uploaded (round 1)
    run_configured = dp.run_configured

    def spy(*args: Any, on_message: Any = None, **kwargs: Any) -> Any:
        def seen(message: Any, *rest: Any) -> None:
            if isinstance(message, MaskedInput):
                sent[message.client] = 4 * message.masked.shape[0]
            on_message(message, *rest)

        return run_configured(*args, on_message=seen, **kwargs)

    monkeypatch.setattr(dp, "run_configured", spy)
    result = _run(tmp_path, "secure", algorithm=algorithm, secure_aggregation=True, num_clients=6, rounds=1)
    assert len(sent) >= 2 and result.rounds[0].aggregated
    dim = sum(t.numel() for t in load_file(result.path / "global_model.safetensors").values())
    assert set(sent.values()) == {4 * (copies * dim + 1)}  # the update (and control delta) and the count
    counted: dict[str, int] = {}
    for e in read_ledger_csv(result.path / "ledger.csv"):
        if e.direction == "up" and e.kind in ("update", MaskedInput.KIND):
            counted[e.client] = counted.get(e.client, 0) + e.tensor_bytes
    assert counted == sent


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--algorithm", "fednova"],
            "fednova: DP-FedAvg bounds each client's whole contribution to the sums its "
            "server releases by one clip, and FedNova's step multiplies the normalised moves by tau_eff",
        ),
        (["--algorithm", "fedcurv"], "U and V, sums of each client's latest Fisher terms"),
        (["--algorithm", "dsfl"], "cannot run --algorithm dsfl: it uploads outputs (logits)"),
        (["--algorithm", "fedavg", "--robust", "median"], "--robust median with --dp-noise-multiplier"),
        (["--algorithm", "fedavg", "--min-cohort", "3"], "--min-cohort 3 with --dp-noise-multiplier"),
        (
            ["--algorithm", "fedavg", "--transport", "mqtt", "--secure-aggregation", "--simulate-dropouts", "0.2"],
            "over MQTT the clients that vanish are real",
        ),
    ],
)
def test_refusals_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main([*BASE, "--rounds", "1", "--dp-noise-multiplier", "1", "--dp-clip", "1", *flags, "--quiet",
                 "--out", str(tmp_path)]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.startswith("fedge: error:") and message in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())


def test_deployments_refuse_a_noise_seed_and_take_dp_with_or_without_secure_aggregation() -> None:
    from coordinator.run import refuse_noise_seed, refuse_secure_aggregation
    from fedge.errors import ConfigError

    with pytest.raises(ConfigError, match="--dp-noise-seed makes the noise predictable"):
        refuse_noise_seed(_config())
    refuse_noise_seed(_config(dp_noise_seed=None))
    refuse_secure_aggregation(_config(dp_noise_seed=None))  # central DP travels over MQTT
    refuse_secure_aggregation(_config(dp_noise_seed=None, secure_aggregation=True))  # and the clients' noise shares


@pytest.mark.broker
def test_over_mqtt_with_the_kit_gives_the_in_process_model_and_ledger(tmp_path: Path) -> None:
    """Central DP over the laptop's kit (embedded broker, one client process each): the same Poisson cohorts, clip,
    noise, epsilon and budget stop as in process, so the same model (the simulation's noise seed; a coordinator
    refuses one)."""
    from sim.laptop import run_over_mqtt

    ledger = Ledger(0.5, 0.3, 1 / 4**1.1)
    budget = (ledger.epsilon(2) + ledger.epsilon(3)) / 2  # round 3 would exceed it: the run stops after round 2
    config = _config(num_clients=4, rounds=3, dp_epsilon_budget=budget)
    inprocess = run_inprocess(config, tmp_path / "inprocess", executor="sequential")
    over_mqtt = run_over_mqtt(config, tmp_path / "mqtt", round_timeout=60)
    assert len(over_mqtt.rounds) == 2 and over_mqtt.summary["stopped"].startswith("privacy budget: round 3")
    x = load_file(inprocess.path / "global_model.safetensors")
    y = load_file(over_mqtt.path / "global_model.safetensors")
    assert x.keys() == y.keys() and max(float((x[k] - y[k]).abs().max()) for k in x) <= 1e-6
    for key in ("dp_epsilon", "dp_cohort", "dp_noise_std"):
        assert [r.metrics[key] for r in inprocess.rounds] == [r.metrics[key] for r in over_mqtt.rounds], key
    assert [r.sampled for r in inprocess.rounds] == [r.sampled for r in over_mqtt.rounds]
    assert over_mqtt.summary["dp_epsilon"] == inprocess.summary["dp_epsilon"]


def test_help_describes_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sim", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--dp-noise-multiplier", "--dp-clip", "--dp-target-quantile", "--dp-clip-lr", "--dp-delta",
                 "--dp-epsilon-budget", "--dp-accountant", "--dp-noise-seed"):  # fmt: skip
        assert flag in out
    assert "Z > 0 turns client-level differential privacy on" in out


def test_empty_poisson_cohorts_are_valid_rounds(tmp_path: Path) -> None:
    """4 clients at q = 0.1: most rounds sample nobody; each still aggregates (noise only) and counts its epsilon."""
    result = _run(tmp_path, "empty", num_clients=4, client_fraction=0.1, rounds=4)
    assert any(not r.sampled for r in result.rounds)
    assert all(r.aggregated for r in result.rounds)
    ledger = Ledger(0.1, 0.3, 1 / 4**1.1)
    assert [r.metrics["dp_epsilon"] for r in result.rounds] == [ledger.epsilon(t) for t in (1, 2, 3, 4)]


def test_fedge_coordinator_and_provision_refuse_a_noise_seed_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dp = ["--dataset", "digits", "--num-clients", "2", "--dp-noise-multiplier", "1", "--dp-clip", "1",
          "--dp-noise-seed", "3"]  # fmt: skip
    for argv in (["coordinator", *dp, "--broker", "mqtt://127.0.0.1:1", "--run-dir", str(tmp_path / "run")],
                 ["provision", *dp, "--out", str(tmp_path / "run")]):  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("fedge: error:") and "--dp-noise-seed makes the noise predictable" in err, err
        assert "Traceback" not in err
        assert not (tmp_path / "run").exists()  # refused before anything was written or connected


@pytest.mark.parametrize("algorithm", ["scaffold", "feddyn"])
def test_scaffold_and_feddyn_repeat_bit_for_bit_and_resume_exactly(tmp_path: Path, algorithm: str) -> None:
    """DP-SCAFFOLD and DP-FedDyn (one joint clip, fixed denominators): a killed run, its round 1 played afresh and
    rounds 2-3 resumed, is the uninterrupted run bit for bit (model, epsilons, clips: the noise seed repeats the
    run; the adaptive clip, c or h and the ledger survive the restart); another noise seed gives another model."""
    cfg = _config(algorithm=algorithm, dp_clip="adaptive:1.0", dp_noise_multiplier=0.5)
    reference = run_inprocess(cfg, tmp_path / "ref" / "run", executor="sequential")
    other = run_inprocess(replace(cfg, dp_noise_seed=2, rounds=1), tmp_path / "other" / "run", executor="sequential")
    first = run_inprocess(replace(cfg, rounds=1), tmp_path / "first" / "run", executor="sequential")
    assert not _same_model(other, first)
    with pytest.raises(Interrupted):
        run_inprocess(cfg, tmp_path / "killed" / "run", executor="sequential", on_round=interrupt_after(1))
    resumed = run_inprocess(cfg, tmp_path / "killed" / "run", executor="sequential", resume=True)
    assert resumed.summary["resumed_after"] == [1]
    assert _same_model(reference, resumed) and lines(reference.path) == lines(resumed.path)
    assert [r.metrics["dp_clip"] for r in reference.rounds][1] != 1.0  # the clip moved: it was state to resume
    assert resumed.summary["dp_epsilon"] == reference.summary["dp_epsilon"] == Ledger(0.5, 0.5, 1 / 20**1.1).epsilon(3)
