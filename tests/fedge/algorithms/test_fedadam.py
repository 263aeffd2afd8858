"""FedAdam / FedYogi / FedAdagrad, two rounds of two clients, against Reddi et al. Algorithm 2 by hand."""

from pathlib import Path

import pytest
import torch
from algorithm_support import W0, X_A, X_B, Y_A, Y_B, TwoClients, assert_mqtt_run_matches_inprocess, ce_gradient, config

from fedge.algorithms.fedadam import FedAdamSettings
from fedge.config import RunConfig, TrainConfig
from fedge.errors import ConfigError

ETA, B1, B2, TAU = 0.05, 0.8, 0.9, 0.01


def _local(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, lr: float = 0.5) -> torch.Tensor:
    return w - lr * ce_gradient(w, x, y)  # one full-batch step, as config() trains


def _average(w: torch.Tensor) -> torch.Tensor:
    return (2 * _local(w, X_A, Y_A) + _local(w, X_B, Y_B)) / 3  # FedAvg eq. 2: weighted by data size


def _second_moment(kind: str, v: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    if kind == "adam":
        return B2 * v + (1 - B2) * delta**2
    if kind == "yogi":
        return v - (1 - B2) * delta**2 * torch.sign(v - delta**2)
    return v + delta**2


@pytest.mark.parametrize("kind", ["adam", "yogi", "adagrad"])
def test_two_rounds_follow_algorithm_2(kind: str) -> None:
    beta2 = {} if kind == "adagrad" else {"server_beta2": B2}  # FedAdagrad has no beta2 (and refuses one)
    settings = FedAdamSettings(server_optimizer=kind, server_opt_lr=ETA, server_beta1=B1, server_tau=TAU, **beta2)
    run = TwoClients(config("fedadam", settings))
    x, m, v = W0, torch.zeros_like(W0), torch.full_like(W0, TAU**2)
    for rnd in (1, 2):
        run.round(rnd)
        delta = _average(x) - x
        m = B1 * m + (1 - B1) * delta
        v = _second_moment(kind, v, delta)
        x = x + ETA * m / (v.sqrt() + TAU)
        assert torch.allclose(run.global_weight(), x, atol=1e-6), (kind, rnd)


def test_momentum_follows_fedavgm_by_hand() -> None:
    settings = FedAdamSettings(server_optimizer="momentum", server_opt_lr=ETA, server_beta1=B1)
    run = TwoClients(config("fedadam", settings))
    x, v = W0, torch.zeros_like(W0)
    for rnd in (1, 2):
        run.round(rnd)
        v = B1 * v + (x - _average(x))  # heavy ball on the pseudo-gradient x - avg
        x = x - ETA * v
        assert torch.allclose(run.global_weight(), x, atol=1e-6), rnd


@pytest.mark.parametrize("kind", ["adam", "momentum"])
def test_the_optimizer_state_resumes_to_the_uninterrupted_model_bit_for_bit(kind: str) -> None:
    cfg = config("fedadam", FedAdamSettings(server_optimizer=kind, server_opt_lr=ETA))
    straight, interrupted = TwoClients(cfg), TwoClients(cfg)
    for rnd in (1, 2, 3):
        straight.round(rnd)
    for rnd in (1, 2):
        interrupted.round(rnd)
    tensors, values = interrupted.strategy.state()
    assert any(k.startswith("server_") for k in tensors)  # the optimizer's state is in the journal's tensors
    resumed = TwoClients(cfg)
    resumed.strategy.load_state(tensors, values)
    resumed.round(3)
    assert torch.equal(resumed.global_weight(), straight.global_weight())


def test_the_server_step_changes_the_model_and_the_clients_see_fedavg_tasks() -> None:
    adam = TwoClients(config("fedadam", FedAdamSettings(server_opt_lr=ETA)))
    avg = TwoClients(config("fedavg"))
    adam.round(1)
    avg.round(1)
    assert not torch.allclose(adam.global_weight(), avg.global_weight(), atol=1e-3)
    # the optimizer is server-only: a task carries nothing of it
    task = adam.strategy.configure(2, ["a"]).tasks["a"]
    assert not any(k.startswith("server_") for k in task.params)


def test_yogi_and_adam_differ_after_two_rounds() -> None:
    runs = {k: TwoClients(config("fedadam", FedAdamSettings(server_optimizer=k))) for k in ("adam", "yogi")}
    for run in runs.values():
        run.round(1)
        run.round(2)
    assert not torch.allclose(runs["adam"].global_weight(), runs["yogi"].global_weight(), atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"server_optimizer": "sgd"}, "server_optimizer must be one of adam, yogi, adagrad, momentum"),
        ({"server_optimizer": "momentum", "server_tau": 0.1}, "the momentum server optimizer has none"),
        ({"server_optimizer": "adagrad", "server_beta2": 0.9}, r"adagrad \(FedAdagrad.*no decay to set"),
        ({"server_opt_lr": 0.0}, "server_opt_lr must be > 0"),
        ({"server_beta1": 1.0}, r"server_beta1 must be in \[0, 1\)"),
        ({"server_tau": 0.0}, "server_tau must be > 0"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        FedAdamSettings(**kwargs)  # type: ignore[arg-type]


def test_adagrad_takes_beta2_s_default_and_the_others_any_beta2() -> None:
    """The default beta2 (what a run gets without --server-beta2) is accepted with adagrad, which does not read it;
    adam and yogi, which do, take another value."""
    assert FedAdamSettings(server_optimizer="adagrad").server_beta2 == 0.99
    assert FedAdamSettings(server_optimizer="adagrad", server_beta2=0.99).server_beta2 == 0.99
    for kind in ("adam", "yogi"):
        assert FedAdamSettings(server_optimizer=kind, server_beta2=0.9).server_beta2 == 0.9


@pytest.mark.broker
def test_over_the_secured_embedded_broker_it_gives_the_in_process_model(tmp_path: Path) -> None:
    """The server's optimizer state carries across rounds; client processes run FedAvg's step over MQTT."""
    train = TrainConfig(local_epochs=1)
    cfg = RunConfig(algorithm="fedadam", dataset="digits", model="tiny_mlp", num_clients=3, rounds=3, train=train)
    assert_mqtt_run_matches_inprocess(cfg, tmp_path)
