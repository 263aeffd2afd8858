"""Which trainings a client will run in a run, known before the run starts: so a device prepares its programs first.

An on-device runtime (an ExecuTorch training program, an ONNX Runtime training artifact) needs one program per loss
and batch bound, and making one takes seconds to minutes. A client that made them when its first task arrived would
spend that time inside a round. :func:`planned_trainings` finds them from the run's config before the client says
hello: it plays the first rounds of the run's own algorithm, the real server half and the real client half, with a
:class:`RecordingBackend` that records each training request instead of running it (its logits are zeros, so no
model runs). Two rounds cover every algorithm here: FD and DS-FL distil toward the previous round's broadcast from
round 2 on. Hyperparameters that a program bakes in (tau, beta, gamma, the local terms' such as FedProx's mu) are fixed
for a run; the learning rate, which changes per round, is an input of every program. A request that asks for the
Fisher information also needs the plain cross-entropy program, whose gradients the Fisher pass squares.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fedge.algorithms import make_strategy, run_client_step
from fedge.algorithms.base import ClientData, ServerContext
from fedge.algorithms.dsfl import DSFLSettings
from fedge.algorithms.fedavg import CrossEntropy
from fedge.config import RunConfig
from fedge.learning.models import build_model, exchanged_state, load_exchanged_state
from fedge.learning.training import TrainRequest, TrainStats
from fedge.programs.spec import TrainingLoss
from fedge.types import ClientId, StateDict
from fedge.wire.message import Message


@dataclass(frozen=True)
class PlannedTraining:
    """One kind of training program a client will run: its loss (objective and local terms) and its batch size."""

    loss: TrainingLoss
    batch_size: int


class RecordingBackend:
    """A :class:`fedge.learning.backend.Backend` that records training requests instead of running them."""

    runtime = "planning"

    def __init__(self, model: str, input_shape: tuple[int, ...], num_classes: int) -> None:
        self.model_name, self.input_shape, self.num_classes = model, tuple(input_shape), num_classes
        self.model = build_model(model, input_shape=self.input_shape, num_classes=num_classes, seed=0)
        self.requests: list[TrainRequest] = []

    def set_weights(self, state: StateDict) -> None:
        load_exchanged_state(self.model, state)

    def get_weights(self) -> StateDict:
        return exchanged_state(self.model)

    def init_weights(self, seed: int) -> StateDict:
        return exchanged_state(
            build_model(self.model_name, input_shape=self.input_shape, num_classes=self.num_classes, seed=seed)
        )

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(x), self.num_classes)  # uniform predictions: valid probability rows downstream

    def train(self, request: TrainRequest) -> TrainStats:
        self.requests.append(request)
        # A Fisher asked for is answered with zeros (FedCurv's client uploads it; no model runs here).
        fisher = {k: torch.zeros_like(p) for k, p in self.model.named_parameters()} if request.fisher_samples else None
        return TrainStats(steps=1, samples=len(request.x), mean_loss=0.0, fisher=fisher)


def planned_trainings(
    config: RunConfig, client: ClientId, data: ClientData, model: str, input_shape: tuple[int, ...], rounds: int = 2
) -> list[PlannedTraining]:
    """The distinct trainings ``client`` runs in the first ``rounds`` rounds of ``config``, in order of first use.

    The server half runs as configured, except that DS-FL's server distillation is skipped (what the server trains does
    not change what a client trains, and it would cost the device a model's training).
    """
    if isinstance(config.algo, DSFLSettings):
        config = dataclasses.replace(config, algo=dataclasses.replace(config.algo, server_distill=False))
    num_classes = data.num_classes

    def model_factory() -> torch.nn.Module:
        return build_model(model, input_shape=input_shape, num_classes=num_classes, seed=0)

    strategy = make_strategy(config, ServerContext(model_factory, num_classes, "planning", data.open_x))
    backend = RecordingBackend(model, input_shape, num_classes)
    store: dict[str, torch.Tensor] = {}
    for rnd in range(1, min(rounds, config.rounds) + 1):
        plan = strategy.configure(rnd, [client])
        update: Message = run_client_step(plan.tasks[client], plan.broadcast, data, backend, store)
        strategy.aggregate(rnd, {client: strategy.accept(rnd, client, update)})
    out: list[PlannedTraining] = []
    for r in backend.requests:
        planned = [PlannedTraining(TrainingLoss.of(r.objective, r.terms), r.batch_size)]
        if r.fisher_samples > 0:  # the Fisher pass runs on the cross-entropy program's gradients
            planned.append(PlannedTraining(TrainingLoss(CrossEntropy()), r.batch_size))
        out += [p for p in planned if p not in out]
    return out
