"""The server half of a run that compresses what travels: the algorithm's strategy inside, coded messages outside.

:class:`CompressedStrategy` encodes the round's broadcast, tells every task which scheme its reply must use, and
decodes each reply (refusing one that declares another scheme, or whose coded tensors do not fit) before the
algorithm's own checks and aggregation see it; the schemes and the message coding are
:mod:`fedge.compression.strategy`'s, the client side's too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from fedge.algorithms.base import CheckedReply, RoundPlan, Strategy, TensorSpec
from fedge.algorithms.wrapping import WrappingStrategy
from fedge.compression import codecs as cz
from fedge.compression.strategy import (
    FEEDBACK,
    UPLOAD_PREFIX,
    Compression,
    decode_broadcast,
    delta_reference,
    encode_message,
    without_codec,
)
from fedge.config import RunConfig
from fedge.types import ClientId
from fedge.wire.message import Message


class CompressedStrategy(WrappingStrategy):
    """A :class:`Strategy` whose messages travel compressed; the algorithm sees float32.

    Everything that is not about messages (evaluation, state, global weights, what stops a run) is the wrapped
    strategy's (:class:`~fedge.algorithms.wrapping.WrappingStrategy`)."""

    def __init__(self, inner: Strategy[Any], compression: Compression) -> None:
        if compression.upload.name != "float32":  # the inner checks of probability rows allow the coding's error
            inner.reply_tolerance = compression.probability_error()
        super().__init__(inner, inner.config)
        self.compression = compression
        self._reference: dict[str, torch.Tensor] = {}  # this round's broadcast as the clients decode it

    def configure(self, rnd: int, clients: Sequence[ClientId]) -> RoundPlan:
        plan = self.inner.configure(rnd, clients)
        broadcast = plan.broadcast
        self._reference = dict(broadcast.tensors) if broadcast is not None else {}
        c = self.compression
        if broadcast is not None and c.broadcast.name != "float32":
            generator = torch.Generator().manual_seed(rnd) if c.broadcast.stochastic else None
            encoded = cz.encode(broadcast.tensors, c.broadcast, generator=generator)
            broadcast = encode_message(broadcast, c.broadcast, encoded, shapes=True)
            self._reference = dict(decode_broadcast(broadcast).tensors)  # what clients will hold
        tasks = plan.tasks
        if c.upload.name != "float32":
            extra = c.upload.to_meta(UPLOAD_PREFIX) | ({FEEDBACK: "1"} if c.feedback else {})
            tasks = {cid: replace(t, params={**t.params, **extra}) for cid, t in tasks.items()}
        return replace(plan, broadcast=broadcast, tasks=tasks)

    def accept(self, rnd: int, client: ClientId, reply: Message) -> CheckedReply:
        """Decode ``reply`` under the scheme its task asked for (CodecError otherwise), then the algorithm's checks;
        the decoded update is what :meth:`aggregate` receives."""
        scheme = self.compression.upload
        decoded = reply
        if scheme.name != "float32":
            expect = {k: cz.TensorSpec(shape, dtype) for k, (shape, dtype) in self.inner.reply_tensors().items()}
            reference = delta_reference(expect, self._reference) if scheme.delta else None
            tensors = cz.decode(reply.tensors, reply.params, expect, scheme=scheme, reference=reference)
            decoded = replace(reply, params=without_codec(reply.params), tensors=tensors)
        return self.inner.accept(rnd, client, decoded)

    def wire_reply_tensors(self) -> dict[str, TensorSpec]:
        """What a valid reply carries on the wire: the coded parts of :meth:`reply_tensors`."""
        expect = {k: cz.TensorSpec(shape, dtype) for k, (shape, dtype) in self.inner.reply_tensors().items()}
        coded = cz.coded_specs(expect, self.compression.upload)
        return {k: (s.shape, s.dtype) for k, s in coded.items()}


def compressed(strategy: Strategy[Any], config: RunConfig) -> Strategy[Any]:
    """``strategy`` wrapped for the run's compression, or itself when the run sends float32 both ways."""
    compression = config.compression
    if not compression.active:
        return strategy
    return CompressedStrategy(strategy, compression)
