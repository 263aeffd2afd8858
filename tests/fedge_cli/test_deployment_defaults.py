"""The deployment defaults chosen in issue 52 (docs/deployment.md): what ``fedge provision`` writes and ``fedge
coordinator`` runs when nobody chose, and where they step aside (the simulator, secure aggregation, a choice)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedge.aggregation.robust import (
    DEPLOYMENT_CLIP_FACTOR,
    DEPLOYMENT_MAX_UPDATE_RATIO,
    DEPLOYMENT_RULE,
    DEPLOYMENT_SOFT_LABEL_RULE,
)
from fedge_cli.main import DEPLOYMENT_MIN_REPLIES, _run_config, build_parser, main


def test_the_chosen_defaults() -> None:
    """The values the measurements chose (experiments/results/backdoor-defaults): a change here is a change of what
    every fleet runs, to be made with new figures."""
    assert (DEPLOYMENT_RULE, DEPLOYMENT_CLIP_FACTOR, DEPLOYMENT_SOFT_LABEL_RULE) == ("flame", 1.0, "median")
    assert DEPLOYMENT_MAX_UPDATE_RATIO == 5.0
    assert DEPLOYMENT_MIN_REPLIES == 0.5


@pytest.mark.parametrize(("algorithm", "robust"), [("fedavg", DEPLOYMENT_RULE), ("dsfl", DEPLOYMENT_SOFT_LABEL_RULE)])
def test_provision_writes_the_deployment_defaults(tmp_path: Path, algorithm: str, robust: str) -> None:
    argv = ["provision", "--out", str(tmp_path), "--dataset", "synthetic", "--model", "tiny_mlp", "--num-clients", "2"]
    assert main([*argv, "--algorithm", algorithm]) == 0
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["algo"]["robust"] == robust
    assert written["min_replies"] == DEPLOYMENT_MIN_REPLIES
    if algorithm == "fedavg":
        assert (written["algo"]["clip_factor"], written["algo"]["max_update_ratio"]) == (
            DEPLOYMENT_CLIP_FACTOR,
            DEPLOYMENT_MAX_UPDATE_RATIO,
        )


def _algo(*argv: str, deployment: bool = True) -> tuple[str, float]:
    config = _run_config(build_parser().parse_args(list(argv)), deployment=deployment)
    return config.algo.robust, getattr(config.algo, "clip_factor", 0.0)


def test_the_coordinator_runs_them_and_the_simulator_keeps_the_papers_mean(tmp_path: Path) -> None:
    for algorithm in ("fedavg", "fedntd", "scaffold"):
        assert _algo("coordinator", "--algorithm", algorithm) == (DEPLOYMENT_RULE, DEPLOYMENT_CLIP_FACTOR)
        assert _algo("sim", "--algorithm", algorithm, deployment=False) == ("mean", 0.0)
        assert _algo("coordinator", "--algorithm", algorithm, "--robust", "median") == ("median", 1.0)  # asked for
        assert _algo("coordinator", "--algorithm", algorithm, "--robust", "mean") == ("mean", DEPLOYMENT_CLIP_FACTOR)
    assert _algo("coordinator", "--algorithm", "dsfl") == (DEPLOYMENT_SOFT_LABEL_RULE, 0.0)
    assert _algo("sim", "--algorithm", "dsfl", deployment=False) == ("mean", 0.0)
    path = tmp_path / "c.json"  # a config file's choice stands
    path.write_text(json.dumps({"algorithm": "fedavg", "algo": {"robust": "mean"}}))
    assert _algo("coordinator", "--config", str(path)) == ("mean", DEPLOYMENT_CLIP_FACTOR)


def test_secure_aggregation_keeps_the_mean_and_the_clients_clip() -> None:
    """Under secure aggregation the server sees only the sum: no server-side rule or clip is defaulted in (both
    would be refused); each client's clip to --secagg-clip is what holds."""
    config = _run_config(build_parser().parse_args(["sim", "--secure-aggregation"]), deployment=True)
    assert (config.algo.robust, config.algo.clip_factor) == ("mean", 0.0)


def test_the_update_bound_is_the_deployments_unless_chosen(tmp_path: Path) -> None:
    def bound(*argv: str, deployment: bool = True) -> float:
        return _run_config(build_parser().parse_args(list(argv)), deployment=deployment).algo.max_update_ratio

    assert bound("coordinator") == DEPLOYMENT_MAX_UPDATE_RATIO
    assert bound("sim", deployment=False) == 10.0  # the simulator keeps its own
    assert bound("coordinator", "--max-update-ratio", "8") == 8.0
    path = tmp_path / "c.json"  # a config file's choice stands
    path.write_text(json.dumps({"algorithm": "fedavg", "algo": {"max_update_ratio": 10.0}}))
    assert bound("coordinator", "--config", str(path)) == 10.0
