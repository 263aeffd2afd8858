"""Issue 52 over a real fleet: the pixel-trigger backdoor of ``test_backdoor_defaults.py`` against what ``fedge
coordinator`` runs by default, this time as a deployment runs it: a fleet kit (TLS, one login per device, the
least-privilege ACL) served by mosquitto, ten ``fedge client`` processes each holding its provisioned data file, one
of them poisoned (half its samples triggered and relabelled; it trains and uploads as an honest client would).

The coordinator's defaults (FLAME) keep the attack at the honest run's level (<= 5 points above it) at the honest
run's clean accuracy (within 2 points), and the model is the one the same poisoned fleet gives in process: the
broker, the kit and the processes change nothing in what the defaults decide."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from insiders import BACKDOOR_TARGET, poisoned, trigger
from mqtt_support import require_mosquitto
from safetensors.torch import load_file

from coordinator.engine import RoundEngine
from coordinator.run import provision_fleet, run_coordinator
from edge_client.client import EdgeClient
from edge_client.data import ClientDataInfo, save_client_data
from fedge.algorithms.base import evaluate_model
from fedge.config import RunConfig
from fedge.learning.backend import TorchBackend
from fedge.learning.models import build_model, load_exchanged_state
from fedge_cli.main import _run_config, build_parser
from fedge_io.credentials import load_bundle
from fedge_io.experiment import Experiment, prepare
from sim.brokers import fleet_mosquitto, free_port
from sim.inprocess import InProcessTransport
from sim.laptop import client_processes
from sim.provision import provision

pytestmark = pytest.mark.broker

RUN = "backdoor"
FLAGS = ["--algorithm", "fedavg", "--dataset", "digits", "--model", "tiny_mlp", "--num-clients", "10"]
FLAGS += ["--rounds", "10", "--partition", "iid", "--local-epochs", "2", "--lr", "0.1"]
POISONER = "c000"


def _scores(exp: Experiment, weights: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Clean accuracy and attack success (triggered test images outside the target class classified as it)."""
    model = build_model(exp.model, input_shape=exp.input_shape, num_classes=exp.num_classes)
    load_exchanged_state(model, weights)
    test_x, test_y = exp.test_tensors()
    value = float(exp.train.x.max())
    keep = test_y != BACKDOOR_TARGET
    target = torch.full_like(test_y[keep], BACKDOOR_TARGET)
    clean = evaluate_model(model, test_x, test_y, exp.num_classes).accuracy
    return clean, evaluate_model(model, trigger(test_x[keep], value), target, exp.num_classes).accuracy


def _in_process(config: RunConfig, *, poison: bool) -> dict[str, torch.Tensor]:
    exp = prepare(config)
    backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes)
    value = float(exp.train.x.max())
    clients = []
    for c in sorted(exp.parts):
        data = exp.client_data(c)
        clients.append(EdgeClient(c, poisoned(data, value, seed=0) if poison and c == POISONER else data, backend))
    strategy = exp.strategy(RUN)
    test_x, test_y = exp.test_tensors()
    RoundEngine(exp.config, strategy, InProcessTransport(clients), test_x, test_y).run()
    weights = strategy.global_weights()
    assert weights is not None
    return weights


def test_the_default_holds_a_poisoning_device_over_the_kits_mosquitto(tmp_path: Path) -> None:
    require_mosquitto()
    config = _run_config(build_parser().parse_args(["coordinator", *FLAGS]), deployment=True)
    assert config.algo.robust == "flame"  # type: ignore[attr-defined]  # the defaults, nothing chosen
    exp = prepare(config)
    files = provision(exp, tmp_path / "data")
    data = exp.client_data(POISONER)
    info = ClientDataInfo(client=POISONER, model=exp.model, input_shape=exp.input_shape, num_classes=exp.num_classes)
    save_client_data(files[POISONER], poisoned(data, float(exp.train.x.max()), seed=0), info)
    kit = provision_fleet(exp, tmp_path / "kit", run=RUN, broker_hosts=["127.0.0.1"], port=free_port(),
                          bind_address="127.0.0.1")  # fmt: skip
    bundles = {c: kit.root / "clients" / c for c in files}
    with (
        fleet_mosquitto(kit.broker_dir) as url,
        client_processes(files, url, RUN, log_dir=tmp_path / "logs", bundles=bundles),
    ):
        coordinator = load_bundle(kit.coordinator_dir, broker=url)
        result = run_coordinator(
            config,
            tmp_path / "run",
            broker=coordinator.address,
            run=RUN,
            provisioned=coordinator.clients,
            round_timeout=60,
            join_timeout=120,
            experiment=exp,
        )
    assert len(result.rounds) == 10 and all(r.aggregated for r in result.rounds)
    over_kit = load_file(result.path / "global_model.safetensors")
    in_process = _in_process(config, poison=True)
    assert max(float((over_kit[k] - in_process[k].float()).abs().max()) for k in over_kit) <= 1e-5
    clean, success = _scores(exp, over_kit)
    honest_clean, honest_success = _scores(exp, _in_process(config, poison=False))
    assert success <= honest_success + 0.05, (honest_success, success)
    assert honest_clean - clean <= 0.02, (honest_clean, clean)
