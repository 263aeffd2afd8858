"""FedDyn, two rounds of two clients, against Acar et al. Algorithm 1 by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from algorithm_support import W0, X_A, X_B, Y_A, Y_B, TwoClients, assert_mqtt_run_matches_inprocess, ce_gradient, config

from fedge.algorithms.feddyn import FedDynSettings
from fedge.config import RunConfig, TrainConfig
from fedge.errors import ConfigError

ALPHA, LR, STEPS = 0.3, 0.5, 2


def _local(x: torch.Tensor, y: torch.Tensor, server: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    w = server
    for _ in range(STEPS):  # full-batch steps on L_k(w) - <g_k, w> + alpha/2 ||w - server||^2
        w = w - LR * (ce_gradient(w, x, y) - g + ALPHA * (w - server))
    return w


def test_two_rounds_follow_algorithm_1() -> None:
    run = TwoClients(config("feddyn", FedDynSettings(dyn_alpha=ALPHA), local_epochs=STEPS))
    server, h = W0, torch.zeros_like(W0)
    g = {"a": torch.zeros_like(W0), "b": torch.zeros_like(W0)}
    data = {"a": (X_A, Y_A), "b": (X_B, Y_B)}
    for rnd in (1, 2):
        run.round(rnd)
        local = {c: _local(*data[c], server, g[c]) for c in data}
        for c in data:
            g[c] = g[c] - ALPHA * (local[c] - server)
        h = h - ALPHA / 2 * sum(local[c] - server for c in data)  # m = 2 clients
        server = (2 * local["a"] + local["b"]) / 3 - h / ALPHA  # FedAvg's average by data size, minus h / alpha
        assert torch.allclose(run.global_weight(), server, atol=1e-6), rnd
        # the linear term reached the client's training as a gradient correction of -g_k (before this round's update)
        request = run.backend("a").requests[-1]
        prox, linear = request.terms
        assert prox.term.kind == "prox" and prox.term.mu == ALPHA and linear.term.kind == "correction"


def test_the_second_round_differs_from_fedprox() -> None:
    """Round 1 of FedDyn is FedProx with mu = alpha plus the server's -h/alpha shift; the linear term shows later."""
    dyn = TwoClients(config("feddyn", FedDynSettings(dyn_alpha=ALPHA), local_epochs=STEPS))
    dyn.round(1)
    dyn.round(2)
    (_, linear) = dyn.backend("a").requests[-1].terms
    assert float(linear.tensors["c"]["weight"].abs().sum()) > 0  # -g_k is not zero in round 2


def test_alpha_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="dyn_alpha must be > 0"):
        FedDynSettings(dyn_alpha=0.0)


@pytest.mark.broker
def test_over_the_secured_embedded_broker_it_gives_the_in_process_model(tmp_path: Path) -> None:
    """Each client process keeps g_k across rounds in its own store, as the in-process clients do."""
    train = TrainConfig(local_epochs=1)
    cfg = RunConfig(algorithm="feddyn", dataset="digits", model="tiny_mlp", num_clients=3, rounds=3, train=train)
    assert_mqtt_run_matches_inprocess(cfg, tmp_path)
