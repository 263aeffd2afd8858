"""A pixel-trigger data-poisoning backdoor (issue 52) against what ``fedge coordinator`` runs by default, in process
through the coordinator's round engine: digits, ``tiny_mlp``, 10 clients, IID, 10 rounds, one client poisoning half
of its own data (no boosting). Under the deployment default (FLAME) the attack succeeds no more often than on the
honest run plus 5 points, at the honest run's clean accuracy within 2 points; under the clip that was the default
before, it succeeds on a fifth of the triggered images or more (measured 24% at round 10; 49.9% at round 20)."""

from __future__ import annotations

import torch
from insiders import BACKDOOR_TARGET, poisoned, trigger

from coordinator.engine import RoundEngine
from edge_client.client import EdgeClient
from fedge.algorithms.base import evaluate_model
from fedge.config import RunConfig
from fedge.learning.backend import TorchBackend
from fedge.learning.models import build_model, load_exchanged_state
from fedge_cli.main import _run_config, build_parser
from fedge_io.experiment import prepare
from sim.inprocess import InProcessTransport

FLAGS = ["--algorithm", "fedavg", "--dataset", "digits", "--model", "tiny_mlp", "--num-clients", "10"]
FLAGS += ["--rounds", "10", "--partition", "iid", "--local-epochs", "2", "--lr", "0.1"]


def _run(config: RunConfig, poisoners: int, refused: set[str] | None = None) -> tuple[float, float]:
    """Clean accuracy and attack success after the last round; the first ``poisoners`` clients poison their data.
    ``refused``: filled with the clients any of whose updates the server refused as too long."""
    exp = prepare(config)
    backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes)
    value = float(exp.train.x.max())
    clients = [EdgeClient(c, exp.client_data(c), backend) for c in sorted(exp.parts)]
    for i in range(poisoners):
        clients[i] = EdgeClient(clients[i].client_id, poisoned(clients[i].data, value, seed=i), backend)
    strategy = exp.strategy("backdoor")
    test_x, test_y = exp.test_tensors()
    history = RoundEngine(exp.config, strategy, InProcessTransport(clients), test_x, test_y).run()
    if refused is not None:
        refused.update(r.client for rnd in history.rounds for r in rnd.rejections if "moves the model by" in r.detail)
    model = build_model(exp.model, input_shape=exp.input_shape, num_classes=exp.num_classes)
    weights = strategy.global_weights()
    assert weights is not None
    load_exchanged_state(model, weights)
    keep = test_y != BACKDOOR_TARGET
    target = torch.full_like(test_y[keep], BACKDOOR_TARGET)
    success = evaluate_model(model, trigger(test_x[keep], value), target, exp.num_classes).accuracy
    return float(history.rounds[-1].accuracy or 0.0), success


def test_the_deployment_default_holds_one_poisoning_client_of_ten() -> None:
    default = _run_config(build_parser().parse_args(["coordinator", *FLAGS]), deployment=True)
    assert default.algo.robust == "flame"  # type: ignore[attr-defined]
    honest_clean, honest_success = _run(default, 0)
    clean, success = _run(default, 1)
    assert success <= honest_success + 0.05 and honest_clean - clean <= 0.02, (honest_success, success, clean)
    old = _run_config(build_parser().parse_args(["coordinator", *FLAGS, "--robust", "mean"]), deployment=True)
    assert old.algo.clip_factor == 1.0  # type: ignore[attr-defined]
    assert _run(old, 1)[1] >= 0.2  # the attack is real: the clip alone lets it through


def test_the_deployment_default_holds_three_poisoning_clients_of_ten_to_round_25() -> None:
    """Three poisoners of ten, as ``test_backdoor_over_kit.py`` runs them for 10 rounds, for 25. FLAME alone holds
    them at the honest level to round 16, then not (``experiments/backdoor.py long``: 6.2% at round 20, 25.2% at 25,
    88.1% at 40, against 0.7-1.2% honest): late in training the honest updates grow nearly orthogonal to each other
    while the poisoners' stay aligned, so the tightest majority takes them in. Their updates are then 8-12 x the
    median norm, and the deployment's update bound of 5 x (DEPLOYMENT_MAX_UPDATE_RATIO) refuses them: with it the
    backdoor stays at the honest level (0.7% to round 40)."""
    default = _run_config(build_parser().parse_args(["coordinator", *FLAGS, "--rounds", "25"]), deployment=True)
    honest_clean, honest_success = _run(default, 0)
    refused: set[str] = set()
    clean, success = _run(default, 3, refused)
    assert success <= honest_success + 0.05 and honest_clean - clean <= 0.02, (honest_success, success, clean)
    assert refused == {"c000", "c001", "c002"}  # the bound is what refused them, and no honest client
