"""In-process simulation: all clients in this process, messages really encoded and decoded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from common.experiment import Experiment, prepare
from common.rundir import RunResult, RunWriter
from coordinator.engine import RoundEngine
from edge_client.client import EdgeClient
from fedge.backend import Backend, TorchBackend
from fedge.config import RunConfig
from fedge.records import RoundRecord
from fedge.types import ClientId
from sim.inprocess import InProcessTransport


def run_inprocess(
    config: RunConfig,
    run_dir: Path,
    *,
    device: str = "cpu",
    on_round: Callable[[RoundRecord], None] | None = None,
    experiment: Experiment | None = None,
    backend_for: Callable[[ClientId], Backend] | None = None,
) -> RunResult:
    """Run ``config`` with every client in this process and write ``run_dir``.

    ``backend_for``: each client's own runtime (e.g. a mixed fleet of PyTorch and ExecuTorch clients); by default all
    clients share one PyTorch backend, used in turn.
    """
    exp = experiment or prepare(config)
    config = exp.config  # resolved (e.g. DS-FL open-set sizes fitted to the dataset)
    run_id = run_dir.name
    backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes, device=device)  # one runtime, shared in turn
    open_x = exp.open_x()
    clients = [
        EdgeClient(c, exp.client_data(c, open_x), backend_for(c) if backend_for else backend) for c in sorted(exp.parts)
    ]
    strategy = exp.strategy(run_id)
    test_x, test_y = exp.test_tensors()
    engine = RoundEngine(
        config, strategy, InProcessTransport(clients), test_x, test_y, initial_bytes=exp.initial_bytes()
    )
    writer = RunWriter(run_dir, config, exp.partition_summary())

    def record(r: RoundRecord) -> None:
        writer.round(r)
        if on_round is not None:
            on_round(r)

    history = engine.run(record)
    summary = writer.finish(
        history.rounds,
        history.ledger,
        strategy.global_weights(),
        initial_bytes=exp.initial_bytes(),
        extra={"model": exp.model, "transport": "inprocess"},
    )
    return RunResult(run_dir, config, history.rounds, summary)
