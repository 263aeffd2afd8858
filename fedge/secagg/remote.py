"""Secure aggregation with the parties apart (a deployment): the protocol's messages inside fedge's own message
frame, the client's party as a device runs it, and the interface a transport offers the server's side.

- :func:`to_message` / :func:`from_message`: a :class:`~fedge.secagg.messages.SecAggMessage` as a
  :class:`fedge.wire.message.Message` of kind :data:`SECAGG` (its arrays as tensors named ``secagg.<name>``, its
  metadata as ``secagg.*`` params), so it rides the transport's topics, chunking and session stamps like any other
  message; parsing checks everything the in-process codec does.
- :class:`ClientParty`: one client's round on the device. The client clips its own update (new weights minus the
  broadcast weights) to L2 norm ``bound`` (the ring bound is the norm bound) and scales it by its averaging share
  ``a_k / A`` that the server sends with the share delivery (or, under DP-FedAvg, adds its share of the noise:
  :mod:`fedge.privacy.shares`), and runs :class:`~fedge.secagg.protocol.SecAggClient`: its keys, self-mask seed,
  masks, noise and stochastic rounding never leave the device.
- :class:`StageChannel`: what the server's side (:func:`fedge.secagg.driver.serve_round`) needs of a transport.

What travels in the clear: each client's report (data size, loss), its public keys, which clients answered each
stage, and the averaging shares. The round's parameters (:class:`~fedge.secagg.config.RoundConfig`) and the order
of the tensors in the flat vector (:data:`LAYOUT_PARAM`) ride in the round's broadcast.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from fedge.errors import CodecError
from fedge.secagg.config import RoundConfig
from fedge.secagg.errors import MessageError, ProtocolViolation
from fedge.secagg.keys import KEY_BYTES
from fedge.secagg.messages import (
    BUNDLE_BYTES,
    MAX_CLIENTS,
    PREFIX,
    EncryptedShares,
    MaskedInput,
    NeighbourKeys,
    SecAggMessage,
    ShareDelivery,
    UnmaskRequest,
    UnmaskShares,
    message_from_fields,
)
from fedge.secagg.protocol import SecAggClient, Stage
from fedge.secagg.shamir import SHARE_BYTES, RandBytes
from fedge.tensors import l2_norm

if TYPE_CHECKING:
    import torch

    from fedge.types import ClientId
    from fedge.wire.message import Message

SECAGG = "secagg"
"""The kind of a frame that carries one protocol message (down on a client's task topic, up on its update topic)."""

SEED_PARAM = PREFIX + "round_seed"
"""Broadcast param: the round's public graph seed, in hex."""

LAYOUT_PARAM = PREFIX + "layout"
"""Broadcast param: the names of the tensors in the flat vector, in order, comma-separated."""

WEIGHT_PARAM = PREFIX + "weight"
"""Share-delivery param: the recipient's averaging share a_k / A, in (0, 1]."""

TENSOR_PREFIX = PREFIX
"""Tensors of a frame are the protocol message's arrays under this prefix."""

_MAX_LAYOUT_CHARS = 1 << 20


def clipped_delta(
    update: npt.NDArray[np.float64], reference: npt.NDArray[np.float64], bound: float
) -> tuple[npt.NDArray[np.float64], bool]:
    """``update - reference`` scaled down to L2 norm ``bound`` when longer; and whether it was."""
    delta = update - reference  # (dim,)
    norm = l2_norm(delta)
    if norm > bound:
        return delta * (bound / norm), True
    return delta, False


def to_message(
    message: SecAggMessage, *, run: str, kind: str = SECAGG, params: Mapping[str, str] | None = None
) -> Message:
    """``message`` in fedge's frame: ``kind`` (an update carrying the advertised keys uses the update kind), the
    protocol's round and client, ``params`` next to the protocol's metadata."""
    import torch

    from fedge.wire.message import Message

    arrays, meta = message.to_fields()
    tensors: dict[str, torch.Tensor] = {TENSOR_PREFIX + k: torch.from_numpy(a.copy()) for k, a in arrays.items()}
    return Message(
        kind, message.round, run=run, client=message.client, params={**(params or {}), **meta}, tensors=tensors
    )


def from_message(frame: Message) -> SecAggMessage:
    """The protocol message a frame carries; MessageError for anything malformed (no tensor but the message's own,
    every size and id checked by the message's parser), or a frame whose envelope disagrees with it."""
    arrays: dict[str, np.ndarray] = {}
    for name, t in frame.tensors.items():
        if not name.startswith(TENSOR_PREFIX):
            raise MessageError(f"a secure-aggregation frame carries only {TENSOR_PREFIX}* tensors, got {name[:60]!r}")
        try:
            arrays[name[len(TENSOR_PREFIX) :]] = t.detach().cpu().numpy()
        except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16, float8): no protocol message has one
            raise MessageError(f"tensor {name[:60]!r} has dtype {t.dtype}, which no protocol message uses") from None
    meta = {k: v for k, v in frame.params.items() if k.startswith(PREFIX)}
    message = message_from_fields(arrays, meta)
    if message.round != frame.round or message.client != frame.client:
        raise MessageError(
            f"the frame is for {frame.client[:64]!r} in round {frame.round}, its message for {message.client!r} in "
            f"round {message.round}"
        )
    return message


def max_frame_bytes(config: RoundConfig, stage: Stage) -> int:
    """The largest frame a client may send in ``stage`` of a round with ``config``: its arrays at their largest
    (one row per neighbour), the client lists, and 64 KiB of header and metadata; longer ones are refused unread."""
    k, ids = config.degree, 65 * config.degree
    body = {
        "advertise": 2 * KEY_BYTES,
        "share": k * BUNDLE_BYTES + ids,
        "upload": 4 * config.dim,
        "unmask": k * SHARE_BYTES + 2 * ids,
    }[stage]
    return body + (64 << 10)


def round_config_of(broadcast: Message) -> RoundConfig | None:
    """The secure-aggregation round a broadcast announces, or None when it announces none; MessageError when its
    parameters are malformed."""
    raw_seed = broadcast.params.get(SEED_PARAM)
    if raw_seed is None:
        return None
    try:
        seed = np.frombuffer(bytes.fromhex(raw_seed[:128]), dtype=np.uint8).copy()
    except ValueError:
        raise MessageError(f"param {SEED_PARAM} is not hex") from None
    return RoundConfig.from_fields({"secagg.round_seed": seed}, broadcast.params)


def layout_of(broadcast: Message) -> tuple[str, ...]:
    """The tensor names of the flat vector, in order (:data:`LAYOUT_PARAM`); MessageError when absent or odd."""
    raw = broadcast.params.get(LAYOUT_PARAM)
    if not isinstance(raw, str) or not raw or len(raw) > _MAX_LAYOUT_CHARS:
        raise MessageError(f"the broadcast lacks {LAYOUT_PARAM} (the order of the tensors), or it is too long")
    names = tuple(raw.split(","))
    if len(set(names)) != len(names) or len(names) > MAX_CLIENTS:
        raise MessageError(f"{LAYOUT_PARAM} repeats a tensor name")
    return names


def weight_of(frame: Message) -> float | None:
    """The averaging share a weighted round's share delivery carries (None: an unweighted round's); MessageError
    unless a number in (0, 1]."""
    raw = frame.params.get(WEIGHT_PARAM)
    if raw is None:
        return None
    try:
        weight = float(raw[:40])
    except ValueError:
        raise MessageError(f"param {WEIGHT_PARAM} is not a number") from None
    if not (math.isfinite(weight) and 0 < weight <= 1):
        raise MessageError(f"param {WEIGHT_PARAM} must lie in (0, 1], got {raw[:40]!r}")
    return weight


class ClientParty:
    """One client's side of one round on the device: the vector it adds to the sum, the protocol client with its own
    keys, and the answer to each stage's message.

    ``vector`` (the round's length) is what the client encodes: its update clipped to the round's bound
    (:func:`clipped_delta`; each part on its own, :mod:`fedge.secagg.parts`), which ``weighted`` rounds scale by the
    client's averaging share a_k / A from the share delivery (FedAvg's weighted mean; only the coordinates ``shared``
    marks, when given: the others are summed as they are), or DP-FedAvg's noised input
    (:func:`fedge.privacy.shares.client_input`, summed as it is). ``rng`` draws the stochastic rounding (default:
    seeded from the OS); ``rand_bytes`` keys and seeds.
    """

    def __init__(
        self,
        config: RoundConfig,
        client: ClientId,
        vector: npt.NDArray[np.float64],
        *,
        weighted: bool,
        rand_bytes: RandBytes = os.urandom,
        rng: np.random.Generator | None = None,
        shared: npt.NDArray[np.bool_] | None = None,
    ) -> None:
        if vector.shape != (config.dim,):
            raise ProtocolViolation(
                f"the round sums vectors of {config.dim} values, this client's has {vector.shape[0]}"
            )
        if shared is not None and shared.shape != vector.shape:
            raise ProtocolViolation("the weighted coordinates' mask must be as long as the vector")
        self.config = config
        self.vector = vector  # (dim,)
        self.weighted = weighted
        self.shared = shared  # (dim,) the coordinates the share multiplies (fedge.secagg.parts); None: all
        self.protocol = SecAggClient(config, client, rand_bytes=rand_bytes)
        self._rng = rng

    def advertise(self) -> SecAggMessage:
        """Stage 0: the client's fresh public keys."""
        return self.protocol.advertise()

    def answer(self, message: SecAggMessage, weight: float | None = None) -> SecAggMessage:
        """The answer to the server's message of a stage; ``weight`` (a_k / A) comes with a weighted round's share
        delivery, and with no other. ProtocolViolation for a message out of order or one the protocol forbids
        answering (revealing nothing)."""
        if isinstance(message, NeighbourKeys):
            return self.protocol.share_keys(message)
        if isinstance(message, ShareDelivery):
            if self.weighted != (weight is not None):
                raise ProtocolViolation(
                    "a weighted round's share delivery carries the client's averaging share, an unweighted one none"
                )
            if weight is None:
                x = self.vector
            elif self.shared is None:
                x = self.vector * weight
            else:  # a part summed unweighted (SCAFFOLD's control deltas, FedDyn's drift) is added once
                x = self.vector * np.where(self.shared, weight, 1.0)
            return self.protocol.masked_input(message, x, rng=self._rng)
        if isinstance(message, UnmaskRequest):
            return self.protocol.unmask(message)
        raise ProtocolViolation(f"a client does not answer a {message.KIND} message")


class StageChannel(Protocol):
    """How the server's side reaches clients that run their own parties (a transport's part of a secure round)."""

    def stage(
        self,
        rnd: int,
        config: RoundConfig,
        stage: Stage,
        messages: Mapping[ClientId, SecAggMessage],
        params: Mapping[ClientId, Mapping[str, str]],
    ) -> list[SecAggMessage]:
        """Send each client its message of ``stage`` (with its ``params``), wait for the answers until every
        recipient answered or left, or the stage's deadline passed; the answers that parsed, from their senders."""
        ...

    def take_record(self, rnd: int) -> tuple[list, dict[ClientId, str]]:
        """The ledger entries of round ``rnd``'s protocol messages so far, and why each client that stopped answering
        did (e.g. "silent past the 60 s deadline of stage 'upload'"); both forgotten afterwards."""
        ...


def check_frame(frame: Message, *, run: str, client: ClientId, rnd: int) -> None:
    """CodecError unless a frame is a protocol message from ``client`` of run ``run`` and round ``rnd``."""
    if frame.kind != SECAGG:
        raise CodecError(f"expected a {SECAGG!r} message, got {frame.kind[:40]!r}")
    if frame.run != run or frame.client != client or frame.round != rnd:
        raise CodecError(
            f"the message is of run {frame.run[:64]!r}, client {frame.client[:64]!r}, round {frame.round}: expected "
            f"{run!r}, {client!r}, round {rnd}"
        )


STAGE_OF_KIND: dict[str, Stage] = {
    NeighbourKeys.KIND: "share",
    ShareDelivery.KIND: "upload",
    UnmaskRequest.KIND: "unmask",
}
"""The stage each server-to-client message opens (what a client that vanishes at that stage never answers)."""

ANSWER_OF_STAGE: dict[Stage, str] = {
    "share": EncryptedShares.KIND,
    "upload": MaskedInput.KIND,
    "unmask": UnmaskShares.KIND,
}
"""The kind of message that answers each stage: any other (an earlier stage's answer sent again, as a client does
after a reconnect) answers nothing and must not take the sender's turn."""
