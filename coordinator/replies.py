"""The one policy that judges what a client sends in a round, for every transport.

:func:`judge_reply` takes the raw bytes a client sent and decides: accept the update, or reject it with a category and
a reason. A message that travels in chunks (:mod:`fedge.wire.chunking`) meets :func:`judge_chunk` at each chunk, before
any memory is spent on reassembling it, and :func:`judge_reply` once it is whole. Everything a peer controls is
checked here or in the strategy's :meth:`~fedge.algorithms.base.Strategy.check_reply` (which it calls), and every
exception that decoding or checking hostile bytes can raise is caught here and becomes a rejection, so no message can
crash the coordinator. Reasons quote a peer's text only after
:func:`fedge.wire.fields.printable` made it short and free of control characters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.transport import Exchange, ReplyCheck
from fedge.accounting.ledger import LedgerEntry, uncompressed_bytes
from fedge.accounting.records import ClientTiming, Drop, Rejection
from fedge.algorithms.base import CheckedReply
from fedge.errors import CodecError, FedgeError
from fedge.types import ClientId
from fedge.wire.chunking import ChunkHeader, parse_header
from fedge.wire.fields import printable
from fedge.wire.message import Message, decode
from fedge.wire.protocol import ERROR, SESSION
from fedge_io.log_budget import LogBudget

log = logging.getLogger(__name__)

CATEGORIES = (
    "unparseable",  # not a fedge message
    "unknown client",  # never said hello / not part of this run
    "wrong sender",  # published on one client's topic, names another
    "late",  # for an earlier round
    "wrong round",  # for a later round
    "not sampled",  # no task this round
    "duplicate",  # already answered this round
    "client failed",  # the client reported that it could not do its task
    "invalid",  # the strategy's rules: kind, run, tensors, shapes, dtypes, non-finite values, bounded numbers
    "oversize",  # larger than the largest legitimate message of the run, or than its reassembly budget: dropped unread
)


@dataclass
class RoundContext:
    """What judging a reply of round ``rnd`` needs to know."""

    rnd: int
    sampled: frozenset[ClientId]
    check: ReplyCheck
    known: Callable[[ClientId], bool] = lambda client: True
    declared: Callable[[ClientId], int | None] = lambda client: None  # samples it declared when admitted
    max_payload: int = 0  # bytes; 0: no limit beyond the codec's
    session: str = ""  # the coordinator's session: a reply naming another answers a task of a dead coordinator
    replied: set[ClientId] = field(default_factory=set)
    failed: dict[ClientId, str] = field(default_factory=dict)  # client -> the error it reported
    log_budget: LogBudget = field(default_factory=lambda: LogBudget(log))  # a flooding client's lines are capped


@dataclass(frozen=True)
class Judgement:
    """The decoded message (if it decoded) and, for a refused one, why."""

    message: Message | None  # as it arrived (counted in the ledger)
    rejection: Rejection | None
    checked: CheckedReply | None = None  # accepted: its report and update, as the strategy aggregates them

    @property
    def accepted(self) -> bool:
        return self.rejection is None


def judge_reply(payload: bytes, sender: ClientId, ctx: RoundContext) -> Judgement:
    """Accept or reject ``payload``, received from ``sender`` (the topic's client, or the in-process caller).

    On acceptance the sender is added to ``ctx.replied``; a reported failure is added to ``ctx.failed``.
    """
    if ctx.max_payload and len(payload) > ctx.max_payload:
        detail = f"{len(payload):,} bytes, the largest legitimate message of this run is {ctx.max_payload:,}"
        return Judgement(None, reject(ctx, sender, "oversize", detail))
    try:
        msg = decode(payload, check_finite=False)  # non-finite values are judged with the tensors' rules
    except Exception as exc:  # any defect of hostile bytes, whatever the library raised
        return Judgement(None, reject(ctx, sender, "unparseable", exc))
    try:
        verdict = _judge(msg, sender, ctx)
    except Exception as exc:  # the strategy's rules met something they did not expect: still a rejection
        if not isinstance(exc, FedgeError | ValueError | KeyError | TypeError):
            log.error("round %d: unexpected %s while checking a reply of %s", ctx.rnd, type(exc).__name__, sender)
        verdict = (
            "invalid",
            printable(f"{type(exc).__name__}: {exc}" if not isinstance(exc, FedgeError) else str(exc)),
        )
    if isinstance(verdict, CheckedReply):
        ctx.replied.add(sender)
        return Judgement(msg, None, verdict)
    return Judgement(msg, reject(ctx, sender, *verdict))


def judge_chunk(chunk: bytes, sender: ClientId, ctx: RoundContext) -> tuple[ChunkHeader | None, tuple[str, str] | None]:
    """The chunk's header, and (category, reason) when the message it belongs to must be refused unread.

    The checks a whole reply meets first that need no payload: a well-formed header, a known and sampled sender that
    has not answered yet, and a declared size within the run's largest legitimate update (``oversize`` before a byte
    of it is held). The caller records the refusal with :func:`reject`, once per message.
    """
    try:
        header = parse_header(chunk)
    except CodecError as exc:
        return None, ("unparseable", f"chunk: {exc}")
    who = printable(sender, 40)
    if not ctx.known(sender):
        return header, ("unknown client", f"{who!r} is not a client of this run")
    if sender not in ctx.sampled:
        return header, ("not sampled", f"{who!r} has no task in round {ctx.rnd}")
    if sender in ctx.replied or sender in ctx.failed:
        return header, ("duplicate", f"{who!r} already answered round {ctx.rnd}")
    if ctx.max_payload and header.total > ctx.max_payload:
        detail = f"a chunked message of {header.total:,} bytes, the largest legitimate message is {ctx.max_payload:,}"
        return header, ("oversize", detail)
    return header, None


def _judge(msg: Message, sender: ClientId, ctx: RoundContext) -> tuple[str, str] | CheckedReply:
    """(category, reason) of a refusal, or the strategy's acceptance."""
    rnd = ctx.rnd
    if not ctx.known(sender):
        return "unknown client", f"{printable(sender, 40)!r} is not a client of this run"
    if msg.client != sender:
        return "wrong sender", f"sent by {sender!r} but names client {printable(msg.client, 40)!r}"
    if msg.round < rnd:
        return "late", f"a reply for round {msg.round} arrived in round {rnd}"
    if msg.round > rnd:
        return "wrong round", f"round {msg.round}, the current round is {rnd}"
    if ctx.session:  # a transport with sessions: every reply names the one it answers, or it is refused
        answered = msg.transport.get(SESSION)
        if answered is None:
            return "invalid", f"a reply to round {msg.round} without the session it answers"
        if answered != ctx.session:
            return "late", f"a reply to round {msg.round} of an earlier coordinator session, not of this one"
    if sender not in ctx.sampled:
        return "not sampled", f"{sender!r} has no task in round {rnd}"
    if sender in ctx.replied:
        return "duplicate", f"{sender!r} already replied in round {rnd}"
    if sender in ctx.failed:
        return "duplicate", f"{sender!r} already failed or was dropped in round {rnd}"
    if msg.kind == ERROR:
        error = printable(msg.params.get("error", "?"))
        ctx.failed[sender] = f"client failed: {error}"
        return "client failed", error
    accepted = ctx.check(sender, msg)  # kind, run, tensors, shapes, dtypes, finiteness, bounded numbers
    report = accepted.report
    declared = ctx.declared(sender)
    # The self-reported data size is an averaging weight: never trusted beyond what the client declared when admitted.
    if declared is not None and report.num_examples > declared:
        return "invalid", f"num_examples {report.num_examples} exceeds the {declared} samples {sender!r} declared"
    return accepted


def reject(ctx: RoundContext, sender: ClientId, category: str, detail: object) -> Rejection:
    """A logged rejection of ``sender``'s message, its peer-controlled text made printable."""
    text = printable(str(detail))
    who = printable(sender, 40)
    ctx.log_budget.warn(who, "round %d: rejected a message from %s: %s: %s", ctx.rnd, who, category, text)
    return Rejection(printable(sender, 64), category, text)


def file_reply(
    out: Exchange,
    rnd: int,
    client: ClientId,
    judged: Judgement,
    timing: ClientTiming,
    *,
    payload_bytes: int,
    wire_bytes: int = 0,
    final: bool = True,
) -> None:
    """Count a whole reply in the round's ledger and file it in ``out``: accepted (its checked report and update, and
    ``timing``), or refused with its reason. Every transport files a judged reply here.

    ``payload_bytes``: what the sender published (all chunks of a chunked message); ``wire_bytes``: the packets that
    carried it (0 without a broker). ``final``: no other reply can come from this client this round (in-process and
    executor transports), so a refusal drops it now; over a broker a refused client may still send a valid reply
    before the deadline, and the end of the round decides its drop.
    """
    message = judged.message
    kind = message.kind if message is not None else "invalid"
    tensor_bytes = message.tensor_bytes if message is not None else 0
    raw = uncompressed_bytes(message) if message is not None else 0
    out.entries.append(LedgerEntry(rnd, "up", client, kind, 1, tensor_bytes, payload_bytes, wire_bytes, raw))
    if judged.checked is not None:
        out.replies[client] = judged.checked
        out.timings.append(timing)
        return
    assert judged.rejection is not None
    out.rejections.append(judged.rejection)
    if final:
        out.drops.append(Drop(client, judged.rejection.reason))
