"""DS-FL under the mean and --robust median with 0, 1 and 3 confidently-wrong uploaders of 10 (in process, digits).

Run: ``python experiments/insiders_dsfl.py [ROUNDS]`` (default 5).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from insiders import Insider

from common.experiment import prepare
from coordinator.engine import RoundEngine
from edge_client.client import EdgeClient
from fedge.algorithms.dsfl import DSFLSettings
from fedge.backend import TorchBackend
from fedge.config import RunConfig, TrainConfig
from sim.inprocess import InProcessTransport

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
for robust in ("mean", "median"):
    for attackers in (0, 1, 3):
        cfg = RunConfig(
            algorithm="dsfl",
            dataset="digits",
            model="tiny_mlp",
            num_clients=10,
            rounds=rounds,
            partition="iid",
            train=TrainConfig(local_epochs=2, lr=0.1),
            algo=DSFLSettings(robust=robust, open_per_round=300),
        )
        exp = prepare(cfg)
        open_x = exp.open_x()
        backend = TorchBackend(exp.model, exp.input_shape, exp.num_classes)
        clients = [EdgeClient(c, exp.client_data(c, open_x), backend) for c in sorted(exp.parts)]
        clients[:attackers] = [Insider(c, "confident_wrong") for c in clients[:attackers]]
        tx, ty = exp.test_tensors()
        h = RoundEngine(exp.config, exp.strategy("d"), InProcessTransport(clients), tx, ty).run()
        print(
            f"dsfl {robust:6s} attackers={attackers}: final {100 * h.rounds[-1].accuracy:.1f}%, "
            f"skipped {sum(not r.aggregated for r in h.rounds)}",
            flush=True,
        )
