import json
import re

import pytest

from fedge.algorithms.dsfl import DSFLSettings
from fedge.algorithms.fedcad import FedCADSettings
from fedge.algorithms.fedntd import FedNTDSettings
from fedge.algorithms.fedprox import FedProxSettings
from fedge.config import RunConfig, TrainConfig
from fedge.errors import ConfigError


def test_defaults_follow_the_papers():
    t = TrainConfig()
    assert (t.lr, t.momentum, t.weight_decay, t.lr_decay) == (0.01, 0.9, 1e-5, 0.99)
    ntd, cad, dsfl, prox = FedNTDSettings(), FedCADSettings(), DSFLSettings(), FedProxSettings()
    assert (ntd.ntd_beta, ntd.ntd_tau) == (1.0, 1.0)  # FedNTD B.4
    assert (cad.cad_beta, cad.cad_gamma) == (0.25, 0.5)  # FedCAD
    assert (dsfl.era_temperature, dsfl.open_per_round) == (0.1, 1000)  # DS-FL 4.1
    assert prox.prox_mu == 0.1  # FedNTD Table 5
    assert RunConfig().algo == FedNTDSettings()  # the default algorithm's own defaults


def test_lr_decays_per_round():
    assert TrainConfig(lr=0.1, lr_decay=0.5).lr_at(3) == pytest.approx(0.025)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: RunConfig(algorithm="fedfoo"), "unknown algorithm 'fedfoo'; choose one of fedavg"),
        (lambda: RunConfig(num_clients=0), "num_clients must be >= 1, got 0"),
        (lambda: RunConfig(client_fraction=0), "client_fraction must be in (0, 1], got 0"),
        (lambda: TrainConfig(lr=-1), "lr must be > 0, got -1"),
        (lambda: FedCADSettings(cad_beta=0.6, cad_gamma=0.5), "cad_beta <= cad_gamma"),
        (lambda: DSFLSettings(aggregation="mean"), "aggregation must be era|sa, not 'mean'"),
        (lambda: RunConfig(algorithm="fedavg", algo=FedNTDSettings()), "FedNTDSettings do not belong to 'fedavg'"),
    ],
)
def test_invalid_settings_raise_config_error_naming_the_setting(make, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        make()


def test_json_round_trip_and_unknown_keys(tmp_path):
    cfg = RunConfig(algorithm="dsfl", rounds=7, train=TrainConfig(batch_size=10), algo=DSFLSettings(aggregation="sa"))
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    assert RunConfig.from_json_file(path) == cfg
    # A run directory's config.json also says which fedge wrote it: a record, read past.
    assert RunConfig.from_dict({**cfg.to_dict(), "fedge": {"version": "0.1.0", "commit": "0" * 40}}) == cfg
    with pytest.raises(ConfigError, match="unknown train setting"):
        RunConfig.from_dict({"train": {"learning_rate": 1}})
    with pytest.raises(ConfigError, match="unknown algo"):
        RunConfig.from_dict({"algorithm": "fedavg", "algo": {"ntd_betta": 1}})
    with pytest.raises(ConfigError, match="does not exist"):
        RunConfig.from_json_file(tmp_path / "missing.json")


def test_a_config_written_before_per_algorithm_settings_still_loads(tmp_path):
    old = {"algorithm": "fedntd", "algo": {"ntd_beta": 2.0, "cad_beta": 0.25, "open_size": 600, "aggregation": "era"}}
    (tmp_path / "config.json").write_text(json.dumps(old))
    cfg = RunConfig.from_json_file(tmp_path / "config.json")
    assert cfg.algo == FedNTDSettings(ntd_beta=2.0) and cfg.open_size == 600


def test_clients_per_round():
    assert RunConfig(num_clients=100, client_fraction=0.1).clients_per_round == 10
    assert RunConfig(num_clients=3, client_fraction=0.1).clients_per_round == 1


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ({"train": {"lr": "0.01x"}}, "train setting 'lr' must be a number, got \"0.01x\""),
        ({"rounds": True}, "run setting 'rounds' must be a whole number, got true"),
        ({"seed": 1.5}, "run setting 'seed' must be a whole number, got 1.5"),
        ({"dataset": 3}, "run setting 'dataset' must be a string, got 3"),
        ({"model": 3}, "run setting 'model' must be a string or null, got 3"),
        ({"algorithm": "fedntd", "algo": {"ntd_beta": "x"}}, "algo (fedntd) setting 'ntd_beta' must be a number"),
        ({"train": 5}, "train must be a JSON object of settings, got 5"),
    ],
)
def test_a_config_file_with_a_wrongly_typed_value_is_one_error_naming_file_and_setting(tmp_path, raw, says):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as exc:
        RunConfig.from_json_file(path)
    assert str(exc.value).startswith(f"config file {path}: {says}") and "\n" not in str(exc.value)
    # Integers are valid floats, and null is a valid optional string.
    assert RunConfig.from_dict({"train": {"lr": 1}, "model": None}).train.lr == 1
