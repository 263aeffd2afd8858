"""Secure aggregation of FD (per-class output sums and per-class holder counts, both summed unweighted) and FedCurv
(the model's weighted move and the sums of the clients' Fisher-term changes, which the server adds to its U and V; each
client keeps what U and V hold of it and subtracts that itself). On hand-built rounds, with and without clients
vanishing at random stages, the secure result is the plaintext algorithm's over the survivors within the fixed-point
bound (each client's stochastic rounding is off by less than one code 2^-frac_bits, so a summed part by less than
|U3| 2^-frac_bits per value, accumulated over rounds where the server keeps a running sum); a part left out, a wrong
part or a server that forgets who was in the sum is caught."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch
from algorithm_support import NUM_CLASSES, X_A, Y_A, LinearBackend, config, linear
from secagg_support import DeviceChannel
from torch import nn

from edge_client.secure import SecureRounds
from fedge.algorithms import make_strategy
from fedge.algorithms.base import CheckedReply, ClientData, ServerContext, Strategy, UpdateReport
from fedge.algorithms.fd import (
    CLASS_HOLDS,
    FDClient,
    FDReport,
    FDTask,
    FederatedDistillation,
    secure_class_average,
)
from fedge.algorithms.fedavg import LocalRound
from fedge.algorithms.fedcurv import FISHER_U, FedCurv, FedCurvClient, FedCurvSettings, FedCurvTask
from fedge.algorithms.secure_aggregation import SecureAggregationStrategy
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.learning.training import TrainStats
from fedge.secagg.parts import SecurePart
from fedge.secagg.rounds import SUM_CLIENT
from fedge.wire import fields as wire
from fedge.wire.message import UPDATE, Message, decode, encode

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
    plain_tasks = plain.configure(2, CLIENTS).tasks  # the clear's server averaged the survivors' replies only
    assert {c: wire.from_params(FDTask, t.params) for c, t in plain_tasks.items()} == {
        c: dataclasses.replace(wire.from_params(FDTask, plan.tasks[c].params), secure=None) for c in CLIENTS
    }  # the same in_sums, and no holds asked for


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


def test_hostile_fd_devices_move_no_broadcast_row_out_of_range_and_raise_nothing() -> None:
    """Three devices mask values an honest FD client never sends but the ring takes (each within the per-value clip
    C = 4): holds of +4 for class 0 and -4 for class 1, outputs of -4 in row 0 and +4 in row 2. After unmasking, class
    0's holder count is above |U3| and its sums negative, class 1's count negative, row 2's mean above 1. The server
    clamps them (counts to [0, |U3|], means to [0, 1], rows without a holder zero) and raises nothing, and an honest
    client distills on the result."""
    secure, _ = _pair("fd", 0.0)
    devices = {c: SecureRounds(c) for c in CLIENTS}
    secure.use_channel(DeviceChannel(devices, {}, run=RUN))
    plan = secure.configure(1, CLIENTS)  # FD's round 1 has no broadcast: the parameters ride in the tasks
    updates = _fd_updates(1)
    hostile = {"c0", "c1", "c2"}
    for c in hostile:
        probs = torch.zeros(C, C)
        probs[0], probs[2] = -CLIP, CLIP
        tensors = {"class_probs": probs, CLASS_HOLDS: torch.tensor([CLIP, -CLIP, 1.0])}
        updates[c] = dataclasses.replace(updates[c], tensors=tensors)
    replies = {}
    for c in CLIENTS:
        reply = devices[c].reply(decode(encode(plan.tasks[c])), None, updates[c])
        assert reply is not None
        replies[c] = secure.accept(1, c, decode(encode(reply)))
    secure.aggregate(1, replies)
    honest = [updates[c].tensors for c in CLIENTS if c not in hostile]
    counts = sum(t[CLASS_HOLDS] for t in honest) + torch.tensor([3 * CLIP, -3 * CLIP, 3.0])  # unclamped
    sums = sum(t["class_probs"] for t in honest)
    assert isinstance(sums, torch.Tensor) and counts[0] > N and counts[1] < 0 and bool((sums[0] < 3 * CLIP).all())
    assert bool((sums[2] + 3 * CLIP > counts[2]).all())  # row 2's mean above 1 before the clamp
    state = secure.state()[0]
    g, k = state["global_probs"], state["contributors"]
    assert k.tolist() == [N, 0, int(counts[2])]
    assert bool((g[0] == 0).all()) and bool((g[1] == 0).all()) and bool((g[2] == 1).all())
    broadcast = secure.configure(2, CLIENTS).broadcast
    assert broadcast is not None
    # A client new to the run (none of its outputs in the average) distills toward the broadcast rows as they are.
    task, backend = secure.inner.configure(2, ["new"]).tasks["new"], LinearBackend()
    x, y = torch.eye(3, 2), torch.tensor([0, 1, 2])  # a sample of each class
    FDClient().step(task, decode(encode(broadcast)), ClientData(x, y, NUM_CLASSES), backend, {})
    inputs = backend.requests[-1].inputs
    assert torch.equal(inputs["targets"], g[y]) and inputs["mask"].tolist() == [True, False, True]
    # A device that skips the clip wraps its codes around the ring: a decoded sum is then anything the ring holds.
    plan = secure._round_config(1, CLIENTS).plan
    top = 2.0 ** (plan.ring_bits - 1 - plan.frac_bits)  # the largest magnitude a decoded value can have
    sums = torch.tensor([[top, -top, 2.5], [-top, top, 0.0], [top, top, top]])
    g, k = secure_class_average(sums, torch.tensor([top, -top, 0.4]), N)
    assert k.tolist() == [N, 0, 0] and g.tolist() == [[1.0, 0.0, 0.25], [0.0] * 3, [0.0] * 3]


# --- FedCurv ---------------------------------------------------------------------------------------------------------


def _fedcurv_upload(
    client: FedCurvClient,
    plan_task: Message,
    broadcast: Message,
    store: dict[str, torch.Tensor],
    gen: torch.Generator,
    fisher_scale: float,
) -> dict[str, torch.Tensor]:
    """What a FedCurv client uploads after a round of local training that moved the broadcast weights by a random
    step and measured a random diagonal Fisher (the real client half's upload hook; training itself is not what
    this tests)."""
    weights = client.received_weights(broadcast)
    trained = {k: w + 0.1 * torch.randn(w.shape, generator=gen) for k, w in weights.items()}
    fisher = {k: fisher_scale * torch.rand(w.shape, generator=gen) for k, w in weights.items()}
    settings = FedCurvSettings()
    r = LocalRound(cast(Any, None), settings, cast(Any, None), cast(Any, None), store, broadcast, weights, plan_task)
    return client.upload(r, trained, TrainStats(steps=1, samples=1, mean_loss=0.0, fisher=fisher))


Stores = dict[str, dict[str, dict[str, torch.Tensor]]]  # side -> client -> the client's store


def _fedcurv_rounds(
    secure: SecureAggregationStrategy, plain: Strategy[Any], rounds: int, stores: Stores, fisher_scale: float = 0.05
) -> Iterator[tuple[float, list[str], dict[str, float]]]:
    """FedCurv round after round both ways: each client (the real client half, with its own store each way) uploads
    from the same random step and Fisher; the plaintext server aggregates the secure round's survivors. Yields, per
    round, the worst error of the server's U, V and weights over the fixed-point bound accumulated so far (U and V
    are running sums; the weights move from the last round's, so their errors add up too), the survivors and the
    secure round's metrics."""
    client = FedCurvClient()
    sum_bound = mean_bound = 1e-7  # float32 rounding of the values compared (below 1)
    for rnd in range(1, rounds + 1):
        replies: dict[str, dict[str, Message]] = {}
        for side, strategy in (("secure", secure), ("plain", plain)):
            plan = strategy.configure(rnd, CLIENTS)
            assert plan.broadcast is not None
            replies[side] = {}
            for i, c in enumerate(CLIENTS):
                gen = torch.Generator().manual_seed(1000 * rnd + i)  # the same step and Fisher both ways
                tensors = _fedcurv_upload(client, plan.tasks[c], plan.broadcast, stores[side][c], gen, fisher_scale)
                report = wire.to_params(UpdateReport(num_examples=60 + 40 * i, loss=float(i)))
                replies[side][c] = Message(UPDATE, rnd, run=RUN, client=c, params=report, tensors=tensors)
        metrics = secure.aggregate(rnd, {c: secure.accept(rnd, c, replies["secure"][c]) for c in CLIENTS})
        survivors = _survivors(secure)
        plain.aggregate(rnd, {c: plain.accept(rnd, c, replies["plain"][c]) for c in survivors})
        assert secure.last is not None
        sum_bound += len(survivors) * _resolution(secure)
        mean_bound += len(survivors) * _resolution(secure) / sum(secure.last.shares[c] for c in survivors)
        inner = _fedcurv(secure)
        assert isinstance(plain, FedCurv)
        errors = [
            max(float((a[k].double() - b[k].double()).abs().max()) for k in a) / sum_bound
            for a, b in zip(inner.sums(), plain.sums(), strict=True)
        ]
        w, w_plain = inner.global_weights(), plain.global_weights()
        errors.append(max(float((w[k].double() - w_plain[k].double()).abs().max()) for k in w) / mean_bound)
        yield max(errors), survivors, metrics


def _fedcurv(secure: SecureAggregationStrategy) -> FedCurv:
    assert isinstance(secure.inner, FedCurv)
    return secure.inner


def _stores() -> Stores:
    return {"secure": {c: {} for c in CLIENTS}, "plain": {c: {} for c in CLIENTS}}


@pytest.mark.parametrize("dropouts", [0.0, 0.3])
def test_fedcurv_sums_and_model_are_the_plaintext_ones_of_the_survivors(dropouts: float) -> None:
    """Three rounds: the server's U and V (in the clear, the latest terms of every client heard from, kept by client;
    here telescoped from the survivors' changes) and the model agree with the plaintext run's within the bound."""
    secure, plain = _pair("fedcurv", dropouts)
    seen: list[list[str]] = []
    for ratio, survivors, metrics in _fedcurv_rounds(secure, plain, 3, _stores()):
        assert ratio <= 1.0 and metrics["secagg_clipped"] == 0
        seen.append(survivors)
    assert any(len(s) < N for s in seen) == (dropouts > 0)
    # Round 4's tasks tell each client the last round whose terms of its are in U and V.
    plan = secure.configure(4, CLIENTS)
    kept = {c: wire.from_params(FedCurvTask, plan.tasks[c].params).kept_round for c in CLIENTS}
    assert kept == {c: max([r + 1 for r, s in enumerate(seen) if c in s], default=0) for c in CLIENTS}
    assert wire.from_params(FedCurvTask, plan.tasks["c0"].params).term_clip == CLIP
    plain_tasks = plain.configure(4, CLIENTS).tasks  # the clear's server kept the survivors' terms only
    assert {c: wire.from_params(FedCurvTask, t.params) for c, t in plain_tasks.items()} == {
        c: FedCurvTask(kept[c]) for c in CLIENTS
    }  # the same kept rounds, and no clip


def test_fedcurv_clipped_changes_keep_the_sums_those_the_clients_hold() -> None:
    """Fisher terms far above the bound: each change is clipped (the plaintext run, which does not clip, no longer
    applies), and the server's U is still the sum of what the clients hold as their own terms in it."""
    secure, plain = _pair("fedcurv", 0.3)
    stores = _stores()
    clipped = [metrics["secagg_clipped"] for _, _, metrics in _fedcurv_rounds(secure, plain, 2, stores, 20.0)]
    assert all(n > 0 for n in clipped)
    # Round 3, with a Fisher of 0: each client uploads its change 0 - (its terms in U), unclipped, as it sent it.
    plan = secure.configure(3, CLIENTS)
    assert plan.broadcast is not None
    inner, total = _fedcurv(secure), None
    for c in CLIENTS:
        tensors = _fedcurv_upload(
            FedCurvClient(), plan.tasks[c], plan.broadcast, stores["secure"][c], torch.Generator(), 0.0
        )
        own = {k: -tensors[FISHER_U + k] for k in inner.trainable}
        total = own if total is None else {k: total[k] + own[k] for k in total}
    assert total is not None
    u_sum = inner.sums()[0]
    assert max(float((u_sum[k] - total[k]).abs().max()) for k in total) <= 2 * N * _resolution(secure) + 1e-5
    assert max(float(t.abs().max()) for t in total.values()) > 0.1  # the terms are there, not all clipped away


def test_a_fedcurv_server_that_forgets_the_survivors_or_a_wrong_part_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # Forgetting who was in the sum: every client still believes U holds nothing of it and adds its terms again.
    monkeypatch.setattr(FedCurv, "secure_survivors", lambda self, rnd, reports: None)
    ratios = [ratio for ratio, _, _ in _fedcurv_rounds(*_pair("fedcurv", 0.0), 2, _stores())]
    assert ratios[0] <= 1.0 < 100 < ratios[1]
    monkeypatch.undo()
    declared = FedCurv.secure_parts
    wrong = lambda self: (*declared(self)[:2], dataclasses.replace(declared(self)[2], weighted=True))  # noqa: E731
    monkeypatch.setattr(FedCurv, "secure_parts", wrong)  # V's changes averaged, not summed
    assert next(_fedcurv_rounds(*_pair("fedcurv", 0.0), 1, _stores()))[0] > 100


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


@pytest.mark.parametrize("algorithm", ["fd", "fedcurv"])
def test_a_resumed_server_tells_the_clients_what_it_would_have(algorithm: str) -> None:
    """The state a coordinator journals holds what the secure rounds left (FD: who is in the sums; FedCurv: U, V and
    the round of each client's terms in them), and the plaintext server's what its rounds over the survivors left (the
    same who and rounds): a strategy loaded from it configures the next round as the first."""
    secure, plain = _pair(algorithm, 0.3)
    if algorithm == "fd":
        _fd_round(secure, plain)
    else:
        for _ in _fedcurv_rounds(secure, plain, 2, _stores()):
            pass
    resumed, resumed_plain = _pair(algorithm, 0.3)
    rnd = 2 if algorithm == "fd" else 3
    for first, loaded in ((secure, resumed), (plain, resumed_plain)):
        tensors, values = first.state()
        loaded.load_state(tensors, json.loads(json.dumps(values)))  # the journal is JSON
        inner = first.inner if isinstance(first, SecureAggregationStrategy) else first
        again = loaded.inner if isinstance(loaded, SecureAggregationStrategy) else loaded
        a, b = inner.configure(rnd, CLIENTS), again.configure(rnd, CLIENTS)
        assert {c: t.params for c, t in a.tasks.items()} == {c: t.params for c, t in b.tasks.items()}
        assert a.broadcast is not None and b.broadcast is not None and a.broadcast.params == b.broadcast.params
        assert all(torch.equal(t, b.broadcast.tensors[k]) for k, t in a.broadcast.tensors.items())
        told = "in_sums" if algorithm == "fd" else "kept_round"
        assert len({t.params[told] for t in a.tasks.values()}) >= 2  # not all alike: the test is not vacuous
    # A plaintext journal of an older fedge kept no such thing: its clients are told nothing (they assume as before,
    # that the average holds their last upload), but those it never heard from, that it holds nothing of them.
    tensors, values = plain.state()
    older = _pair(algorithm, 0.3)[1]
    older.load_state(tensors, {k: v for k, v in values.items() if k not in ("in_sums", "fedcurv_kept")})
    told_now = {c: t.params.get(told) for c, t in older.configure(rnd, CLIENTS).tasks.items()}
    heard = set(values.get("fedcurv_clients", []))  # FedCurv's: the clients whose terms it holds
    assert told_now == {c: None if algorithm == "fd" or c in heard else "0" for c in CLIENTS}
