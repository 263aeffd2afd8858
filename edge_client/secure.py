"""Secure aggregation on the device: this client's own party of each round (:class:`fedge.secagg.remote.ClientParty`).

When a round's broadcast announces secure aggregation (:func:`fedge.secagg.remote.round_config_of`), the client's
update never leaves the device: the reply carries its report and fresh public keys instead, and the party answers the
coordinator's stage messages (neighbour keys, share delivery, unmask request) that follow on the task topic. Under
DP-FedAvg it also adds its share of the round's noise (:mod:`fedge.privacy.shares`). Its private keys, self-mask
seed, clipped update, noise and masks live here only, in memory, for the round in flight; a new
coordinator session (a restarted coordinator restarts the round) or a newer round discards them, and the next round
draws new ones.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from fedge.errors import CodecError
from fedge.privacy.mechanism import noise_rng
from fedge.privacy.shares import NoiseFloor, client_input, share_of
from fedge.secagg.errors import SecAggError
from fedge.secagg.messages import ShareDelivery
from fedge.secagg.parts import PartLayout, parse_parts
from fedge.secagg.remote import (
    SEED_PARAM,
    STAGE_OF_KIND,
    ClientParty,
    from_message,
    layout_of,
    round_config_of,
    to_message,
    weight_of,
)
from fedge.secagg.shamir import RandBytes
from fedge.tensors import l2_norm
from fedge.types import ClientId
from fedge.wire.fields import printable
from fedge.wire.message import UPDATE, Message
from fedge.wire.protocol import SESSION

log = logging.getLogger(__name__)


class SecureRounds:
    """The party of the round in flight, keyed by (coordinator session, round)."""

    def __init__(
        self, client: ClientId, *, rand_bytes: RandBytes = os.urandom, noise_floor: NoiseFloor | None = None
    ) -> None:
        """``noise_floor``: the least DP noise this client adds, from the run config it was provisioned with (None:
        no DP run, or no config to say; the broadcast's noise is then taken as asked)."""
        self.client = client
        self._rand = rand_bytes
        self.noise_floor = noise_floor
        self._current: tuple[str, int, ClientParty] | None = None

    def forget(self) -> None:
        """Drop the party in flight (its coordinator session is over)."""
        self._current = None

    def reply(self, task: Message, broadcast: Message | None, update: Message) -> Message | None:
        """For a round under secure aggregation: the reply that stands for ``update`` (its report and this client's
        fresh public keys), with the party kept for the stages to come; None for a round without it. CodecError
        when the round's parameters do not fit this client's update."""
        # The parameters ride in the broadcast, or in the task of a round without one (DS-FL's first).
        source = broadcast if broadcast is not None and SEED_PARAM in broadcast.params else task
        try:
            config = round_config_of(source)
        except SecAggError as exc:
            raise CodecError(f"the round's secure-aggregation parameters are malformed: {exc}") from None
        if config is None:
            return None
        reference = broadcast.tensors if broadcast is not None else {}
        if config.round != task.round or config.run != task.run:
            raise CodecError(f"the secure-aggregation parameters are of round {config.round}, the task of {task.round}")
        if self.client not in config.index:
            raise CodecError(f"the secure-aggregation round's cohort does not include {self.client}")
        try:
            parts = parse_parts(layout_of(source), source.params)  # the model's move, and SCAFFOLD's or FedDyn's
        except SecAggError as exc:
            raise CodecError(str(exc)) from None
        names = [n for p in parts for n in p.tensors]
        relative = [n for p in parts if p.relative for n in p.tensors]
        missing = [n for n in names if n not in update.tensors] + [n for n in relative if n not in reference]
        if missing:
            raise CodecError(f"the secure-aggregation layout names tensors this model does not exchange: {missing[:3]}")
        odd = [n for n in relative if reference[n].shape != update.tensors[n].shape]
        if odd or any(update.tensors[n].dtype != torch.float32 for n in names):
            raise CodecError(f"secure aggregation sums float32 tensors of the broadcast's shapes; {odd[:3]} differ")
        try:
            layout = PartLayout(parts, {n: (tuple(update.tensors[n].shape), update.tensors[n].dtype) for n in names})
        except SecAggError as exc:
            raise CodecError(str(exc)) from None
        new, moved_from = layout.flatten(update.tensors), layout.reference(reference)  # (dim,) each
        if not (math.isfinite(float(new.sum())) and math.isfinite(float(moved_from.sum()))):
            raise CodecError("the update or the broadcast holds non-finite values: nothing to aggregate securely")
        share = share_of(source.params)  # DP-FedAvg: the client adds its share of the noise, unweighted
        if self.noise_floor is not None:  # never less noise than the run this client joined states
            self.noise_floor.check(share, len(config.index))
        if share is not None:
            if any(p.value_bound is not None for p in parts):
                raise CodecError("DP-FedAvg clips a contribution in L2 norm; this round announces a per-value part")
            # every part at once (SCAFFOLD: [y - x, delta_c]): one clip bounds all this client adds to the sums
            vector = client_input(new, moved_from, share, noise_rng(None, task.round))  # (dim + 1,)
            clipped = l2_norm(new - moved_from) > share.clip
        else:  # each part clipped to the bound on its own; the weighted parts get the share with the delivery
            vector, parts_clipped = layout.vector(update.tensors, reference, config.plan.bound)  # (dim,)
            clipped = parts_clipped > 0
        try:
            party = ClientParty(
                config,
                self.client,
                vector,
                weighted=share is None,
                rand_bytes=self._rand,
                shared=None if share is not None else layout.weighted,
            )
        except SecAggError as exc:
            raise CodecError(str(exc)) from None
        if clipped:
            log.info(
                "round %d: secure aggregation: update clipped to L2 norm %g before %smasking",
                task.round,
                share.clip if share is not None else config.plan.bound,
                "noising and " if share is not None else "",
            )
        self._current = (task.transport.get(SESSION, ""), task.round, party)
        keys = party.advertise()
        return to_message(keys, run=task.run, kind=UPDATE, params=update.params)

    def answer(self, frame: Message) -> Message | None:
        """The answer to a stage message of the round in flight; None (with the reason logged) for a message of
        another session or round, one that does not parse, or one the protocol refuses to answer."""
        session = frame.transport.get(SESSION, "")
        current = self._current
        if current is None or current[:2] != (session, frame.round):
            log.warning(
                "round %d: ignoring a secure-aggregation message of a round this client is not in (session %s)",
                frame.round,
                printable(session, 40),
            )
            return None
        party = current[2]
        try:
            message = from_message(frame)
            weight = weight_of(frame) if isinstance(message, ShareDelivery) else None
            answer = party.answer(message, weight)
        except SecAggError as exc:
            log.error("round %d: secure aggregation: refusing to answer: %s", frame.round, printable(str(exc), 300))
            return None
        if STAGE_OF_KIND.get(message.KIND) == "unmask":
            self._current = None  # the round is over for this client: its secrets go
        log.info("round %d: secure aggregation: answered the %s", frame.round, message.KIND)
        return to_message(answer, run=frame.run)


def stage_of(frame: Message) -> str:
    """The stage a coordinator's stage message opens ("" when it names none we know)."""
    return STAGE_OF_KIND.get(frame.params.get("secagg.kind", ""), "")
