"""FedCurv, two rounds of two clients, against its local loss by hand, with the FedNTD authors' Fisher."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from algorithm_support import (
    NUM_CLASSES,
    W0,
    X_A,
    X_B,
    Y_A,
    Y_B,
    LinearBackend,
    TwoClients,
    assert_mqtt_run_matches_inprocess,
    ce_gradient,
    config,
    linear,
)

from coordinator.run import admission_rule
from edge_client.cli import runtime_capabilities
from fedge.accounting.cost import CostInputs
from fedge.algorithms.base import ClientData, ServerContext
from fedge.algorithms.fedcurv import (
    FISHER_U,
    FISHER_V,
    FedCurv,
    FedCurvClient,
    FedCurvSettings,
    FedCurvTask,
    fedcurv_traffic,
)
from fedge.config import RunConfig, TrainConfig
from fedge.errors import CodecError
from fedge.wire import fields as wire
from fedge.wire.protocol import ClientStatus
from fedge_io.experiment import prepare

LAM, LR, STEPS = 0.7, 0.5, 2
ZERO = torch.zeros_like(W0)


def _local(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    for _ in range(STEPS):  # full-batch steps on CE + lambda * (P . w^2 - 2 Q . w)
        w = w - LR * (ce_gradient(w, x, y) + LAM * (2 * p * w - 2 * q))
    return w


def _fisher(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One batch holds every sample (< 500): the Fisher is the squared gradient of the mean CE at the trained w."""
    return ce_gradient(w, x, y) ** 2


def test_two_rounds_pull_each_client_to_the_other_ones_weights_by_its_fisher() -> None:
    run = TwoClients(config("fedcurv", FedCurvSettings(curv_lambda=LAM), local_epochs=STEPS))
    run.round(1)  # nothing kept yet: plain local steps
    w = {"a": _local(X_A, Y_A, W0, ZERO, ZERO), "b": _local(X_B, Y_B, W0, ZERO, ZERO)}
    server = (2 * w["a"] + w["b"]) / 3
    assert torch.allclose(run.global_weight(), server, atol=1e-6)
    u = {"a": _fisher(w["a"], X_A, Y_A), "b": _fisher(w["b"], X_B, Y_B)}
    v = {c: u[c] * w[c] for c in u}
    for c in u:
        assert torch.allclose(run.upload(1, c, FISHER_U + "weight"), u[c], atol=1e-7)
        assert torch.allclose(run.upload(1, c, FISHER_V + "weight"), v[c], atol=1e-7)
    run.round(2)  # the broadcast carries the sums; each client takes its own terms out
    assert torch.allclose(run.broadcast(2, FISHER_U + "weight"), u["a"] + u["b"], atol=1e-7)
    a2 = _local(X_A, Y_A, server, u["b"], v["b"])
    b2 = _local(X_B, Y_B, server, u["a"], v["a"])
    assert torch.allclose(run.global_weight(), (2 * a2 + b2) / 3, atol=1e-6)
    assert not torch.allclose(a2, _local(X_A, Y_A, server, ZERO, ZERO), atol=1e-4)  # the penalty changed the steps
    request = run.backend("a").requests[-1]
    (pull,) = request.terms  # the Fisher-weighted pull with mu = 2 lambda, and the Fisher pass asked for
    assert pull.term.kind == "fisher_prox" and pull.term.mu == 2 * LAM and request.fisher_samples == 500


def test_updates_and_broadcasts_carry_the_two_fisher_terms_and_a_negative_fisher_is_refused() -> None:
    run = TwoClients(config("fedcurv"))
    record = run.round(1)
    # Three times FedAvg's tensor bytes each way (3 x 2 float32 weights, u and v as many), as the cost model says.
    traffic = fedcurv_traffic(CostInputs(model_values=6, trainable_values=6, num_classes=3, num_clients=2))
    assert record.bytes.tensor_up == 2 * traffic.up_per_client == 2 * 3 * 6 * 4
    assert record.bytes.tensor_down["multicast"] == traffic.down_broadcast
    reply = run.transport.replies[1]["a"]
    hostile = dataclasses.replace(reply, round=2, tensors={**reply.tensors, FISHER_U + "weight": -torch.ones(3, 2)})
    run.strategy.configure(2, ["a", "b"])
    with pytest.raises(CodecError, match="negative values"):
        run.strategy.check_reply(2, "a", hostile)
    moved = {**reply.tensors, FISHER_V + "weight": reply.tensors[FISHER_V + "weight"] + 1e-3}  # pulls others off w_a
    with pytest.raises(CodecError, match=r"is not 'fisher_u\.weight' times the update's weights"):
        run.strategy.check_reply(2, "a", dataclasses.replace(reply, round=2, tensors=moved))
    run.strategy.check_reply(2, "a", dataclasses.replace(reply, round=2))  # the honest reply passes


def test_a_lossy_upload_codec_may_move_a_small_fisher_value_below_zero_and_is_clamped_not_refused() -> None:
    run = TwoClients(dataclasses.replace(config("fedcurv"), upload_codec="int8"))
    run.round(1)  # over the int8 codec: no rejection
    replies = dict(run.transport.replies[1])
    decoded = replies["a"]  # as a lossy decode may give it: a value a little below zero
    u = decoded.tensors[FISHER_U + "weight"].clone()
    u[0, 0] = -1e-6
    replies["a"] = dataclasses.replace(decoded, round=2, tensors={**decoded.tensors, FISHER_U + "weight": u})
    replies["b"] = dataclasses.replace(replies["b"], round=2)
    run.strategy.configure(2, ["a", "b"])
    run.strategy.aggregate(2, {c: run.strategy.accept(2, c, reply) for c, reply in replies.items()})
    kept, _ = run.strategy.sums()
    assert float(kept["weight"][0, 0]) == float(replies["b"].tensors[FISHER_U + "weight"][0, 0])  # a's clamped to 0


def test_every_training_runtime_is_admitted_and_an_inference_only_one_is_refused_with_the_reason() -> None:
    exp = prepare(RunConfig(algorithm="fedcurv", dataset="digits", model="tiny_mlp", num_clients=3))
    admit = admission_rule(exp)

    def hello(runtime: str) -> ClientStatus:
        return ClientStatus(
            client="c001",
            state="online",
            runtime=runtime,
            dataset_size=len(exp.parts["c001"]),
            model=exp.model,
            input_shape=exp.input_shape,
            num_classes=exp.num_classes,
            capabilities=runtime_capabilities(runtime, False),
        )

    for runtime in ("torch", "executorch", "onnxruntime-training"):  # the local term runs in every runtime's programs
        assert admit(hello(runtime)) is None, runtime
    why = admit(hello("onnxruntime"))
    assert why is not None and "cannot run 'fedcurv'" in why


@pytest.mark.broker
def test_over_the_secured_embedded_broker_it_gives_the_in_process_model(tmp_path: Path) -> None:
    """Each client process keeps its own (u_k, v_k) across rounds in its store, as the in-process clients do."""
    train = TrainConfig(local_epochs=1)
    cfg = RunConfig(algorithm="fedcurv", dataset="digits", model="tiny_mlp", num_clients=3, rounds=3, train=train)
    assert_mqtt_run_matches_inprocess(cfg, tmp_path)


def _norm(u: dict[str, torch.Tensor]) -> float:
    return float(torch.stack([(t * t).sum() for t in u.values()]).sum().sqrt())


def test_under_a_clip_factor_one_clients_huge_fisher_is_scaled_to_the_median_and_v_is_kept_as_u_times_w() -> None:
    """A deployment's clip factor bounds what one client's Fisher does to the others' pull (a huge u would make their
    loss overflow, every later update non-finite and refused); the kept v is the server's u * w, whatever was sent."""
    run = TwoClients(dataclasses.replace(config("fedcurv"), algo=FedCurvSettings(clip_factor=1.0)))
    run.round(1)
    replies = {c: dataclasses.replace(m, round=2) for c, m in run.transport.replies[1].items()}
    sent = replies["a"].tensors
    huge = {k: t * 1e6 if k.startswith(FISHER_U) else t for k, t in sent.items()}
    huge.update(
        {FISHER_V + k[len(FISHER_U) :]: t * sent[k[len(FISHER_U) :]] for k, t in huge.items() if k.startswith(FISHER_U)}
    )  # v = u * w still
    replies["a"] = dataclasses.replace(replies["a"], tensors=huge)
    run.strategy.configure(2, ["a", "b"])
    run.strategy.aggregate(2, {c: run.strategy.accept(2, c, reply) for c, reply in replies.items()})
    (ua, va), (ub, _) = run.strategy._terms["a"], run.strategy._terms["b"]
    huge_u = {k: huge[FISHER_U + k] for k in ua}
    assert _norm(ua) == pytest.approx(_norm(ub), rel=1e-5) and _norm(huge_u) > 1e5 * _norm(ua)
    assert all(torch.equal(va[k], ua[k] * replies["a"].tensors[k]) for k in ua)
    # Without a clip factor (the simulator's papers' setting) the terms are kept as sent.
    plain = TwoClients(config("fedcurv"))
    plain.round(1)
    replies = {c: dataclasses.replace(m, round=2) for c, m in plain.transport.replies[1].items()}
    replies["a"] = dataclasses.replace(replies["a"], tensors=huge)
    plain.strategy.configure(2, ["a", "b"])
    plain.strategy.aggregate(2, {c: plain.strategy.accept(2, c, reply) for c, reply in replies.items()})
    assert _norm(plain.strategy._terms["a"][0]) == pytest.approx(_norm(huge_u))


# Whose uploads the server keeps, round by round (every client uploads): a's reply was dropped (deadline, refused,
# offline) in its first round, or in its second after its first one's terms were kept.
DROPPED = {"its first reply": ["bc"], "its second reply": ["abc", "bc"]}


@pytest.mark.parametrize("dropped", DROPPED)
def test_a_client_whose_reply_was_dropped_subtracts_only_the_terms_the_server_holds(dropped: str) -> None:
    """The real halves, three clients. In the next round client a's P and Q are the sums of the terms the server
    holds of the *other* clients (its own kept ones taken out, or none when it holds none), not the broadcast sums
    minus its last upload's terms, which the server never received."""
    data = {
        "a": ClientData(X_A, Y_A, NUM_CLASSES),
        "b": ClientData(X_B, Y_B, NUM_CLASSES),
        "c": ClientData(torch.tensor([[0.5, 1.0], [1.0, 0.2]]), torch.tensor([1, 0]), NUM_CLASSES),
    }
    server = FedCurv(config("fedcurv", FedCurvSettings(curv_lambda=LAM)), ServerContext(linear, NUM_CLASSES, "t"))
    half, stores = FedCurvClient(), {c: dict[str, torch.Tensor]() for c in data}
    backends = {c: LinearBackend() for c in data}
    for rnd, kept in enumerate(DROPPED[dropped], 1):
        plan = server.configure(rnd, list(data))
        assert plan.broadcast is not None
        uploads = {c: half.step(plan.tasks[c], plan.broadcast, data[c], backends[c], stores[c]) for c in data}
        server.aggregate(rnd, {c: server.accept(rnd, c, uploads[c]) for c in kept})
    plan = server.configure(len(DROPPED[dropped]) + 1, ["a"])
    told = wire.from_params(FedCurvTask, plan.tasks["a"].params).kept_round
    assert told == (1 if dropped == "its second reply" else 0)
    assert plan.broadcast is not None
    half.step(plan.tasks["a"], plan.broadcast, data["a"], backends["a"], stores["a"])
    (pull,) = backends["a"].requests[-1].terms
    p, q = ([server._terms[c][i]["weight"] for c in "bc"] for i in (0, 1))  # the others' kept u and v
    assert torch.allclose(pull.tensors["weights"]["weight"], p[0] + p[1], atol=1e-7)
    anchor = torch.where(p[0] + p[1] > 0, (q[0] + q[1]) / (p[0] + p[1]), torch.zeros_like(p[0]))
    assert torch.allclose(pull.tensors["anchor"]["weight"], anchor, atol=1e-5)
