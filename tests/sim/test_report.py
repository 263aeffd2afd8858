"""sim.report on run directories written by hand: labels, tables, plots and the errors a user can hit."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from markdown_support import has_row, table_rows

from fedge.accounting.ledger import BROADCAST_CLIENT, ByteLedger, LedgerEntry
from fedge.accounting.records import ByteCounts, Drop, Rejection, RoundRecord
from fedge.algorithms.dsfl import DSFLSettings
from fedge.config import RunConfig, TrainConfig
from fedge.errors import ConfigError, FedgeError
from fedge_io.rundir import RunWriter
from sim.report import write_report
from sim.report.runs import run_label

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HEADER = 40  # payload bytes a message adds on top of its tensors
SILENT = Drop("c001", "silent past the 300 s deadline", 300.0)  # as the MQTT transport drops a client
NAN_REJECTION = ("invalid", "tensor 'w' holds NaN or infinite values")  # what judge_reply records for a NaN update


def make_run(
    root: Path,
    name: str,
    config: RunConfig,
    accuracies: Sequence[float | None],
    *,
    up: int,
    down: int,
    entropy: Sequence[float] | None = None,
    initial: dict[str, int] | None = None,
    dropped: dict[int, list[Drop]] | None = None,
    rejected: dict[int, list[str]] | None = None,
    wire: int = 0,
) -> Path:
    """A run directory written by fedge_io.rundir's RunWriter from records built the way the round engine builds them:
    each sampled client uploads ``up`` tensor bytes, the server broadcasts ``down``; ``None`` accuracies are rounds
    without evaluation; ``wire`` > 0 adds that many MQTT bytes per message (and per broadcast copy) on top of the
    payload, as an MQTT run measures. The quorum is all sampled clients but one."""
    path = root / name
    initial = initial or {}
    clients = tuple(f"c{i:03d}" for i in range(config.clients_per_round))
    quorum = len(clients) - 1
    ledger = ByteLedger()
    writer = RunWriter(path, config, partition={})
    rounds: list[RoundRecord] = []
    best: float | None = None

    def mqtt(payload: int, copies: int) -> int:
        return copies * (payload + wire) if wire else 0

    for rnd, acc in enumerate(accuracies, start=1):
        gone = (dropped or {}).get(rnd, [])
        bad = (rejected or {}).get(rnd, [])
        sent = [
            c for c in clients if c not in {d.client for d in gone}
        ]  # a rejected upload still crossed the wire: it is counted

        ledger.extend(LedgerEntry(rnd, "up", c, "update", 1, up, up + HEADER, mqtt(up + HEADER, 1)) for c in sent)
        copies = len(clients)
        ledger.record(
            LedgerEntry(
                rnd, "down", BROADCAST_CLIENT, "broadcast", copies, down, down + HEADER, mqtt(down + HEADER, copies)
            )
        )
        replied = tuple(c for c in sent if c not in bad)
        if acc is not None:
            best = acc if best is None else max(best, acc)
        record = RoundRecord(
            round=rnd,
            sampled=clients,
            replied=replied,
            aggregated=len(replied) >= quorum,
            quorum=quorum,
            bytes=ByteCounts.of(ledger.round_bytes(rnd), rounds[-1].bytes if rounds else None, initial),
            drops=tuple(gone),
            rejections=tuple(Rejection(c, *NAN_REJECTION) for c in bad),
            metrics={"global_logit_entropy": entropy[rnd - 1]} if entropy is not None else {},
            accuracy=acc,
            per_class_accuracy=(acc, acc) if acc is not None else None,
            forgetting=best - acc if best is not None and acc is not None else None,
            wall_s=0.5,
            exchange_s=0.1,
        )
        writer.round(record)
        rounds.append(record)
    writer.finish(rounds, ledger, None, initial_bytes=initial, extra={"model": "tiny_mlp", "transport": "inprocess"})
    return path


def fedntd(root: Path) -> Path:
    config = RunConfig(algorithm="fedntd", dataset="digits", num_clients=4, rounds=3, partition="shards")
    return make_run(
        root, "fedntd", config, [0.5, 0.8, 0.91], up=40_000, down=40_000, dropped={2: [SILENT]}, rejected={3: ["c002"]}
    )


def dsfl(root: Path, aggregation: str, accuracies: Sequence[float | None], name: str = "") -> Path:
    config = RunConfig(
        algorithm="dsfl",
        dataset="digits",
        num_clients=4,
        rounds=len(accuracies),
        partition="shards",
        algo=DSFLSettings(aggregation=aggregation),
    )
    return make_run(
        root,
        name or f"dsfl-{aggregation}",
        config,
        accuracies,
        up=4_000,
        down=4_000,
        entropy=[2.0, 1.0, 0.5][: len(accuracies)],
        initial={"multicast": 600_000, "unicast": 2_400_000},
    )


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 10_000, f"{path} is only {len(data)} bytes"


def test_run_label():
    assert run_label(RunConfig(algorithm="fedntd", partition="shards", shards_per_client=2)) == "FedNTD (shards s=2)"
    assert run_label(RunConfig(algorithm="fedavg"), partition=False) == "FedAvg"
    era = RunConfig(algorithm="dsfl", partition="dirichlet", dirichlet_alpha=0.1)
    assert run_label(era) == "DS-FL ERA (Dir(α=0.1))"
    sa = RunConfig(algorithm="dsfl", algo=DSFLSettings(aggregation="sa"))
    assert run_label(sa, partition=False) == "DS-FL SA"


def test_report_overlays_runs(tmp_path):
    runs = [fedntd(tmp_path), dsfl(tmp_path, "era", [0.6, 0.85, 0.96]), dsfl(tmp_path, "sa", [0.4, 0.7, 0.82])]
    out = tmp_path / "out" / "nested"  # created on demand
    report = write_report(runs, out)
    assert report == out / "report.md"
    text = report.read_text()
    # Same partition for all runs: the labels name only the algorithm.
    for label, final in (("FedNTD", "91.00%"), ("DS-FL ERA", "96.00%"), ("DS-FL SA", "82.00%")):
        row = next(row for row in table_rows(text) if row[0] == label)
        assert final in row
    # ComU@x columns only for thresholds some run reached (0.97 none did); ComU@I for DS-FL's open set.
    assert "ComU@95%" in text and "ComU@97%" not in text
    assert "ComU@I" in text and "600.0 kB" in text and "2.4 MB" in text
    # FedNTD per round: 4 x 40 kB up + one 40 kB broadcast, 3 clients up in round 2 (c001 dropped).
    assert has_row(text, "1", "50.00%") and "200.0 kB" in text and "160.0 kB" in text
    assert has_row(text, "FedNTD", "2", "c001", "dropped: silent past the 300 s deadline")
    assert has_row(text, "FedNTD", "3", "c002", "rejected: invalid: tensor 'w' holds NaN or infinite values")
    assert "round skipped" not in text
    for name in (
        "accuracy_vs_round",
        "accuracy_vs_bytes",
        "bytes_per_round",
        "entropy_vs_round",
        "forgetting_vs_round",
    ):
        assert_png(out / f"{name}.png")
        assert f"]({name}.png)" in text
    assert "](../../fedntd), inprocess transport, seed 0" in text  # the run directories, relative to the report


def test_unicast_accounting_and_no_entropy(tmp_path):
    out = tmp_path / "out"
    text = write_report([fedntd(tmp_path)], out, accounting="unicast").read_text()
    assert "Down (unicast)" in text
    assert has_row(text, "1", "50.00%") and "320.0 kB" in text  # 4 uploads + 4 copies of the broadcast, 40 kB each
    assert not (out / "entropy_vs_round.png").exists() and "entropy_vs_round" not in text
    assert_png(out / "accuracy_vs_bytes.png")


def test_duplicate_labels_and_different_partitions(tmp_path):
    a = dsfl(tmp_path, "era", [0.5, 0.6], name="run-a")
    b = dsfl(tmp_path, "era", [0.55, 0.65], name="run-b")
    iid = RunConfig(algorithm="fedavg", num_clients=4, rounds=2, partition="iid")
    c = make_run(tmp_path, "fedavg", iid, [0.3, 0.4], up=1_000, down=1_000)
    text = write_report([a, b, c], tmp_path / "out").read_text()
    assert "DS-FL ERA (shards s=2) [run-a]" in text and "DS-FL ERA (shards s=2) [run-b]" in text
    assert "FedAvg (IID)" in text


def test_the_report_says_which_executor_and_device_ran_a_run(tmp_path):
    run = fedntd(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    summary.update(executor="processes", workers=15, device="cuda")
    (run / "summary.json").write_text(json.dumps(summary))
    text = write_report([run], tmp_path / "out").read_text()
    assert "inprocess transport, processes executor (15 worker(s)) on cuda, seed 0" in text


def test_the_report_records_each_runs_training_data_and_labels_augmented_runs_apart(tmp_path):
    plain = RunConfig(algorithm="fedavg", num_clients=4, rounds=2)
    paper = RunConfig(
        algorithm="fedavg", num_clients=4, rounds=2, train_size=50_000, train=TrainConfig(augment="paper")
    )
    a = make_run(tmp_path, "plain", plain, [0.3, 0.4], up=1_000, down=1_000)
    b = make_run(tmp_path, "paper", paper, [0.2, 0.3], up=1_000, down=1_000)
    text = write_report([a, b], tmp_path / "out").read_text()
    assert "- **FedAvg, no augmentation**: " in text and "seed 0, all training images, no augmentation" in text
    assert "- **FedAvg, augment paper, 50000 images**: " in text
    assert "seed 0, a seeded subset of 50,000 training images, augmentation 'paper' (random crop," in text
    alone = write_report([b], tmp_path / "alone").read_text()  # one run: nothing to tell apart, the label stays short
    assert "- **FedAvg**: " in alone


def test_runs_without_accuracy(tmp_path):
    config = RunConfig(algorithm="fedavg", num_clients=4, rounds=2)
    # As the in-process transport drops a client whose task failed: no time into the round (NaN).
    failed = [Drop(c, "client failed: no open set here") for c in ("c000", "c001")]
    run = make_run(tmp_path, "noeval", config, [None, None], up=1_000, down=1_000, dropped={1: failed})
    summary = json.loads((run / "summary.json").read_text(), parse_constant=pytest.fail)  # strict JSON: no NaN
    assert summary["drops"][0] == {"round": 1, "client": "c000", "reason": failed[0].reason, "after_s": None}
    out = tmp_path / "out"
    text = write_report([run], out).read_text()
    assert "No run recorded a test accuracy" in text and "round skipped" in text
    assert has_row(text, "FedAvg", "1", "c001", "dropped: client failed: no open set here")
    assert not (out / "accuracy_vs_round.png").exists() and not (out / "forgetting_vs_round.png").exists()
    assert_png(out / "bytes_per_round.png")


def test_run_without_ledger_or_summary(tmp_path):
    run = fedntd(tmp_path)
    written = json.loads((run / "summary.json").read_text())
    assert written["rejected_by_reason"] == {"invalid": 1}
    assert written["drops"] == [{"round": 2, "client": "c001", "reason": SILENT.reason, "after_s": 300.0}]
    (run / "ledger.csv").unlink()
    (run / "summary.json").unlink()  # an interrupted run: read_run summarizes the rounds itself
    text = write_report([run], tmp_path / "out").read_text()
    assert "no ledger.csv" in text and "91.00%" in text
    assert "unfinished (3 of 3 rounds recorded, no summary.json" in text and "unknown transport" not in text
    assert has_row(text, "tensor", "440.0 kB", "120.0 kB", "480.0 kB", "560.0 kB", "920.0 kB", "—")


def test_run_directory_of_an_earlier_version(tmp_path):
    """metrics.jsonl lines as fedge wrote them before typed records: no drop reasons, rejections as one string."""
    run = fedntd(tmp_path)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        for key in ("quorum", "drop_reasons", "drop_after_s"):
            line.pop(key, None)
        line["rejected"] = [{"client": r["client"], "reason": "non-finite values"} for r in line["rejected"]]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    text = write_report([run], tmp_path / "out").read_text()
    assert has_row(text, "FedNTD", "2", "c001", "dropped: no reply in time")
    assert has_row(text, "FedNTD", "3", "c002", "rejected: non-finite values")
    assert has_row(text, "1", "50.00%") and "200.0 kB" in text


def test_wire_bytes_of_an_mqtt_run(tmp_path):
    config = RunConfig(algorithm="fedavg", num_clients=4, rounds=1)
    run = make_run(tmp_path, "mqtt", config, [0.5], up=1_000, down=1_000, wire=60)
    text = write_report([run], tmp_path / "out").read_text()
    # 4 uploads of 1,040 payload + 60 wire bytes, 4 broadcast copies of the same: 8.8 kB, 10% over 8 kB of tensors.
    assert has_row(text, "wire (MQTT)", "4.4 kB", "—", "4.4 kB", "—", "8.8 kB", "+10.00%")


def test_not_a_run_directory(tmp_path):
    (tmp_path / "config.json").write_text(RunConfig().to_json())
    with pytest.raises(FedgeError, match=r"not a run directory.*metrics\.jsonl") as info:
        write_report([tmp_path], tmp_path / "out")
    assert str(tmp_path) in str(info.value)
    with pytest.raises(FedgeError, match="not a run directory"):
        write_report([tmp_path / "missing"], tmp_path / "out")
    with pytest.raises(ConfigError, match="accounting"):
        write_report([fedntd(tmp_path)], tmp_path / "out", accounting="broadcast")


def test_fedge_report_skips_what_is_not_a_run_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedge_cli.main import main

    runs = tmp_path / "runs"
    good = fedntd(runs)
    started = runs / "20260101-000000-fedavg-digits"  # a start that failed before its first round
    RunWriter(started, RunConfig(), {})
    (runs / "notes").mkdir()
    assert main(["report", str(good), str(started), str(runs / "notes"), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert f"fedge report: skipping {started}: it has no completed round yet" in err
    assert f"fedge report: skipping {runs / 'notes'}: it is not a run directory: it has no config.json" in err
    assert "FedNTD" in (tmp_path / "out" / "report.md").read_text()
    assert main(["report", str(started)]) == 2  # nothing left to report on: an error, as before
    assert "no run directory to report on" in capsys.readouterr().err
