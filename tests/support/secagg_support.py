"""Secure-aggregation rounds in the test's process: seeded key material, and the clients' parties reached as over
MQTT (every protocol message encoded into fedge's frame and decoded again, what the broker carries), clients vanishing
at a chosen stage."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping

import numpy as np

from edge_client.secure import SecureRounds
from fedge.accounting.ledger import LedgerEntry
from fedge.secagg.config import RoundConfig
from fedge.secagg.messages import SecAggMessage
from fedge.secagg.protocol import STAGES, Stage
from fedge.secagg.remote import from_message, to_message
from fedge.wire.message import Message, decode, encode


def seeded_bytes(seed: int) -> Callable[[int], bytes]:
    """A deterministic stand-in for os.urandom (tests only; real rounds draw their keys from os.urandom)."""
    gen = np.random.default_rng(seed)
    return lambda n: gen.bytes(n)


def framed(message: Message) -> Message:
    """``message`` as the broker carries it: encoded into fedge's safetensors frame and decoded."""
    return decode(encode(message))


class FramedChannel(ABC):
    """A :class:`fedge.secagg.remote.StageChannel` whose clients answer in this process: each message to a client is
    framed (:func:`framed`); a client in ``drop_at`` answers nothing from that stage on (and its record says it
    vanished there). Each frame sent is a "down" entry of the record (a vanished client's too: it was sent); a
    subclass answers one frame."""

    def __init__(self, drop_at: Mapping[str, Stage], *, run: str) -> None:
        self.drop_at, self.run = drop_at, run
        self.entries: list[LedgerEntry] = []

    def stage(
        self,
        rnd: int,
        config: RoundConfig,
        stage: Stage,
        messages: Mapping[str, SecAggMessage],
        params: Mapping[str, Mapping[str, str]],
    ) -> list[SecAggMessage]:
        answers = []
        for c, message in messages.items():
            frame = framed(to_message(message, run=self.run, params=params.get(c, {})))
            self.entries.append(LedgerEntry(rnd, "down", c, message.KIND, 1, frame.tensor_bytes, len(encode(frame))))
            if c in self.drop_at and STAGES.index(self.drop_at[c]) <= STAGES.index(stage):
                continue
            answers.append(self.answer(rnd, stage, c, frame))
        return answers

    @abstractmethod
    def answer(self, rnd: int, stage: Stage, client: str, frame: Message) -> SecAggMessage:
        """``client``'s answer to ``frame``, as the server receives it."""

    def take_record(self, rnd: int) -> tuple[list[LedgerEntry], dict[str, str]]:
        entries, self.entries = self.entries, []
        return entries, {c: f"vanished at stage {s!r}" for c, s in self.drop_at.items()}


class DeviceChannel(FramedChannel):
    """Each client's device party (edge_client/secure.py's SecureRounds) reached through encoded frames, as over
    MQTT; ``drop_at[c]``: the stage from which c answers nothing."""

    def __init__(self, devices: dict[str, SecureRounds], drop_at: Mapping[str, Stage], *, run: str) -> None:
        super().__init__(drop_at, run=run)
        self.devices = devices

    def answer(self, rnd: int, stage: Stage, client: str, frame: Message) -> SecAggMessage:
        answer = self.devices[client].answer(frame)
        assert answer is not None
        up = framed(answer)
        self.entries.append(LedgerEntry(rnd, "up", client, up.kind, 1, up.tensor_bytes, len(encode(up))))
        return from_message(up)
