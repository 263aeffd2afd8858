"""Secure aggregation of FD (per-class output sums and per-class holder counts, both summed unweighted; each client
takes itself out of the sums itself, where it is in them). On hand-built rounds, with and without clients vanishing at
random stages, the secure result is the plaintext algorithm's over the survivors within the fixed-point bound (each
client's stochastic rounding is off by less than one code 2^-frac_bits, so a summed part by less than |U3|
2^-frac_bits per value); a part left out or a wrong part is caught."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch
from algorithm_support import NUM_CLASSES, X_A, Y_A, LinearBackend, config, linear
from torch import nn

from fedge.algorithms import make_strategy
from fedge.algorithms.base import CheckedReply, ClientData, ServerContext, Strategy
from fedge.algorithms.fd import CLASS_HOLDS, FDClient, FDReport, FDTask, FederatedDistillation
from fedge.algorithms.secure_aggregation import SecureAggregationStrategy
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.secagg.parts import SecurePart
from fedge.secagg.rounds import SUM_CLIENT
from fedge.wire import fields as wire
from fedge.wire.message import UPDATE, Message

RUN = "run"
N = 10
C = 3  # classes
CLIENTS = [f"c{i}" for i in range(N)]
CLIP = 4.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(5, C)


def _pair(algorithm: str, dropouts: float, **overrides: object) -> tuple[SecureAggregationStrategy, Strategy[Any]]:
    """The secure strategy and the plaintext one of the same run (secure aggregation and dropouts off)."""
    secure_config = RunConfig(
        algorithm=algorithm,
        dataset="synthetic",
        num_clients=N,
        secure_aggregation=True,
        secagg_clip=CLIP,
        simulate_dropouts=dropouts,
        seed=3,
        **overrides,  # type: ignore[arg-type]
    )
    plain_config = dataclasses.replace(secure_config, secure_aggregation=False, simulate_dropouts=0.0)
    context = ServerContext(_model, C, RUN)
    secure = make_strategy(secure_config, context)
    assert isinstance(secure, SecureAggregationStrategy)
    return secure, make_strategy(plain_config, context)


def _resolution(secure: SecureAggregationStrategy) -> float:
    return secure._round_config(1, CLIENTS).plan.resolution  # C = 4, N = 10: 2^-24


def _survivors(secure: SecureAggregationStrategy) -> list[str]:
    assert secure.last is not None
    return list(secure.last.result.survivors)


# --- FD --------------------------------------------------------------------------------------------------------------


def _fd_updates(rnd: int) -> dict[str, Message]:
    """Each client's per-class mean outputs (random probability rows; clients 0, 2, 4, ... have no sample of class
    i mod 3: a zero row), the holds that go with them, and per-class test counts."""
    gen = torch.Generator().manual_seed(rnd)
    out = {}
    for i, c in enumerate(CLIENTS):
        probs = torch.softmax(3 * torch.randn(C, C, generator=gen), dim=1)
        if i % 2 == 0:
            probs[i % C] = 0.0
        holds = (probs.sum(dim=1) > 0).to(torch.float32)
        report = FDReport(num_examples=50 + i, loss=1.0, eval_correct=(i, 1, 2), eval_total=(10, 10, 10 + i))
        tensors = {"class_probs": probs, CLASS_HOLDS: holds}
        out[c] = Message(UPDATE, rnd, run=RUN, client=c, params=wire.to_params(report), tensors=tensors)
    return out


def _fd_round(secure: SecureAggregationStrategy, plain: Strategy[Any]) -> tuple[float, list[str]]:
    """One FD round both ways over the same uploads; the worst error of the secure global outputs over the
    fixed-point bound |U3| 2^-frac (a row's mean is its sum over |K_n| >= 1), and the survivors. The holder counts
    are exact (a hold is 0 or 1: exact in the fixed point)."""
    secure.configure(1, CLIENTS)
    updates = _fd_updates(1)
    secure.aggregate(1, {c: secure.accept(1, c, updates[c]) for c in CLIENTS})
    survivors = _survivors(secure)
    plain.configure(1, CLIENTS)
    clear = {
        c: dataclasses.replace(updates[c], tensors={"class_probs": updates[c].tensors["class_probs"]})
        for c in survivors
    }
    plain.aggregate(1, {c: plain.accept(1, c, clear[c]) for c in survivors})
    after, reference = secure.state()[0], plain.state()[0]
    assert torch.equal(after["contributors"], reference["contributors"])
    worst = float((after["global_probs"].double() - reference["global_probs"].double()).abs().max())
    return worst / (len(survivors) * _resolution(secure) + 1e-7), survivors  # + float32 rounding of values <= 1


@pytest.mark.parametrize("dropouts", [0.0, 0.3])
def test_fd_global_outputs_are_the_plaintext_average_of_the_survivors(dropouts: float) -> None:
    secure, plain = _pair("fd", dropouts)
    ratio, survivors = _fd_round(secure, plain)
    assert ratio <= 1.0
    assert (len(survivors) == N) == (dropouts == 0.0)
    x, y = torch.zeros(1, 5), torch.zeros(1, dtype=torch.long)  # FD evaluates nothing itself: the clients' counts
    evaluation, expected = secure.evaluate(x, y), plain.evaluate(x, y)
    assert evaluation is not None and expected is not None and evaluation.accuracy == expected.accuracy
    # Round 2: the broadcast names round 1 as its source, and each task says whether the client's upload is in it.
    plan = secure.configure(2, CLIENTS)
    assert plan.broadcast is not None and plan.broadcast.params["source_round"] == "1"
    told = {c: wire.from_params(FDTask, plan.tasks[c].params).in_sums for c in CLIENTS}
    assert told == {c: c in survivors for c in CLIENTS}
    assert all(wire.from_params(FDTask, t.params).secure for t in plan.tasks.values())
    plain_tasks = plain.configure(2, CLIENTS).tasks
    assert not any(
        k in t.params for t in plain_tasks.values() for k in ("secure", "in_sums")
    )  # nothing new in the clear


def test_fd_uploads_its_holds_and_the_ledger_counts_them() -> None:
    secure, _ = _pair("fd", 0.0)
    assert secure.reply_tensors()[CLASS_HOLDS] == ((C,), torch.float32)
    secure.configure(1, CLIENTS)
    updates = _fd_updates(1)
    metrics = secure.aggregate(1, {c: secure.accept(1, c, updates[c]) for c in CLIENTS})
    assert metrics["secagg_upload_tensor_bytes"] == 4 * (C * C + C)  # the update message carries both parts
    lying = dataclasses.replace(updates["c0"], tensors={**updates["c0"].tensors, CLASS_HOLDS: torch.ones(C)})
    with pytest.raises(Exception, match="class_holds must be 1 for the classes with a probability row"):
        secure.accept(1, "c0", lying)


def test_an_fd_part_left_out_or_wrong_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    declared = FederatedDistillation.secure_parts
    monkeypatch.setattr(FederatedDistillation, "secure_parts", lambda self: declared(self)[:1])  # no holds
    with pytest.raises(ConfigError, match="not declared in a part"):
        _pair("fd", 0.0)
    holds = SecurePart((CLASS_HOLDS,), relative=False, weighted=False, value_bound=1.0)
    weighted = (SecurePart(("class_probs",), relative=False, weighted=True, value_bound=1.0), holds)
    monkeypatch.setattr(FederatedDistillation, "secure_parts", lambda self: weighted)  # the mean, not the sum
    ratio, _ = _fd_round(*_pair("fd", 0.3))
    assert ratio > 100


@pytest.mark.parametrize("in_sums", [True, False])
def test_an_fd_client_leaves_itself_out_only_of_sums_it_is_in(in_sums: bool) -> None:
    """The real client half on secure sums that hold client a's rows (classes 0 and 1) and another client's ``o``
    (the same classes), or, when a's upload vanished in the protocol, ``o`` alone. Its targets are ``o`` either way:
    eq. 6's ``2 t_g - t_a`` where it is told it is in the sums, the broadcast average as is where it is not (taking
    itself out of sums it is not in would leave no other holder, and no target)."""
    cfg = dataclasses.replace(config("fd"), secure_aggregation=True)
    server = FederatedDistillation(cfg, ServerContext(linear, NUM_CLASSES, "t"))
    client, store, backend = FDClient(), dict[str, torch.Tensor](), LinearBackend()
    data = ClientData(X_A, Y_A, NUM_CLASSES)
    upload = client.step(server.configure(1, ["a"]).tasks["a"], None, data, backend, store)
    assert upload.tensor(CLASS_HOLDS).tolist() == [1.0, 1.0, 0.0]
    other = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.0, 0.0, 0.0]])
    sums, holds = other.clone(), torch.tensor([1.0, 1.0, 0.0])
    if in_sums:
        sums, holds = sums + upload.tensor("class_probs"), holds + upload.tensor(CLASS_HOLDS)
    report = FDReport(num_examples=2)
    server.secure_survivors(1, {"a": report, "b": report} if in_sums else {"b": report})
    stand_in = dataclasses.replace(upload, tensors={"class_probs": sums, CLASS_HOLDS: holds})
    server.aggregate(1, {SUM_CLIENT: CheckedReply(report, stand_in)})
    plan = server.configure(2, ["a"])
    client.step(plan.tasks["a"], plan.broadcast, data, backend, store)
    inputs = backend.requests[-1].inputs  # round 2's distillation (eq. 7)
    assert bool(inputs["mask"].all())
    assert torch.allclose(inputs["targets"], other[Y_A], atol=1e-6)


@pytest.mark.parametrize("algorithm", ["fd"])
def test_a_resumed_server_tells_the_clients_what_it_would_have(algorithm: str) -> None:
    """The state a coordinator journals holds what the secure rounds left (FD: who is in the sums): a strategy loaded
    from it configures the next round as the first."""
    secure, plain = _pair(algorithm, 0.3)
    _fd_round(secure, plain)
    tensors, values = secure.state()
    resumed, _ = _pair(algorithm, 0.3)
    resumed.load_state(tensors, json.loads(json.dumps(values)))  # the journal is JSON
    rnd = 2
    a, b = secure.inner.configure(rnd, CLIENTS), resumed.inner.configure(rnd, CLIENTS)
    assert {c: t.params for c, t in a.tasks.items()} == {c: t.params for c, t in b.tasks.items()}
    assert a.broadcast is not None and b.broadcast is not None and a.broadcast.params == b.broadcast.params
    assert all(torch.equal(t, b.broadcast.tensors[k]) for k, t in a.broadcast.tensors.items())
    told = "in_sums"
    assert len({t.params[told] for t in a.tasks.values()}) >= 2  # not all alike: the test is not vacuous
