"""End-to-end in-process runs of every algorithm on small data, and the engine's rules (quorum, validation)."""

import math
from pathlib import Path

import pytest
import torch

from coordinator.engine import RoundEngine, sample_clients
from edge_client.client import EdgeClient
from fedge.accounting.cost import round_cost
from fedge.algorithms.dsfl import DSFLSettings
from fedge.config import RunConfig, TrainConfig
from fedge.errors import CodecError
from fedge.registry import ALGORITHMS
from fedge.wire.message import Message
from fedge_io.experiment import prepare
from sim.inprocess import InProcessTransport
from sim.run import run_inprocess

FAST = TrainConfig(lr=0.05, momentum=0.9, local_epochs=2, batch_size=32)


def _config(algorithm: str, **overrides) -> RunConfig:
    base = dict(
        algorithm=algorithm,
        dataset="synthetic",
        model="tiny_mlp",
        num_clients=6,
        rounds=4,
        partition="iid",
        train=FAST,
        open_size=600,
        algo=DSFLSettings(open_per_round=200, distill_lr=0.05, distill_epochs=2) if algorithm == "dsfl" else None,
    )
    base.update(overrides)
    return RunConfig(**base)


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_every_algorithm_learns_well_above_chance(algorithm: str, tmp_path: Path):
    # DS-FL's global model learns only from distillation on the open set, so it needs a few more rounds.
    result = run_inprocess(_config(algorithm, rounds=7 if algorithm == "dsfl" else 4), tmp_path / algorithm)
    accuracy = result.summary["final_accuracy"]
    assert accuracy is not None and accuracy > 0.5, f"{algorithm} reached only {accuracy:.1%} (chance is 10%)"
    for name in ("config.json", "partition.json", "metrics.jsonl", "ledger.csv", "summary.json"):
        assert (tmp_path / algorithm / name).exists()
    assert (tmp_path / algorithm / "global_model.safetensors").exists() == (algorithm != "fd")


def test_fedntd_learns_under_label_skew(tmp_path: Path):
    cfg = _config("fedntd", partition="shards", shards_per_client=2, rounds=5)
    summary = run_inprocess(cfg, tmp_path / "run").summary
    assert summary["final_accuracy"] > 0.4
    # How it ran, for the report's provenance line: GPU and CPU arithmetic differ at float-noise level.
    assert (summary["executor"], summary["workers"], summary["device"]) == ("sequential", 1, "cpu")


def test_dsfl_era_lowers_the_global_logit_entropy_below_sa(tmp_path: Path):
    entropies = {}
    for agg in ("era", "sa"):
        cfg = _config("dsfl", rounds=2, algo=DSFLSettings(aggregation=agg, open_per_round=200))
        entropies[agg] = run_inprocess(cfg, tmp_path / agg).rounds[-1].metrics["global_logit_entropy"]
    assert entropies["era"] < entropies["sa"]


def test_bytes_per_round_match_the_cost_model(tmp_path: Path):
    algorithms = ("fedavg", "scaffold", "fd", "dsfl")
    rounds = {a: run_inprocess(_config(a, rounds=1), tmp_path / a).rounds[0].bytes for a in algorithms}
    c = 10  # classes
    # FD: K uploads of C x C float32; broadcast (from round 2) adds C x C + C int32 counts.
    assert rounds["fd"].tensor_up == 6 * c * c * 4
    # DS-FL: K uploads of |o_r| x C float32; the index set travels as a seed.
    assert rounds["dsfl"].tensor_up == 6 * 200 * c * 4
    # FedAvg: tiny_mlp (inputs -> 32 -> C, no buffers) as float32, counted by hand from the data's input shape.
    features = math.prod(prepare(_config("fedavg")).input_shape)  # tiny_mlp flattens its inputs
    values = features * 32 + 32 + 32 * c + c
    up, down = rounds["fedavg"].tensor_up, rounds["fedavg"].tensor_down["multicast"]
    assert (up, down, rounds["fedavg"].tensor_down["unicast"]) == (6 * 4 * values, 4 * values, 6 * 4 * values)
    fl = round_cost("fl", num_clients=6, num_classes=c, model_values=values)
    dsfl = round_cost("dsfl", num_clients=6, num_classes=c, open_per_round=200)
    assert (fl.bytes_up, fl.bytes_down) == (up, down) and dsfl.bytes_up == rounds["dsfl"].tensor_up
    # SCAFFOLD: the model plus a control variate per trainable parameter, both ways (tiny_mlp has no BN buffers).
    assert rounds["scaffold"].tensor_up == 2 * up and rounds["scaffold"].tensor_down["multicast"] == 2 * down


def test_same_config_gives_the_same_model(tmp_path: Path):
    cfg = _config("fedntd", rounds=2)
    a = run_inprocess(cfg, tmp_path / "a")
    b = run_inprocess(cfg, tmp_path / "b")
    assert a.rounds[-1].accuracy == b.rounds[-1].accuracy
    from safetensors.torch import load_file

    wa, wb = (
        load_file(tmp_path / "a" / "global_model.safetensors"),
        load_file(tmp_path / "b" / "global_model.safetensors"),
    )
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_sampling_depends_only_on_seed_and_round():
    pool = [f"c{i:03d}" for i in range(100)]
    assert sample_clients(pool, 10, 0, 3) == sample_clients(list(reversed(pool)), 10, 0, 3)
    assert sample_clients(pool, 10, 0, 3) != sample_clients(pool, 10, 0, 4)
    assert len(set(sample_clients(pool, 10, 0, 3))) == 10


class _Misbehaving(EdgeClient):
    """A client whose update is wrong in a chosen way."""

    def __init__(self, inner: EdgeClient, fault: str) -> None:
        super().__init__(inner.client_id, inner.data, inner.backend)
        self.fault = fault

    def handle(self, task: Message, broadcast: Message | None) -> Message:
        reply = super().handle(task, broadcast)
        tensors = dict(reply.tensors)
        if self.fault == "shape":
            name = next(iter(tensors))
            tensors[name] = torch.zeros(3)
        elif self.fault == "round":
            return Message(
                reply.kind, reply.round + 1, run=reply.run, client=reply.client, params=reply.params, tensors=tensors
            )
        elif self.fault == "nan":
            name = next(iter(tensors))
            tensors[name] = torch.full_like(tensors[name], float("nan"))
        elif self.fault == "crash":
            raise CodecError("simulated failure")
        return Message(
            reply.kind, reply.round, run=reply.run, client=reply.client, params=reply.params, tensors=tensors
        )


def _engine(cfg: RunConfig, faults: dict[str, str]) -> RoundEngine:
    from fedge.learning.backend import TorchBackend

    exp = prepare(cfg)
    backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes)
    clients = []
    for cid in sorted(exp.parts):
        client = EdgeClient(cid, exp.client_data(cid, exp.open_x()), backend)
        clients.append(_Misbehaving(client, faults[cid]) if cid in faults else client)
    x, y = exp.test_tensors()
    return RoundEngine(exp.config, exp.strategy("run"), InProcessTransport(clients), x, y)


def test_bad_replies_are_rejected_with_reasons_and_the_run_goes_on():
    cfg = _config("fedavg", rounds=2, min_replies=0.5)
    history = _engine(cfg, {"c000": "shape", "c001": "round", "c002": "nan"}).run()
    first = history.rounds[0]
    by_client = {r.client: r for r in first.rejections}
    assert set(by_client) == {"c000", "c001", "c002"}
    assert by_client["c000"].category == "invalid" and "expected" in by_client["c000"].detail
    assert by_client["c001"].category == "wrong round"
    assert by_client["c002"].category == "invalid" and "NaN" in by_client["c002"].detail
    assert first.aggregated and first.dropped == ("c000", "c001", "c002")
    assert history.rounds[-1].accuracy is not None and history.rounds[-1].accuracy > 0.3


def test_a_round_below_quorum_is_skipped_and_the_model_kept():
    cfg = _config("fedavg", rounds=2, min_replies=1.0)
    engine = _engine(cfg, {"c003": "crash"})
    before = {k: v.clone() for k, v in engine.strategy.global_weights().items()}
    history = engine.run()
    assert [r.aggregated for r in history.rounds] == [False, False]
    (failed,) = history.rounds[0].rejections
    assert (failed.client, failed.category, failed.detail) == ("c003", "client failed", "simulated failure")
    assert all(torch.equal(before[k], v) for k, v in engine.strategy.global_weights().items())


def test_skipped_rounds_say_why_in_the_summary_and_fail_the_exit_status_unless_allowed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from fedge_io.console import skipped_rounds_status
    from fedge_io.rundir import summarize

    cfg = _config("fedavg", rounds=2, min_replies=1.0)
    history = _engine(cfg, {"c003": "crash"}).run()
    summary = summarize(history.rounds, {})
    assert summary["skipped_rounds"] == [1, 2]
    first = summary["skipped"][0]
    assert first["round"] == 1 and first["replied"] == first["sampled"] - 1 == first["quorum"] - 1
    assert first["clients"] == {"c003": "rejected: client failed"}
    assert skipped_rounds_status(summary, allowed=False) == 3
    out, err = capsys.readouterr()
    assert "round 1: 5 of 6 replies, quorum 6 (c003 rejected: client failed)" in out
    assert "2 round(s) were skipped" in err and "--allow-skipped-rounds" in err
    assert skipped_rounds_status(summary, allowed=True) == 0
    assert skipped_rounds_status({"skipped": []}, allowed=False) == 0
