"""fedge.compression.strategy: compressed broadcasts and uploads for every algorithm, decoded before the algorithm sees
them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from coordinator.replies import RoundContext, judge_reply
from edge_client.client import EdgeClient
from fedge.accounting.ledger import read_ledger_csv
from fedge.algorithms import make_strategy
from fedge.algorithms.base import ServerContext, Strategy
from fedge.algorithms.compressed import CompressedStrategy
from fedge.algorithms.dsfl import DSFLSettings
from fedge.algorithms.fednova import FedNovaReport
from fedge.compression import codecs as cz
from fedge.compression.strategy import FEEDBACK, UPLOAD_PREFIX
from fedge.config import RunConfig, TrainConfig
from fedge.errors import CodecError, ConfigError
from fedge.learning.backend import TorchBackend
from fedge.wire.message import encode
from fedge.wire.protocol import RAW_BYTES, SESSION
from fedge_io.experiment import Experiment, prepare
from sim.run import run_inprocess

# Digits, 4 clients, IID: a run that learns in 3 rounds, small enough for a unit test.
BASE = RunConfig(
    algorithm="fedavg",
    dataset="digits",
    num_clients=4,
    rounds=3,
    partition="iid",
    train=TrainConfig(lr=0.05, momentum=0.5, lr_decay=1.0, local_epochs=1),
)


def _backend(exp: Experiment) -> TorchBackend:
    return TorchBackend(exp.model, exp.input_shape, exp.num_classes)


def _run(tmp_path: Path, name: str, **changes: object):  # type: ignore[no-untyped-def]
    config = dataclasses.replace(BASE, **changes)  # type: ignore[arg-type]
    return run_inprocess(config, tmp_path / name)


def test_schemes_are_checked_against_the_algorithm() -> None:
    c = dataclasses.replace(BASE, upload_codec="int8", broadcast_codec="float16").compression
    assert c.upload.delta and c.upload.granularity == "tensor"  # weights travel as deltas
    c = dataclasses.replace(BASE, algorithm="dsfl", algo=None, upload_codec="topk:k=2").compression
    assert c.upload.granularity == "row" and not c.upload.delta  # soft labels: per row, absolute
    with pytest.raises(ConfigError, match="a weight broadcast can be float32 or float16 only"):
        dataclasses.replace(BASE, broadcast_codec="int8")
    with pytest.raises(ConfigError, match="unknown compression scheme 'int4'"):
        dataclasses.replace(BASE, upload_codec="int4")
    with pytest.raises(ConfigError, match="topk needs exactly one of k > 0 or density"):
        dataclasses.replace(BASE, upload_codec="topk")


def test_the_wrapper_is_a_strategy_that_answers_as_the_algorithm_does() -> None:
    """No delegation by attribute lookup: every Strategy member is the wrapper's, the non-message ones the algorithm's
    (FedNova's report type, its state, its global weights)."""
    config = dataclasses.replace(BASE, algorithm="fednova", algo=None, upload_codec="int8")
    exp = prepare(config)
    strategy = exp.strategy("run")
    assert isinstance(strategy, CompressedStrategy) and isinstance(strategy, Strategy)
    inner = strategy.inner
    assert strategy.report_type is FedNovaReport is inner.report_type
    assert strategy.reply_tolerance == inner.reply_tolerance > 0  # int8 rows: the algorithm's checks allow it
    assert strategy.settings is inner.settings and strategy.stop_before(1) == inner.stop_before(1) == ""
    assert strategy.global_weights() is inner.global_weights()
    tensors, values = strategy.state()
    assert tensors.keys() == inner.state()[0].keys() and values == inner.state()[1]
    with pytest.raises(AttributeError):
        strategy.averaging_weights  # noqa: B018  # FedAvg's own method is not a Strategy's: not passed through


def test_int8_weight_deltas_and_a_float16_broadcast_cut_bytes_and_keep_the_model(tmp_path: Path) -> None:
    plain = _run(tmp_path, "plain")
    small = _run(tmp_path, "small", upload_codec="int8:block=256", broadcast_codec="float16")
    ratio = small.rounds[-1].bytes.tensor_up / plain.rounds[-1].bytes.tensor_up
    assert 0.25 < ratio < 0.26  # one byte per value plus one float32 scale per 256 values
    assert abs(small.rounds[-1].accuracy - plain.rounds[-1].accuracy) <= 0.02  # type: ignore[operator]
    entries = read_ledger_csv(tmp_path / "small" / "ledger.csv")
    up = [e for e in entries if e.direction == "up"]
    down = [e for e in entries if e.kind == "broadcast"]
    assert up and all(3.9 < e.uncompressed_bytes / e.tensor_bytes < 4.0 for e in up)  # int8 codes + scales
    assert all(e.uncompressed_bytes == 2 * e.tensor_bytes for e in down)  # float16: exactly half


def test_top_k_weight_uploads_keep_error_feedback_per_coordinator_session() -> None:
    config = dataclasses.replace(BASE, upload_codec="topk:density=0.05")
    exp = prepare(config)
    strategy = exp.strategy("run")
    assert isinstance(strategy, CompressedStrategy)
    plan = strategy.configure(1, ["c000"])
    task = plan.tasks["c000"]
    assert task.params[FEEDBACK] == "1" and task.params[UPLOAD_PREFIX + "name"] == "topk"
    client = EdgeClient("c000", exp.client_data("c000", exp.open_x()), _backend(exp))
    task = dataclasses.replace(task, transport={SESSION: "s1"})
    reply = client.handle(task, plan.broadcast)
    residual = {k: v for k, v in client.store.items() if k.startswith("codec.residual.")}
    assert residual and sum(float(v.abs().sum()) for v in residual.values()) > 0  # 95% of the update waits
    report = strategy.check_reply(1, "c000", reply)
    assert report.num_examples > 0
    # A new coordinator session: the residual left against the old session's model is dropped, not added.
    client.handle(dataclasses.replace(task, transport={SESSION: "s2"}), plan.broadcast)
    fresh = {k: v for k, v in client.store.items() if k.startswith("codec.residual.")}
    assert set(fresh) == set(residual)
    again = EdgeClient("c000", exp.client_data("c000", exp.open_x()), _backend(exp))
    again.handle(dataclasses.replace(task, transport={SESSION: "s2"}), plan.broadcast)
    for k in fresh:  # the same as a client that never had a residual
        torch.testing.assert_close(fresh[k], again.store[k])


def test_a_reply_declaring_another_scheme_is_rejected_with_the_reason() -> None:
    config = dataclasses.replace(BASE, upload_codec="int8")
    exp = prepare(config)
    strategy = exp.strategy("run")
    plan = strategy.configure(1, ["c000"])
    client = EdgeClient("c000", exp.client_data("c000", exp.open_x()), _backend(exp))
    honest = client.handle(plan.tasks["c000"], plan.broadcast)
    assert honest.params["codec.name"] == "int8" and int(honest.params[RAW_BYTES]) > 3 * honest.tensor_bytes
    # The same update sent as float16 instead of the int8 the task asked for.
    task = dataclasses.replace(
        plan.tasks["c000"],
        params={**plan.tasks["c000"].params, **cz.Scheme("float16", delta=True).to_meta(UPLOAD_PREFIX)},
    )
    liar = EdgeClient("c000", exp.client_data("c000", exp.open_x()), _backend(exp)).handle(task, plan.broadcast)
    ctx = RoundContext(1, frozenset({"c000"}), lambda c, m: strategy.accept(1, c, m))
    verdict = judge_reply(encode(liar), "c000", ctx)
    assert verdict.rejection is not None and verdict.rejection.category == "invalid"
    assert "declares compression float16(delta), expected int8(delta)" in verdict.rejection.reason
    plain = dataclasses.replace(honest, params={k: v for k, v in honest.params.items() if not k.startswith("codec")})
    with pytest.raises(CodecError, match="declares no compression scheme"):
        strategy.check_reply(1, "c000", plain)
    assert judge_reply(encode(honest), "c000", ctx).accepted


@pytest.mark.parametrize("upload", ["float16", "int8:row,offset", "topk:k=3"])
def test_ds_fl_soft_labels_travel_compressed_and_still_face_the_probability_checks(upload: str) -> None:
    config = dataclasses.replace(
        BASE,
        algorithm="dsfl",
        open_size=200,
        private_size=800,
        algo=DSFLSettings(open_per_round=200),
        upload_codec=upload,
        broadcast_codec=upload,
    )
    exp = prepare(config)
    strategy = make_strategy(config, ServerContext(exp.model_factory, exp.num_classes, "run", exp.open_x()))
    plan = strategy.configure(1, ["c000"])
    client = EdgeClient("c000", exp.client_data("c000", exp.open_x()), _backend(exp))
    reply = client.handle(plan.tasks["c000"], plan.broadcast)
    assert reply.tensor_bytes < 200 * 10 * 4 * 0.6  # fewer bytes than float32 soft labels
    strategy.check_reply(1, "c000", reply)
    # A hostile client's rows that are no probability vectors are still refused after decoding.
    coded = cz.encode({"soft_labels": torch.full((200, 10), 0.5)}, config.compression.upload)
    hostile = dataclasses.replace(reply, tensors=coded.tensors, params={**reply.params, **coded.meta})
    with pytest.raises(CodecError, match="probability vectors"):
        strategy.check_reply(1, "c000", hostile)
