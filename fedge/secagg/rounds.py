"""What the server's side of a secure round fixes besides the protocol itself, shared by the secure-aggregation and
DP-FedAvg strategies (:mod:`fedge.algorithms.secure_aggregation`, :mod:`fedge.algorithms.differential_privacy`): the
ring, the public graph seed and the rounding stream of a round (derived from the run's seed), the simulator's dropouts,
the ledger entries of the protocol's messages and why a client is not in the sum."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np

from fedge.accounting.ledger import Direction, LedgerEntry
from fedge.accounting.records import Drop
from fedge.secagg.config import RoundConfig
from fedge.secagg.messages import MaskedInput, SecAggMessage
from fedge.secagg.protocol import Stage
from fedge.types import ClientId

RING_BITS = 32
"""The ring of every round: uint32, so a masked upload is as large as a float32 one."""

DROPOUT_STAGES: tuple[Stage, ...] = ("share", "upload", "unmask")
"""Where ``simulate_dropouts`` makes a client vanish: after advertising its keys, after sharing them (before it
uploads), or after uploading (it never answers the unmask request, and is in the sum)."""

SUM_CLIENT = "secagg-sum"
"""The client id of the one reply the inner strategy aggregates: the survivors' mean, not any client's update."""

_ROUNDING, _DROPOUTS = 0x5EC0, 0x5EC1  # SeedSequence words: which per-round stream
_VANISHED = {
    "share": "vanished after advertising its keys",
    "upload": "vanished after sharing its keys, before uploading",
}  # the stages at which a vanishing client leaves the sum


def rounding_rng(seed: int, rnd: int) -> np.random.Generator:
    """The generator :func:`fedge.secagg.run_round` draws round ``rnd``'s stochastic rounding from (one child seed
    per client of the cohort, in id order)."""
    return np.random.default_rng(np.random.SeedSequence([_ROUNDING, seed & 0xFFFFFFFFFFFFFFFF, rnd]))


def graph_seed(seed: int, rnd: int) -> bytes:
    """Round ``rnd``'s public neighbour-graph seed. Public by design (it travels in the clear), derived from the
    run's seed so that who the protocol prunes, and so the model, is reproducible."""
    return hashlib.sha256(f"fedge-secagg-graph:{seed}:{rnd}".encode()).digest()


def simulated_dropouts(cohort: Sequence[ClientId], fraction: float, seed: int, rnd: int) -> dict[ClientId, Stage]:
    """``round(fraction * len(cohort))`` clients of the cohort, each with the stage at which it vanishes, drawn
    uniformly from :data:`DROPOUT_STAGES` by a generator seeded from (seed, round)."""
    count = round(fraction * len(cohort))
    if count == 0:
        return {}
    gen = np.random.default_rng(np.random.SeedSequence([_DROPOUTS, seed & 0xFFFFFFFFFFFFFFFF, rnd]))
    chosen = gen.choice(sorted(cohort), size=count, replace=False)
    stages = gen.integers(0, len(DROPOUT_STAGES), size=count)
    return {str(c): DROPOUT_STAGES[int(s)] for c, s in zip(chosen, stages, strict=True)}


class ProtocolLedger:
    """The ledger entries of one round's protocol messages, as :func:`fedge.secagg.run_round` sends them (its
    ``on_message``). The client's update message, 4 bytes a value (uint32 or float32), stands for the masked upload's
    first ``reply_bytes``; what a masked upload holds beyond them (a part that sums a tensor a second time, FedDyn's
    drift; DP-FedAvg's count value) gets an entry of its own, kind ``secagg.masked-input``, of those extra bytes."""

    def __init__(self, rnd: int, reply_bytes: int) -> None:
        self.round = rnd
        self.reply_bytes = reply_bytes  # of the reply's float32 tensors the masked vector holds: the reply counts them
        self.entries: list[LedgerEntry] = []
        self.upload_tensor_bytes = 0  # of one masked upload

    def __call__(self, message: SecAggMessage, stage: Stage, direction: Direction, size: int) -> None:
        tensor_bytes = sum(int(a.nbytes) for a in message.to_fields()[0].values())
        if isinstance(message, MaskedInput):
            self.upload_tensor_bytes = tensor_bytes
            extra = tensor_bytes - self.reply_bytes
            if extra > 0:
                self.entries.append(LedgerEntry(self.round, direction, message.client, message.KIND, 1, extra, extra))
            return
        self.entries.append(LedgerEntry(self.round, direction, message.client, message.KIND, 1, tensor_bytes, size))


def simulated_drops(
    gone: Sequence[ClientId], drop_at: Mapping[ClientId, Stage], config: RoundConfig
) -> tuple[Drop, ...]:
    """Why each client that replied is not in the round's sum: it vanished (simulated), or the protocol left it out
    with too few neighbours to recover its secrets."""
    why = {**_VANISHED, "unmask": "vanished while unmasking"}
    return tuple(
        Drop(c, f"secure aggregation: {why[drop_at[c]]} (simulated)")
        if c in drop_at
        else Drop(c, f"secure aggregation: left out, fewer than t = {config.threshold} of its neighbours took part")
        for c in gone
    )


def remote_drops(gone: Sequence[ClientId], why: Mapping[ClientId, str], config: RoundConfig) -> tuple[Drop, ...]:
    """Why each client that replied is not in the round's sum: it stopped answering at some stage (the transport
    says how), or the protocol left it out with too few neighbours to recover its secrets."""
    return tuple(
        Drop(c, f"secure aggregation: {why[c]}")
        if c in why
        else Drop(c, f"secure aggregation: left out, fewer than t = {config.threshold} of its neighbours took part")
        for c in gone
    )
