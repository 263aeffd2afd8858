"""``fedge sim --secure-aggregation`` end to end on the bundled digits: the accuracy of the plain run, the same model
bit for bit from the same seed, dropouts recorded, abandoned rounds skipped, the protocol's bytes in the ledger, and
the start-up refusals as one-line errors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from safetensors.torch import load_file

from fedge.accounting.cost import algorithm_round_cost
from fedge.accounting.ledger import read_ledger_csv
from fedge.algorithms.catalog import get_algorithm
from fedge.config import RunConfig, TrainConfig
from fedge_cli.main import main
from fedge_io.experiment import prepare
from fedge_io.rundir import RunResult
from sim.report import write_report
from sim.run import run_inprocess
from tests.sim.test_resume import Interrupted, interrupt_after, lines

TRAIN = TrainConfig(lr=0.05, momentum=0.9, local_epochs=1, batch_size=32)


def _config(**overrides: object) -> RunConfig:
    base: dict[str, object] = dict(
        algorithm="fedavg",
        dataset="digits",
        model="tiny_mlp",
        num_clients=10,
        rounds=4,
        partition="iid",
        train=TRAIN,
    )
    base.update(overrides)
    return RunConfig(**base)  # type: ignore[arg-type]


def _run(tmp_path: Path, name: str, **overrides: object) -> RunResult:
    return run_inprocess(_config(**overrides), tmp_path / name)


def _model(result: RunResult) -> dict[str, object]:
    return load_file(result.path / "global_model.safetensors")


def test_secure_aggregation_learns_as_plain_fedavg_and_repeats_bit_for_bit(tmp_path: Path) -> None:
    plain = _run(tmp_path, "plain")
    secure = _run(tmp_path, "secure", secure_aggregation=True)
    again = _run(tmp_path, "again", secure_aggregation=True)
    a, b = plain.summary["final_accuracy"], secure.summary["final_accuracy"]
    assert a > 0.6 and abs(a - b) <= 0.02, (a, b)
    m1, m2 = _model(secure), _model(again)
    assert m1.keys() == m2.keys() and all(bool((m1[k] == m2[k]).all()) for k in m1)  # type: ignore[union-attr]
    assert any(bool((m1[k] != _model(plain)[k]).any()) for k in m1)  # type: ignore[union-attr]  # not the plain sum
    first = json.loads((secure.path / "metrics.jsonl").read_text().splitlines()[0])
    assert (first["secagg_bound"], first["secagg_ring_bits"], first["secagg_degree"]) == (5.0, 32, 9)
    assert first["secagg_frac_bits"] > 20 and first["secagg_survivors"] == 10
    report = write_report([secure.path], tmp_path / "report").read_text()
    assert "secure aggregation (SecAgg+: updates clipped to L2 norm 5, 32-bit ring with" in report
    assert "| secagg.unmask-shares" in report


def test_the_ledger_counts_the_protocol_and_the_masked_upload_is_the_plain_upload(tmp_path: Path) -> None:
    plain = _run(tmp_path, "plain", rounds=1)
    secure = _run(tmp_path, "secure", rounds=1, secure_aggregation=True)
    ledger = read_ledger_csv(secure.path / "ledger.csv")
    kinds = Counter(e.kind for e in ledger)
    for kind in ("secagg.advertise", "secagg.neighbour-keys", "secagg.encrypted-shares", "secagg.share-delivery",
                 "secagg.unmask-request", "secagg.unmask-shares", "update"):  # fmt: skip
        assert kinds[kind] == 10, kind
    update = next(e for e in ledger if e.kind == "update")
    metrics = json.loads((secure.path / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["secagg_upload_tensor_bytes"] == update.tensor_bytes  # uint32 ring values: 4 bytes, as float32
    up_plain = plain.rounds[0].bytes.tensor_up
    up_secure = secure.rounds[0].bytes.tensor_up
    ratio = up_secure / up_plain
    # tiny_mlp has 2,442 values (9.8 kB an update): the keys and shares of a cohort of 10 weigh ~2 kB more per client.
    assert 1.0 < ratio < 1.5, ratio
    print(f"bytes up per client, secure / plain, tiny_mlp, cohort 10: {ratio:.3f}")


def test_the_fd_cost_model_counts_the_holds_a_masked_upload_carries(tmp_path: Path) -> None:
    """``fedge cost --secure-aggregation``'s FD row is the simulated secure run's ledger: each update is the C x C
    outputs and the C holds (float32), the broadcast the C x C average and the C counts."""
    cfg = _config(algorithm="fd", num_clients=6, rounds=2, secure_aggregation=True)
    result = run_inprocess(cfg, tmp_path / "fd")
    exp = prepare(cfg)
    costs = {
        secure: algorithm_round_cost(
            get_algorithm("fd").traffic,
            model="tiny_mlp",
            input_shape=exp.input_shape,
            num_classes=exp.num_classes,
            num_clients=6,
            secure_aggregation=secure,
        )
        for secure in (True, False)
    }
    ledger = read_ledger_csv(result.path / "ledger.csv")
    for rnd in (1, 2):
        assert sum(e.tensor_bytes for e in ledger if e.round == rnd and e.kind == "update") == costs[True].bytes_up
    (broadcast,) = [e for e in ledger if e.kind == "broadcast"]  # round 2's: round 1 has no average yet
    assert broadcast.tensor_bytes == costs[True].bytes_down + costs[True].protocol_extra_down
    assert costs[True].bytes_up - costs[False].bytes_up == 6 * 4 * exp.num_classes  # the holds, 40 bytes a client


def test_dropouts_are_recorded_and_the_survivors_sum_is_used(tmp_path: Path) -> None:
    result = _run(tmp_path, "drops", rounds=3, secure_aggregation=True, simulate_dropouts=0.3)
    for r in result.rounds:
        assert r.aggregated
        gone = [d for d in r.drops if d.reason.startswith("secure aggregation:")]
        unmasking = int(r.metrics["secagg_vanished_unmasking"])
        assert len(gone) + unmasking == 3  # 30% of 10 sampled
        assert r.metrics["secagg_survivors"] == 10 - len(gone) == len(r.replied)
        assert not set(r.replied) & {d.client for d in gone}
    assert result.summary["final_accuracy"] > 0.5


def test_a_round_below_threshold_is_abandoned_logged_and_the_next_round_completes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """20 clients: SecAgg+'s sparse graph (k = 11, t = 6), so whether 30% vanishing leaves every secret t holders
    depends on who vanishes; with seed 4, round 1's do not (about 1 round in 5 at this setting), rounds 2-3's do."""
    with caplog.at_level("WARNING"):
        result = _run(tmp_path, "abandoned", num_clients=20, rounds=3, seed=4, secure_aggregation=True,
                      simulate_dropouts=0.3)  # fmt: skip
    assert [r.aggregated for r in result.rounds] == [False, True, True]
    first = result.rounds[0]
    assert first.abandoned.startswith("secure aggregation round abandoned at stage")
    assert first.metrics["secagg_degree"] == 11 and "secagg_survivors" not in first.metrics
    assert sum("secure aggregation round abandoned" in m and "skipped" in m for m in caplog.messages) == 1
    assert result.summary["skipped_rounds"] == [1] and "abandoned" in result.summary["skipped"][0]
    assert all(r.metrics["secagg_survivors"] >= 6 for r in result.rounds[1:])


def test_an_interrupted_run_resumes_to_the_same_model_bit_for_bit(tmp_path: Path) -> None:
    """Fresh keys and a new session after the restart; the sum, and so the model, is the uninterrupted run's."""
    cfg = _config(rounds=3, secure_aggregation=True, simulate_dropouts=0.3)
    reference = run_inprocess(cfg, tmp_path / "ref" / "run")
    with pytest.raises(Interrupted):
        run_inprocess(cfg, tmp_path / "killed" / "run", on_round=interrupt_after(1))
    resumed = run_inprocess(cfg, tmp_path / "killed" / "run", resume=True)
    assert resumed.summary["resumed_after"] == [1]
    a, b = _model(reference), _model(resumed)
    assert all(bool((a[k] == b[k]).all()) for k in a)  # type: ignore[union-attr]
    timings = {"secagg_s", "secagg_unmask_server_s"}
    assert [{k: v for k, v in row.items() if k not in timings} for row in lines(reference.path)] == [
        {k: v for k, v in row.items() if k not in timings} for row in lines(resumed.path)
    ]
    assert read_ledger_csv(reference.path / "ledger.csv") == read_ledger_csv(resumed.path / "ledger.csv")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--robust", "median"], "--robust median needs every client's update in the clear"),
        (["--transport", "mqtt", "--simulate-dropouts", "0.2"], "over MQTT the clients that vanish are real"),
    ],
)
def test_refusals_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    base = ["sim", "--dataset", "digits", "--num-clients", "4", "--rounds", "1", "--quiet", "--out", str(tmp_path)]
    assert main([*base, "--secure-aggregation", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedge: error:") and message in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())  # the run directory of a refused start is removed


def test_help_describes_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sim", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--secure-aggregation", "--secagg-clip", "--secagg-degree", "--secagg-threshold",
                 "--simulate-dropouts"):  # fmt: skip
        assert flag in out
    assert "the server learns only the sum" in out
