"""DS-FL (Itahara et al., sec. 2.3 and 3), two rounds of two clients on a 4-sample open set, against eq. 9-16 by hand.

Each round the clients update on private data (eq. 1), predict on the round's 3 open samples o_r (eq. 9) and upload;
the server aggregates with ERA (eq. 13-15) or SA (eq. 16) and distills its global model on the result (eq. 11); in
the next round each client first distills on those labels (eq. 10), then updates and predicts again.
"""

import pytest
import torch
from algorithm_support import W0, X_A, X_B, Y_A, Y_B, TwoClients, ce_gradient, config, soft_ce_gradient

from fedge.algorithms.dsfl import DSFLSettings, open_index_set

LR, STEPS = 0.5, 2  # private update: full-batch steps (2 epochs of one batch)
D_LR, D_STEPS, T = 1.0, 2, 0.5  # distillation lr and full-batch steps (eq. 10-11); ERA temperature (eq. 13)
OPEN_X = torch.tensor([[0.5, 1.0], [1.0, -1.0], [-1.0, 0.5], [2.0, 1.0]])  # the unlabeled open set, 4 samples
DATA = {"a": (X_A, Y_A), "b": (X_B, Y_B)}


def _run(aggregation: str, server_distill: bool = True, temperature: float = T) -> TwoClients:
    settings = DSFLSettings(
        aggregation=aggregation,
        era_temperature=temperature,
        open_per_round=3,
        distill_epochs=D_STEPS,
        distill_lr=D_LR,
        distill_batch_size=8,
        server_distill=server_distill,
    )
    return TwoClients(config("dsfl", settings, local_epochs=STEPS, lr=LR), open_x=OPEN_X)


def _steps(w: torch.Tensor, gradient, lr: float, n: int) -> torch.Tensor:
    for _ in range(n):
        w = w - lr * gradient(w)
    return w


def _update(w: torch.Tensor, k: str) -> torch.Tensor:
    """Eq. 1 on client k's private data."""
    return _steps(w, lambda v: ce_gradient(v, *DATA[k]), LR, STEPS)


def _distill(w: torch.Tensor, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Eq. 10 / 11: steps on the soft cross-entropy phi(D^{o_r}, T^ | w)."""
    return _steps(w, lambda v: soft_ce_gradient(v, x, labels), D_LR, D_STEPS)


def _predict(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Eq. 9: the model's softmax output on each open sample, (|o_r|, C)."""
    return torch.softmax(x @ w.T, dim=1)


def _aggregate(uploads: list[torch.Tensor], aggregation: str) -> torch.Tensor:
    mean = sum(uploads) / len(uploads)  # eq. 16 (SA), and the argument of eq. 13 (ERA)
    if aggregation == "sa":
        return mean
    e = torch.exp(mean / T)  # eq. 14-15: f_s(t | T) = e^{t/T} / sum_n e^{t_n/T}, row by row
    return e / e.sum(dim=1, keepdim=True)


@pytest.mark.parametrize("aggregation", ["era", "sa"])
def test_two_rounds_follow_eq_9_to_16(aggregation: str):
    run = _run(aggregation)
    o = {r: torch.from_numpy(open_index_set(4, 3, run.strategy.index_seed(r))) for r in (1, 2)}
    assert len(set(o[1].tolist())) == 3

    # Round 1: every model starts from the common initialization W0.
    record = run.round(1)
    w1 = {k: _update(W0, k) for k in DATA}
    up1 = {k: _predict(w1[k], OPEN_X[o[1]]) for k in DATA}
    for k in DATA:
        assert torch.allclose(run.upload(1, k, "soft_labels"), up1[k], atol=1e-7)
    labels1 = _aggregate([up1["a"], up1["b"]], aggregation)
    w_g1 = _distill(W0, OPEN_X[o[1]], labels1)  # eq. 11 on the server
    assert torch.allclose(run.global_weight(), w_g1, atol=1e-6)
    entropy = float(-(labels1 * labels1.log()).sum(dim=1).mean())  # eq. 12, mean over o_1
    assert abs(record.metrics["global_logit_entropy"] - entropy) < 1e-5

    # Round 2: the clients receive round 1's labels, distill on o_1 (eq. 10), update, predict on o_2.
    run.round(2)
    assert torch.allclose(run.broadcast(2, "soft_labels"), labels1, atol=1e-7)
    w2 = {k: _update(_distill(w1[k], OPEN_X[o[1]], labels1), k) for k in DATA}
    up2 = {k: _predict(w2[k], OPEN_X[o[2]]) for k in DATA}
    for k in DATA:
        assert torch.allclose(run.client_weight(k), w2[k], atol=1e-6)
        assert torch.allclose(run.upload(2, k, "soft_labels"), up2[k], atol=1e-6)
        # The distillation moved the client: without it, round 2 would be two more CE steps from w1.
        assert not torch.allclose(w2[k], _update(w1[k], k), atol=1e-3)
    labels2 = _aggregate([up2["a"], up2["b"]], aggregation)
    assert torch.allclose(run.global_weight(), _distill(w_g1, OPEN_X[o[2]], labels2), atol=1e-6)


def test_era_sharpens_what_sa_averages():
    """Eq. 13 vs 16 on the same uploads: ERA at the paper's T = 0.1 keeps SA's ranking with a larger top probability.

    (Eq. 13 is a softmax of averaged probabilities, so a mild T such as 0.5 can flatten rather than sharpen them.)
    """
    era, sa = _run("era", temperature=0.1), _run("sa")
    for run in (era, sa):
        run.round(1)
        run.round(2)
    mean = (sa.upload(1, "a", "soft_labels") + sa.upload(1, "b", "soft_labels")) / 2
    assert torch.allclose(era.upload(1, "a", "soft_labels"), sa.upload(1, "a", "soft_labels"))  # same clients
    era_labels, sa_labels = era.broadcast(2, "soft_labels"), sa.broadcast(2, "soft_labels")
    assert torch.allclose(sa_labels, mean, atol=1e-7)
    assert torch.allclose(era_labels, torch.softmax(mean / 0.1, dim=1), atol=1e-6)
    assert torch.equal(era_labels.argmax(dim=1), sa_labels.argmax(dim=1))
    assert bool((era_labels.max(dim=1).values > sa_labels.max(dim=1).values).all())


def test_without_server_distillation_the_global_model_stays_put():
    run = _run("era", server_distill=False)
    run.round(1)
    assert torch.equal(run.global_weight(), W0)


def _aggregated_under_attack(robust: str, aggregation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The global soft labels and model after one round of 5 uploads on o_1, one of them confidently wrong."""
    from algorithm_support import NUM_CLASSES, linear

    from fedge.algorithms.base import ServerContext, UpdateReport, update_message
    from fedge.algorithms.dsfl import DistillationSemiSupervised

    settings = DSFLSettings(aggregation=aggregation, open_per_round=3, distill_epochs=D_STEPS, robust=robust)
    cfg = config("dsfl", settings)
    strategy = DistillationSemiSupervised(cfg, ServerContext(linear, NUM_CLASSES, run_id="t", open_x=OPEN_X))
    clients = ["h1", "h2", "h3", "h4", "x"]
    plan = strategy.configure(1, clients)
    honest = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.7, 0.2], [0.2, 0.1, 0.7]])
    wrong = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])  # valid rows, every one wrong
    uploads = {c: honest + 0.02 * i * torch.tensor([[1.0, -1.0, 0.0]] * 3) for i, c in enumerate(clients[:4])}
    uploads["x"] = wrong
    replies = {
        c: update_message(plan.tasks[c], {"soft_labels": p}, UpdateReport(num_examples=2)) for c, p in uploads.items()
    }
    strategy.aggregate(1, {c: strategy.accept(1, c, m) for c, m in replies.items()})
    labels = strategy.state()[0]["soft_labels"]
    return labels, strategy.global_weights()["weight"]


@pytest.mark.parametrize("aggregation", ["era", "sa"])
@pytest.mark.parametrize("robust", ["median", "trimmed_mean"])
def test_robust_rules_change_the_labels_and_model_under_attack(robust: str, aggregation: str):
    """--robust median|trimmed_mean replaces eq. 16's mean per sample and class: one confidently wrong uploader of 5
    moves the mean's labels, not the robust ones, and the global model distilled on them differs."""
    mean_labels, mean_model = _aggregated_under_attack("mean", aggregation)
    labels, model = _aggregated_under_attack(robust, aggregation)
    assert torch.allclose(labels.sum(dim=1), torch.ones(3), atol=1e-6)
    assert not torch.allclose(labels, mean_labels, atol=1e-3)
    assert not torch.allclose(model, mean_model, atol=1e-4)
    # The honest clients' top class survives, with more confidence than under the mean.
    assert torch.equal(labels.argmax(dim=1), torch.tensor([0, 1, 2]))
    assert bool((labels.max(dim=1).values > mean_labels.max(dim=1).values).all())
    if aggregation == "sa" and robust == "median":  # the middle of the 4 honest rows and the wrong one, renormalized
        honest_median = torch.tensor([[0.72, 0.16, 0.1], [0.14, 0.66, 0.2], [0.22, 0.08, 0.7]])  # per entry
        expected = honest_median / honest_median.sum(dim=1, keepdim=True)
        assert torch.allclose(labels, expected, atol=1e-5)
