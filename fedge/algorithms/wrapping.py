"""A server half that wraps another: every :class:`~fedge.algorithms.base.Strategy` method forwarded to the wrapped
strategy, so a wrapper (compression, DP-FedAvg, secure aggregation) overrides only the methods whose behaviour it
changes. Forwarding is written method by method, not through ``__getattr__``: the type checker sees every call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fedge.accounting.records import AggregationRecord
from fedge.algorithms.base import (
    CheckedReply,
    Evaluation,
    RoundPlan,
    ServerContext,
    Strategy,
    StrategyState,
    TensorSpec,
    UpdateReport,
)
from fedge.config import AlgorithmSettings, RunConfig
from fedge.types import ClientId, StateDict
from fedge.wire.message import Message


class WrappingStrategy(Strategy[AlgorithmSettings]):
    """A :class:`~fedge.algorithms.base.Strategy` that is ``inner`` in every respect a subclass does not override.

    Its reports are the inner strategy's (:attr:`report_type`, :meth:`report_of`), and so is the tolerance of its
    checks. :meth:`check_reply` is :meth:`accept`'s verdict, so a subclass that changes what it accepts (decoding,
    a protocol's keys) changes both."""

    def __init__(self, inner: Strategy[Any], config: RunConfig) -> None:
        super().__init__(
            config,
            ServerContext(
                inner.model_factory, inner.num_classes, run_id=inner.run_id, evaluation_device=inner.evaluation_device
            ),
        )
        self.inner = inner
        self.report_type = inner.report_type
        self.reply_tolerance = inner.reply_tolerance

    def configure(self, rnd: int, clients: Sequence[ClientId]) -> RoundPlan:
        return self.inner.configure(rnd, clients)

    def accept(self, rnd: int, client: ClientId, reply: Message) -> CheckedReply:
        return self.inner.accept(rnd, client, reply)

    def check_reply(self, rnd: int, client: ClientId, reply: Message) -> UpdateReport:
        return self.accept(rnd, client, reply).report

    def aggregate(self, rnd: int, replies: Mapping[ClientId, CheckedReply]) -> dict[str, float]:
        return self.inner.aggregate(rnd, replies)

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> Evaluation | None:
        return self.inner.evaluate(x, y)

    def reply_tensors(self) -> dict[str, TensorSpec]:
        return self.inner.reply_tensors()

    def wire_reply_tensors(self) -> dict[str, TensorSpec]:
        return self.inner.wire_reply_tensors()

    def global_weights(self) -> StateDict | None:
        return self.inner.global_weights()

    def aggregation_record(self, rnd: int) -> AggregationRecord:
        return self.inner.aggregation_record(rnd)

    def stop_before(self, rnd: int) -> str:
        return self.inner.stop_before(rnd)

    def state(self) -> StrategyState:
        return self.inner.state()

    def load_state(self, tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any]) -> None:
        self.inner.load_state(tensors, values)

    def report_of(self, reply: Message) -> UpdateReport:
        return self.inner.report_of(reply)
