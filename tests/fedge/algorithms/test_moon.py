"""MOON, two rounds of two clients on a model with a hidden layer, against a float64 reference of its local loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from algorithm_support import X_A, X_B, Y_A, Y_B, Hidden, TwoClients, assert_mqtt_run_matches_inprocess, config

from edge_client.cli import runtime_capabilities
from fedge.algorithms.moon import MoonSettings
from fedge.config import RunConfig, TrainConfig
from fedge.learning.models import exchanged_state

MU, TAU, LR, STEPS = 0.8, 0.5, 0.5, 2
Weights = dict[str, torch.Tensor]


def _forward(w: Weights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = torch.tanh(x @ w["inner.weight"].T)  # the hidden layer is the representation
    return z, z @ w["outer.weight"].T


def _local(x: torch.Tensor, y: torch.Tensor, start: Weights, previous: Weights) -> Weights:
    """Full-batch steps on CE + mu * l_con, in float64, l_con written as the paper's -log of a ratio."""
    x = x.double()
    z_glob, z_prev = (
        _forward({k: v.double() for k, v in start.items()}, x)[0],
        _forward({k: v.double() for k, v in previous.items()}, x)[0],
    )
    w = {k: v.double().clone().requires_grad_(True) for k, v in start.items()}
    for _ in range(STEPS):
        z, logits = _forward(w, x)
        pos = torch.exp(F.cosine_similarity(z, z_glob, dim=-1) / TAU)
        neg = torch.exp(F.cosine_similarity(z, z_prev, dim=-1) / TAU)
        loss = F.cross_entropy(logits, y) + MU * (-torch.log(pos / (pos + neg))).mean()
        grads = torch.autograd.grad(loss, list(w.values()))
        w = {k: (v - LR * g).detach().requires_grad_(True) for (k, v), g in zip(w.items(), grads, strict=True)}
    return {k: v.detach().float() for k, v in w.items()}


def _average(a: Weights, b: Weights) -> Weights:
    return {k: (2 * a[k] + b[k]) / 3 for k in a}  # by data size: client "a" holds two samples, "b" one


def _close(got: Weights, want: Weights) -> bool:
    return all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)


def test_two_rounds_follow_the_model_contrastive_loss() -> None:
    run = TwoClients(config("moon", MoonSettings(moon_mu=MU, moon_tau=TAU), local_epochs=STEPS), model=Hidden)
    w0 = exchanged_state(Hidden())
    run.round(1)  # no previous model yet: compared with the global model twice, l_con is log 2 and has no gradient
    local = {"a": _local(X_A, Y_A, w0, w0), "b": _local(X_B, Y_B, w0, w0)}
    server = _average(local["a"], local["b"])
    assert _close(run.strategy.global_weights(), server)
    run.round(2)  # now each client's previous model is its round-1 result
    a2, b2 = _local(X_A, Y_A, server, local["a"]), _local(X_B, Y_B, server, local["b"])
    assert _close(run.strategy.global_weights(), _average(a2, b2))
    assert not _close(a2, _local(X_A, Y_A, server, server))  # the contrastive term changed the steps
    request = run.backend("a").requests[-1]
    (contrast,) = request.terms
    assert set(contrast.references) == {"global", "previous"} and _close(contrast.references["previous"], local["a"])


def test_mu_zero_is_fedavg() -> None:
    moon = TwoClients(config("moon", MoonSettings(moon_mu=0.0), local_epochs=STEPS), model=Hidden)
    avg = TwoClients(config("fedavg", local_epochs=STEPS), model=Hidden)
    for rnd in (1, 2):
        moon.round(rnd)
        avg.round(rnd)
    a, b = moon.strategy.global_weights(), avg.strategy.global_weights()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_every_training_runtime_offers_it() -> None:
    for runtime in ("torch", "executorch", "onnxruntime-training"):  # the term runs inside the exported programs
        assert "moon" in runtime_capabilities(runtime, False)
    assert "moon" not in runtime_capabilities("onnxruntime", False)


@pytest.mark.broker
def test_over_the_secured_embedded_broker_it_gives_the_in_process_model(tmp_path: Path) -> None:
    """Each client process keeps its previous model across rounds in its store, as the in-process clients do."""
    train = TrainConfig(local_epochs=1)
    cfg = RunConfig(algorithm="moon", dataset="digits", model="tiny_mlp", num_clients=3, rounds=3, train=train)
    assert_mqtt_run_matches_inprocess(cfg, tmp_path)
