"""FD (DS-FL sec. 2.2), two rounds of two clients, against eq. 4-7 by hand.

Client "a" holds classes 0 (two samples, so eq. 4 really averages) and 1; client "b" classes 2 and 1. Class 1 is
shared, so its leave-one-out target (eq. 6) is the other client's row, while classes 0 and 2 have one holder each
and eq. 6 would divide by zero. There fedge skips the distillation term of those samples (they keep CE only, still
counting in the batch mean), which the paper leaves open. Round 1 is the plain update (eq. 1) and upload; round 2
distills on round 1's broadcast (eq. 7), then uploads again."""

import pytest
import torch
from algorithm_support import NUM_CLASSES, W0, LinearBackend, TwoClients, ce_gradient, config, linear

from fedge.algorithms.base import ClientData, ServerContext
from fedge.algorithms.fd import FDClient, FDSettings, FDTask, FederatedDistillation
from fedge.wire import fields as wire
from fedge.wire.message import Message

LR, STEPS, GAMMA = 1.0, 2, 0.5  # full-batch steps per round (2 epochs of one batch); eq. 7's gamma
X_A = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.5]])
Y_A = torch.tensor([0, 1, 0])
X_B = torch.tensor([[1.0, 1.0], [0.5, 1.0]])
Y_B = torch.tensor([2, 1])
DATA = {"a": (X_A, Y_A), "b": (X_B, Y_B)}
TEST_X, TEST_Y = torch.cat([X_A, X_B]), torch.cat([Y_A, Y_B])


def _run() -> TwoClients:
    cfg = config("fd", FDSettings(fd_gamma=GAMMA), local_epochs=STEPS, lr=LR)
    return TwoClients(cfg, data=(DATA["a"], DATA["b"]), eval_data=True)


def _ce_steps(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    for _ in range(STEPS):
        w = w - LR * ce_gradient(w, x, y)
    return w


def _class_means(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Eq. 4: row n is the mean softmax output on the samples of class n; a zero row for a class not held."""
    p = torch.softmax(x @ w.T, dim=1)  # (N, C)
    rows = [p[y == n].mean(dim=0) if bool((y == n).any()) else torch.zeros(NUM_CLASSES) for n in range(NUM_CLASSES)]
    return torch.stack(rows)  # (C, C)


def _distill_steps(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor):
    """Eq. 7: steps on mean CE + gamma * mean of mask_i soft-CE(z_i, t^_i); d/dz = p - onehot + gamma mask (p - t^)."""
    for _ in range(STEPS):
        p = torch.softmax(x @ w.T, dim=1)  # (N, C)
        dz = (p - torch.eye(NUM_CLASSES)[y]) + GAMMA * mask.float().unsqueeze(1) * (p - targets)  # (N, C)
        w = w - LR * dz.T @ x / len(x)
    return w


def _accuracy(w: torch.Tensor) -> float:
    return int(((TEST_X @ w.T).argmax(dim=1) == TEST_Y).sum()) / len(TEST_Y)


def test_round_1_uploads_per_class_means_and_the_server_averages_over_holders():
    run = _run()
    record = run.round(1)
    w1 = {k: _ce_steps(W0, *DATA[k]) for k in DATA}  # eq. 1: every client starts from the common initialization
    t = {k: _class_means(w1[k], *DATA[k]) for k in DATA}
    for k in DATA:
        assert torch.allclose(run.upload(1, k, "class_probs"), t[k], atol=1e-7)
    assert torch.equal(t["a"][2], torch.zeros(3)) and torch.equal(t["b"][0], torch.zeros(3))  # absent classes
    # Eq. 5: class 0 only from a, class 2 only from b, class 1 the mean of both; |K_n| = (1, 2, 1).
    expected = torch.stack([t["a"][0], (t["a"][1] + t["b"][1]) / 2, t["b"][2]])
    run.round(2)
    assert torch.allclose(run.broadcast(2, "global_probs"), expected, atol=1e-7)
    assert run.broadcast(2, "contributors").tolist() == [1, 2, 1]
    # No global model: the round's accuracy is the clients' mean accuracy on their test data.
    assert abs(record.accuracy - (_accuracy(w1["a"]) + _accuracy(w1["b"])) / 2) < 1e-9


def test_round_2_distills_toward_the_other_clients_outputs():
    run = _run()
    run.round(1)
    run.round(2)
    w1 = {k: _ce_steps(W0, *DATA[k]) for k in DATA}
    t = {k: _class_means(w1[k], *DATA[k]) for k in DATA}
    t_g = torch.stack([t["a"][0], (t["a"][1] + t["b"][1]) / 2, t["b"][2]])
    k_n = torch.tensor([1.0, 2.0, 1.0])
    for k, other in (("a", "b"), ("b", "a")):
        x, y = DATA[k]
        # Eq. 6 for the shared class 1: (|K_1| t_g,1 - t_k,1) / (|K_1| - 1), which is the other client's row.
        loo = (k_n[1] * t_g[1] - t[k][1]) / (k_n[1] - 1)
        assert torch.allclose(loo, t[other][1], atol=1e-6)
        mask = y == 1  # only the shared class has another client's knowledge
        targets = torch.where(mask.unsqueeze(1), loo, torch.zeros(3))  # (N, C); masked rows are never used
        request = run.backend(k).requests[1]
        assert torch.equal(request.inputs["mask"], mask)
        assert torch.allclose(request.inputs["targets"][mask], targets[mask], atol=1e-6)
        w2 = _distill_steps(w1[k], x, y, targets, mask)
        assert torch.allclose(run.client_weight(k), w2, atol=1e-6)
        assert torch.allclose(run.upload(2, k, "class_probs"), _class_means(w2, x, y), atol=1e-6)  # eq. 4 again
        # The distillation term moved the weights: without it, round 2 would be two more CE steps.
        assert not torch.allclose(w2, _ce_steps(w1[k], x, y), atol=1e-3)


# Who uploads in rounds 1-3 and whose uploads the server averages (None: the round has no quorum, no aggregate).
SCENARIOS = {
    # a's round-1 reply was dropped (deadline, refused, offline): round 1's average holds b and c only.
    "dropped": [("abc", "bc"), ("a", None)],
    # Round 2 had no quorum: round 3's broadcast is round 1's average, which holds a's round-1 upload, not its round-2.
    "older source": [("abc", "abc"), ("ab", None), ("a", None)],
    # a sat round 2 out: round 2's average holds b and c only.
    "not sampled": [("abc", "abc"), ("bc", "bc"), ("a", None)],
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_client_leaves_itself_out_only_of_an_average_that_holds_its_upload(scenario: str) -> None:
    """The real halves, three clients that share classes 0 and 1 (b also holds 2). In the scenario's last round, a's
    eq. 6 target for class n is the mean over the *other* clients' uploads in the broadcast's average (its own
    upload of that round taken out only when the average holds it), computed here from the uploads themselves."""
    data = {
        "a": ClientData(X_A, Y_A, NUM_CLASSES),
        "b": ClientData(X_B, Y_B, NUM_CLASSES),
        "c": ClientData(torch.tensor([[0.5, 1.0], [1.0, 0.2]]), torch.tensor([1, 0]), NUM_CLASSES),
    }
    server = FederatedDistillation(config("fd", FDSettings(fd_gamma=GAMMA)), ServerContext(linear, NUM_CLASSES, "t"))
    half, stores = FDClient(), {c: dict[str, torch.Tensor]() for c in data}
    backends = {c: LinearBackend() for c in data}
    uploads: dict[int, dict[str, Message]] = {}
    averaged: tuple[int, str] = (0, "")  # the latest round with an average, and whose uploads it holds
    for rnd, (stepping, aggregated) in enumerate(SCENARIOS[scenario], 1):
        plan = server.configure(rnd, list(data))
        uploads[rnd] = {c: half.step(plan.tasks[c], plan.broadcast, data[c], backends[c], stores[c]) for c in stepping}
        if aggregated is not None:
            server.aggregate(rnd, {c: server.accept(rnd, c, uploads[rnd][c]) for c in aggregated})
            averaged = (rnd, aggregated)
    source, holders = averaged
    assert plan.broadcast is not None and plan.broadcast.params["source_round"] == str(source)
    assert wire.from_params(FDTask, plan.tasks["a"].params).in_sums == ("a" in holders)
    others = torch.stack([uploads[source][c].tensor("class_probs") for c in holders if c != "a"])  # (K-1, C, C)
    held = others.sum(dim=2) > 0  # (K-1, C)
    expected = others.sum(dim=0) / held.sum(dim=0).clamp(min=1).unsqueeze(1)  # (C, C): the others' mean per class
    inputs = backends["a"].requests[-1].inputs  # the last round's distillation (eq. 7) on a's samples
    assert bool(inputs["mask"].all())  # classes 0 and 1 each have another holder in the average
    assert torch.allclose(inputs["targets"], expected[Y_A], atol=1e-6)
