"""fedge.programs.planning: the trainings a client will run, found before the run by playing its first rounds."""

from __future__ import annotations

import pytest

from fedge.algorithms.dsfl import DSFLSettings, SoftTargets
from fedge.algorithms.fd import FDDistillation
from fedge.algorithms.fedavg import CrossEntropy
from fedge.algorithms.fedntd import NotTrueDistillation
from fedge.algorithms.fedprox import FedProxSettings, Proximal
from fedge.config import RunConfig, TrainConfig
from fedge.programs.planning import PlannedTraining, planned_trainings
from fedge.programs.spec import TrainingLoss
from fedge_io.experiment import prepare


def _plans(config: RunConfig) -> list[PlannedTraining]:
    exp = prepare(config)
    data = exp.client_data("c001", exp.open_x())
    return planned_trainings(exp.config, "c001", data, exp.model, exp.input_shape)


BASE = {"dataset": "digits", "num_clients": 4, "train": TrainConfig(batch_size=32)}


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (RunConfig(algorithm="fedavg", **BASE), [PlannedTraining(TrainingLoss(CrossEntropy()), 32)]),  # type: ignore[arg-type]
        (
            RunConfig(algorithm="fedntd", **BASE),  # type: ignore[arg-type]
            [PlannedTraining(TrainingLoss(NotTrueDistillation(tau=1.0, beta=1.0)), 32)],
        ),
        (
            RunConfig(algorithm="fedprox", algo=FedProxSettings(prox_mu=0.3), **BASE),  # type: ignore[arg-type]
            [PlannedTraining(TrainingLoss(CrossEntropy(), (Proximal(mu=0.3),)), 32)],
        ),
        (  # FD distils from round 2 on, toward the previous round's global outputs
            RunConfig(algorithm="fd", **BASE),  # type: ignore[arg-type]
            [
                PlannedTraining(TrainingLoss(CrossEntropy()), 32),
                PlannedTraining(TrainingLoss(FDDistillation(gamma=1.0)), 32),
            ],
        ),
        (  # DS-FL: local training, then from round 2 on distillation at its own batch size
            RunConfig(
                algorithm="dsfl",
                algo=DSFLSettings(open_per_round=100, distill_batch_size=20),
                open_size=200,
                **BASE,  # type: ignore[arg-type]
            ),
            [PlannedTraining(TrainingLoss(CrossEntropy()), 32), PlannedTraining(TrainingLoss(SoftTargets()), 20)],
        ),
    ],
    ids=["fedavg", "fedntd", "fedprox", "fd", "dsfl"],
)
def test_the_first_rounds_show_every_training_a_client_runs(config: RunConfig, expected: list[PlannedTraining]) -> None:
    assert _plans(config) == expected
