import pytest

from fedge.config import AlgorithmConfig, RunConfig, TrainConfig
from fedge.errors import ConfigError


def test_defaults_follow_the_papers():
    t = TrainConfig()
    assert (t.lr, t.momentum, t.weight_decay, t.lr_decay) == (0.01, 0.9, 1e-5, 0.99)
    a = AlgorithmConfig()
    assert (a.ntd_beta, a.ntd_tau, a.cad_beta, a.cad_gamma, a.era_temperature, a.open_per_round) == (
        1.0,
        1.0,
        0.25,
        0.5,
        0.1,
        1000,
    )


def test_lr_decays_per_round():
    assert TrainConfig(lr=0.1, lr_decay=0.5).lr_at(3) == pytest.approx(0.025)


@pytest.mark.parametrize(
    "make",
    [
        lambda: RunConfig(algorithm="fedprox"),
        lambda: RunConfig(num_clients=0),
        lambda: RunConfig(client_fraction=0),
        lambda: TrainConfig(lr=-1),
        lambda: AlgorithmConfig(cad_beta=0.6, cad_gamma=0.5),
        lambda: AlgorithmConfig(aggregation="mean"),
    ],
)
def test_invalid_settings_raise_config_error(make):
    with pytest.raises(ConfigError):
        make()


def test_json_round_trip_and_unknown_keys(tmp_path):
    cfg = RunConfig(
        algorithm="dsfl", rounds=7, train=TrainConfig(batch_size=10), algo=AlgorithmConfig(aggregation="sa")
    )
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    assert RunConfig.from_json_file(path) == cfg
    with pytest.raises(ConfigError, match="unknown train setting"):
        RunConfig.from_dict({"train": {"learning_rate": 1}})
    with pytest.raises(ConfigError, match="does not exist"):
        RunConfig.from_json_file(tmp_path / "missing.json")


def test_clients_per_round():
    assert RunConfig(num_clients=100, client_fraction=0.1).clients_per_round == 10
    assert RunConfig(num_clients=3, client_fraction=0.1).clients_per_round == 1
