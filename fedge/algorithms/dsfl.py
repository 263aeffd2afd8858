"""Distillation-based semi-supervised FL (DS-FL; Itahara et al., IEEE TMC, sec. 2.3 and 3, Algorithm 1).

Every client and the server hold the same unlabeled open set (provisioned once, its cost ComU@I counted apart).
Each round the server picks an index set o_r of the open set; clients update on their private data (eq. 1), predict
softmax outputs on o_r (eq. 9) and upload them; the server aggregates them into global soft labels with SA (mean,
eq. 16) or ERA (softmax of the mean at temperature T, eq. 13-15), distills its global model on them (eq. 11) and
broadcasts them; clients distill on them too (eq. 10).

The index set travels as a seed both sides expand (zero tensor bytes), so the traffic per round is exactly the
paper's: K uploads of |o_r| x C plus one broadcast of |o_r| x C. Rounds are pipelined into one exchange each: the
task of round r carries round r-1's global soft labels, and the client distills on them before its update of round r,
which keeps the paper's order of steps (U, P, D, U, P, D, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from fedge.aggregation import aggregate_era, aggregate_sa
from fedge.algorithms.base import (
    ClientData,
    ClientStore,
    Evaluation,
    RoundPlan,
    SGDSettings,
    Strategy,
    derive_seed,
    evaluate_model,
    keep_own_model,
    restore_own_model,
    sgd_from_task,
    update_message,
)
from fedge.backend import Backend
from fedge.config import RunConfig
from fedge.errors import ConfigError
from fedge.messages import Message, format_float
from fedge.metrics import mean_entropy
from fedge.models import exchanged_state, load_exchanged_state
from fedge.training import Objective, train
from fedge.types import ClientId


def open_index_set(open_size: int, per_round: int, seed: int) -> np.ndarray:
    """o_r: ``per_round`` distinct indices into the open set, expanded from a seed identically on every side."""
    if per_round > open_size:
        raise ConfigError(f"open_per_round ({per_round}) exceeds the open set ({open_size} samples)")
    return np.sort(np.random.default_rng(seed).choice(open_size, size=per_round, replace=False))


class DistillationSemiSupervised(Strategy):
    """Server half of DS-FL: aggregate soft labels, distill the global model, broadcast."""

    name = "dsfl"

    def __init__(
        self,
        config: RunConfig,
        model_factory: Callable[[], nn.Module],
        num_classes: int,
        run_id: str = "",
        *,
        open_x: torch.Tensor,
    ) -> None:
        super().__init__(config, model_factory, num_classes, run_id)
        self.open_x = open_x
        self._model = self.model_factory()  # the global model w_g (eq. 11)
        self._soft_labels: torch.Tensor | None = None  # global soft labels of the latest round
        self._soft_round = 0
        a = self.config.algo
        if a.open_per_round > len(open_x):
            raise ConfigError(f"open_per_round ({a.open_per_round}) exceeds the open set ({len(open_x)} samples)")

    def index_seed(self, rnd: int) -> int:
        return derive_seed(self.config.seed, "open-index", rnd)

    def expected_reply_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"soft_labels": ((self.config.algo.open_per_round, self.num_classes), torch.float32)}

    def global_weights(self) -> dict[str, torch.Tensor]:
        return exchanged_state(self._model)

    def configure(self, rnd: int, clients: Sequence[ClientId]) -> RoundPlan:
        a = self.config.algo
        broadcast = None
        if self._soft_labels is not None:
            broadcast = self.broadcast(
                rnd,
                {"soft_labels": self._soft_labels},
                source_round=str(self._soft_round),
                index_seed=str(self.index_seed(self._soft_round)),
                open_size=str(len(self.open_x)),
                open_per_round=str(a.open_per_round),
            )
        params = {
            "model_seed": str(derive_seed(self.config.seed, "model")),
            "index_seed": str(self.index_seed(rnd)),
            "open_size": str(len(self.open_x)),
            "open_per_round": str(a.open_per_round),
            "distill_lr": format_float(a.distill_lr),
            "distill_epochs": str(a.distill_epochs),
            "distill_batch_size": str(a.distill_batch_size),
            "distill_seed": str(derive_seed(self.config.seed, "distill", rnd)),
        }
        return RoundPlan(broadcast=broadcast, tasks={c: self.task(rnd, c, **params) for c in clients})

    def aggregate(self, rnd: int, replies: Mapping[ClientId, Message]) -> dict[str, float]:
        a = self.config.algo
        uploads = [replies[c].tensor("soft_labels") for c in sorted(replies)]
        if a.aggregation == "era":
            soft = aggregate_era(uploads, temperature=a.era_temperature)
        else:
            soft = aggregate_sa(uploads)
        self._soft_labels, self._soft_round = soft.to(torch.float32).contiguous(), rnd
        if a.server_distill and a.distill_epochs > 0:
            idx = torch.from_numpy(open_index_set(len(self.open_x), a.open_per_round, self.index_seed(rnd)))
            x = self.open_x[idx]
            train(
                self._model,
                x,
                torch.zeros(len(x), dtype=torch.long),
                Objective("soft"),
                SGDSettings(
                    lr=a.distill_lr, momentum=self.config.train.momentum, weight_decay=self.config.train.weight_decay
                ),
                epochs=a.distill_epochs,
                batch_size=a.distill_batch_size,
                seed=derive_seed(self.config.seed, "server-distill", rnd),
                aux=self._soft_labels,
            )
        return {"global_logit_entropy": float(mean_entropy(self._soft_labels.numpy()))}

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> Evaluation:
        return evaluate_model(self._model, x, y, self.num_classes)

    def load_global_weights(self, state: dict[str, torch.Tensor]) -> None:
        load_exchanged_state(self._model, state)


def client_step(
    task: Message, broadcast: Message | None, data: ClientData, backend: Backend, store: ClientStore
) -> Message:
    """Client half: distill on the previous round's global soft labels, update on private data, predict on o_r."""
    if data.open_x is None:
        raise ConfigError("DS-FL needs the open dataset on the client (provision it with the client's data)")
    open_size = task.int_param("open_size")
    if open_size != len(data.open_x):
        raise ConfigError(f"the coordinator's open set has {open_size} samples, this client's has {len(data.open_x)}")
    restore_own_model(store, backend, task.int_param("model_seed"))
    distill_sgd = SGDSettings(
        lr=task.float_param("distill_lr"),
        momentum=task.float_param("momentum", 0.0),
        weight_decay=task.float_param("weight_decay", 0.0),
    )
    if broadcast is not None:  # eq. 10 for the previous round
        idx = open_index_set(open_size, broadcast.int_param("open_per_round"), broadcast.int_param("index_seed"))
        x = data.open_x[torch.from_numpy(idx)]
        backend.train(
            x,
            torch.zeros(len(x), dtype=torch.long),
            Objective("soft"),
            distill_sgd,
            epochs=task.int_param("distill_epochs"),
            batch_size=task.int_param("distill_batch_size"),
            seed=task.int_param("distill_seed"),
            aux=broadcast.tensor("soft_labels"),
        )
    backend.train(  # eq. 1
        data.x,
        data.y,
        Objective("ce"),
        sgd_from_task(task),
        epochs=task.int_param("epochs"),
        batch_size=task.int_param("batch_size"),
        seed=task.int_param("seed"),
    )
    idx = open_index_set(open_size, task.int_param("open_per_round"), task.int_param("index_seed"))
    probs = torch.softmax(backend.logits(data.open_x[torch.from_numpy(idx)]), dim=1)  # eq. 9
    keep_own_model(store, backend)
    return update_message(task, {"soft_labels": probs.to(torch.float32).contiguous()}, num_examples=str(len(data)))
