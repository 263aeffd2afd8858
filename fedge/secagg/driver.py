"""A whole SecAgg+ round in one process: every client and the server exchange the real messages, each packed into
safetensors bytes and parsed back, so the simulator runs the same protocol and codec as a deployment does and counts
the same bytes. Clients may vanish at any stage, as they do on a real network.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar

import numpy as np
import numpy.typing as npt

from fedge.secagg.config import RoundConfig
from fedge.secagg.encoding import RingPlan, RingVector
from fedge.secagg.errors import MessageError, ProtocolViolation, SecAggConfigError, SecAggError
from fedge.secagg.messages import (
    AdvertiseKeys,
    EncryptedShares,
    MaskedInput,
    NeighbourKeys,
    SecAggMessage,
    ShareDelivery,
    UnmaskRequest,
    UnmaskShares,
    pack,
    unpack,
)
from fedge.secagg.protocol import STAGES, AggregateResult, SecAggClient, SecAggServer, Stage
from fedge.secagg.shamir import RandBytes

if TYPE_CHECKING:
    from fedge.types import ClientId  # annotations only: fedge.types imports torch

_M = TypeVar("_M", bound=SecAggMessage)

OnMessage = Callable[[SecAggMessage, Stage, Literal["up", "down"], int], None]
"""Told of every message :func:`run_round` sends: the message as parsed, its stage, its direction (up: a client sent
it; down: the server sent it to ``message.client``) and its packed size in bytes."""


@dataclass(frozen=True, eq=False)
class RoundResult:
    """The outcome of :func:`run_round`: the unmasked sum, who is in it, and what the protocol cost."""

    sum_ring: RingVector  # (dim,) uint32: sum over ``survivors`` of their encoded vectors, mod 2^ring_bits
    decoded_sum: npt.NDArray[np.float64]  # (dim,) the same sum as real numbers
    survivors: tuple[ClientId, ...]  # U3: whose vectors are in the sum; average by their weights
    dropped: tuple[ClientId, ...]  # the rest of the cohort
    config: RoundConfig
    bytes_per_stage_up: dict[Stage, int] = field(default_factory=dict)  # packed bytes clients sent, per stage
    bytes_per_stage_down: dict[Stage, int] = field(default_factory=dict)  # packed bytes the server sent (one copy
    # per recipient), per stage it opens; the round's config travels with the task and is not counted here
    timings: dict[str, float] = field(default_factory=dict)  # seconds: "<stage>.clients", "<stage>.server", "codec"

    @property
    def plan(self) -> RingPlan:
        """How values were mapped to the ring."""
        return self.config.plan


def run_round(
    vectors: Mapping[ClientId, npt.ArrayLike],
    *,
    bound: float,
    round_seed: bytes,
    run: str,
    session: str,
    round: int,
    ring_bits: int = 32,
    drop_at: Mapping[ClientId, Stage] | None = None,
    degree: int | None = None,
    threshold: int | None = None,
    min_survivors: int | None = None,
    rng: np.random.Generator | None = None,
    rand_bytes: RandBytes = os.urandom,
    on_message: OnMessage | None = None,
) -> RoundResult:
    """Securely sum ``vectors`` (one flat vector per client of the cohort, all of one length) over one SecAgg+ round.

    ``drop_at[c]`` names the stage at which client c vanishes: it sends nothing from that stage on ("advertise":
    never shows up; "share": advertised keys only; "upload": shared keys, never uploads; "unmask": uploaded, never
    answers the unmask request). ``rng`` draws each client's stochastic rounding (one child generator per client, in
    id order); ``rand_bytes`` draws keys, seeds and nonces (os.urandom unless a test needs determinism).
    ``on_message`` is told of each message as it goes, so a caller can account for the bytes of a round that ends in
    :class:`fedge.secagg.errors.RoundAbandoned` (raised when too many clients vanish) as well.
    """
    ids = sorted(vectors)
    if not ids:
        raise SecAggConfigError("no vectors to aggregate")
    first = np.shape(vectors[ids[0]])  # every client's length is checked when it encodes
    if len(first) != 1:
        raise SecAggConfigError(f"secure aggregation sums flat vectors, got shape {first}")
    config = RoundConfig.new(
        run=run,
        session=session,
        round=round,
        clients=ids,
        round_seed=round_seed,
        dim=int(first[0]),
        bound=bound,
        ring_bits=ring_bits,
        degree=degree,
        threshold=threshold,
        min_survivors=min_survivors,
    )
    return run_configured(config, vectors, drop_at=drop_at, rng=rng, rand_bytes=rand_bytes, on_message=on_message)


def run_configured(
    config: RoundConfig,
    vectors: Mapping[ClientId, npt.ArrayLike],
    *,
    drop_at: Mapping[ClientId, Stage] | None = None,
    rng: np.random.Generator | None = None,
    rand_bytes: RandBytes = os.urandom,
    on_message: OnMessage | None = None,
) -> RoundResult:
    """:func:`run_round` with the round's parameters already fixed (a strategy that announced them with the round):
    ``vectors`` has one entry per client of ``config.clients``, each of ``config.dim`` values."""
    drops = dict(drop_at or {})
    ids = sorted(vectors)
    if tuple(ids) != config.clients:
        raise SecAggConfigError("the vectors must be those of the round's clients, one each")
    unknown = set(drops) - set(ids)
    if unknown or any(s not in STAGES for s in drops.values()):
        raise SecAggConfigError(f"drop_at names clients outside the cohort or unknown stages: {sorted(unknown)[:5]}")
    seeds = (rng if rng is not None else np.random.default_rng(int.from_bytes(os.urandom(32), "big"))).integers(
        0, 2**63, size=len(ids)
    )
    rounding = {c: np.random.default_rng(int(s)) for c, s in zip(ids, seeds, strict=True)}
    clients = {c: SecAggClient(config, c, rand_bytes=rand_bytes) for c in ids}
    server = SecAggServer(config)
    up: dict[Stage, int] = dict.fromkeys(STAGES, 0)
    down: dict[Stage, int] = dict.fromkeys(STAGES, 0)
    timings: dict[str, float] = {f"{s}.{who}": 0.0 for s in STAGES for who in ("clients", "server")} | {"codec": 0.0}

    def wire(message: _M, stage: Stage, counts: dict[Stage, int]) -> _M:
        start = time.perf_counter()
        blob = pack(message)
        parsed = unpack(blob)
        timings["codec"] += time.perf_counter() - start
        counts[stage] += len(blob)
        assert isinstance(parsed, type(message))
        if on_message is not None:
            on_message(parsed, stage, "up" if counts is up else "down", len(blob))
        return parsed

    def present(c: ClientId, stage: Stage) -> bool:
        return c not in drops or STAGES.index(drops[c]) > STAGES.index(stage)

    def timed(key: str) -> _Timer:
        return _Timer(timings, key)

    def deliver(stage: Stage, messages: Mapping[ClientId, SecAggMessage]) -> list[SecAggMessage]:
        """The in-process network: each message down to its client, each answer of a present client back up."""
        answers: list[SecAggMessage] = []
        for c, sent in messages.items():
            sent = wire(sent, stage, down)
            if present(c, stage):
                with timed(f"{stage}.clients"):
                    answer = _answer(clients[c], sent, vectors[c], rounding[c])
                answers.append(wire(answer, stage, up))
        return answers

    advertised: list[SecAggMessage] = []
    for c in ids:
        if present(c, "advertise"):
            with timed("advertise.clients"):
                msg = clients[c].advertise()
            advertised.append(wire(msg, "advertise", up))
    result = serve_round(server, advertised, deliver, timings=timings)

    return RoundResult(
        sum_ring=result.sum_ring,
        decoded_sum=result.decoded_sum,
        survivors=result.survivors,
        dropped=result.dropped,
        config=config,
        bytes_per_stage_up=up,
        bytes_per_stage_down=down,
        timings=timings,
    )


Deliver = Callable[[Stage, Mapping["ClientId", SecAggMessage]], Iterable[SecAggMessage]]
"""How a stage's messages reach the clients: given the stage and one message per client, sends them and returns the
clients' answers that came back in time (in any order; a transport may return fewer, and anything it parsed)."""

Refused = Callable[[SecAggMessage, SecAggError], None]
"""Told of each answer the server refused (a ProtocolViolation: a message out of order, of another round, a changed
repeat), which a transport reports as that client's fault."""


def serve_round(
    server: SecAggServer,
    advertised: Iterable[SecAggMessage],
    deliver: Deliver,
    *,
    timings: dict[str, float] | None = None,
    refused: Refused | None = None,
) -> AggregateResult:
    """The server's side of a whole round, whatever carries the messages: take the ``advertised`` keys, then per
    stage hand the server's messages to ``deliver`` and feed the answers back; the unmasked result at the end.

    Answers of the wrong kind for the stage are refused, as are those the server rejects; with ``refused`` each is
    reported there and the round goes on without it, without it each raises (in process, a refusal is a bug).
    ``timings`` gets the server's seconds per stage ("<stage>.server"). Raises RoundAbandoned when too few remain.
    """
    clock: dict[str, float] = timings if timings is not None else {}

    def feed(stage: Stage, answers: Iterable[SecAggMessage], kind: type[_M], take: Callable[[_M], bool]) -> None:
        for answer in answers:
            with _Timer(clock, f"{stage}.server"):
                try:
                    if not isinstance(answer, kind):
                        raise ProtocolViolation(
                            f"{answer.client} answered stage {stage!r} with a {answer.KIND} message"
                        )
                    take(answer)
                except (ProtocolViolation, MessageError) as exc:
                    if refused is None:
                        raise
                    refused(answer, exc)

    feed("advertise", advertised, AdvertiseKeys, server.receive_advertise)
    with _Timer(clock, "advertise.server"):
        keys = server.close_advertise()
    feed("share", deliver("share", keys), EncryptedShares, server.receive_shares)
    with _Timer(clock, "share.server"):
        deliveries = server.close_share()
    feed("upload", deliver("upload", deliveries), MaskedInput, server.receive_masked)
    with _Timer(clock, "upload.server"):
        requests = server.close_upload()
    feed("unmask", deliver("unmask", requests), UnmaskShares, server.receive_unmask)
    with _Timer(clock, "unmask.server"):
        return server.close_unmask()


def _answer(
    client: SecAggClient, message: SecAggMessage, vector: npt.ArrayLike, rng: np.random.Generator
) -> SecAggMessage:
    """What an in-process client answers to the server's message of a stage."""
    if isinstance(message, NeighbourKeys):
        return client.share_keys(message)
    if isinstance(message, ShareDelivery):
        return client.masked_input(message, vector, rng=rng)
    if isinstance(message, UnmaskRequest):
        return client.unmask(message)
    raise ProtocolViolation(f"a client does not answer a {message.KIND} message")


class _Timer:
    """Adds the seconds a ``with`` block takes to ``timings[key]``."""

    def __init__(self, timings: dict[str, float], key: str) -> None:
        self._timings, self._key, self._start = timings, key, 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._timings[self._key] = self._timings.get(self._key, 0.0) + time.perf_counter() - self._start
