"""One SecAgg+ round as two pure state machines: :class:`SecAggClient` and :class:`SecAggServer`.

The protocol is Bonawitz et al. 2017 (CCS, Figure 4: rounds 0 AdvertiseKeys, 1 ShareKeys, 2 MaskedInputCollection,
4 Unmasking; the optional consistency check, round 3, is for a malicious server and is not done here) with SecAgg+'s
change (Bell et al. 2020, CCS, Section 3): each client shares its secrets with, and masks against, only its
neighbours in a sparse graph of degree k = O(log N), with threshold t. Client u uploads

    y_u = x_u + PRG(b_u) + sum_{v in N(u), v in U2} sign(u, v) PRG(s_uv)    (mod 2^ring_bits)

with sign(u, v) = +1 if u < v else -1, so pairwise masks of two surviving neighbours cancel in the sum. The server
removes PRG(b_u) for every survivor from t shares of b_u, and for each neighbour v that dropped after sharing keys,
rebuilds s_sk_v from t shares and removes its pairwise masks. No client ever reveals both the b-share and the
s-share of one peer, so the server never learns both masks of anyone.

No I/O, threads or clocks here: a transport feeds messages in and sends the ones that come out; deadlines are the
caller's: a stage ends when the caller calls ``close_*`` with whoever has answered. Stages, named as in
``drop_at`` of :func:`fedge.secagg.run_round`: "advertise" (stage 0), "share" (1), "upload" (2), "unmask" (3).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NoReturn, TypeAlias, TypeVar

import numpy as np
import numpy.typing as npt

from fedge.secagg.config import RoundConfig
from fedge.secagg.encoding import RingPlan, RingVector, decode, encode
from fedge.secagg.errors import (
    EncodingError,
    ProtocolViolation,
    ReconstructionError,
    RoundAbandoned,
    SecAggConfigError,
    ShareError,
)
from fedge.secagg.keys import KeyPair, derive_key, generate_keypair, open_sealed, public_key_of, seal
from fedge.secagg.masks import apply_mask
from fedge.secagg.messages import (
    AdvertiseKeys,
    EncryptedShares,
    MaskedInput,
    NeighbourKeys,
    SecAggMessage,
    ShareDelivery,
    UnmaskRequest,
    UnmaskShares,
)
from fedge.secagg.shamir import SHARE_BYTES, RandBytes, Share, combine, share_value_to_bytes, split

if TYPE_CHECKING:
    from fedge.types import ClientId  # annotations only: fedge.types imports torch

Stage: TypeAlias = Literal["advertise", "share", "upload", "unmask"]
STAGES: tuple[Stage, ...] = ("advertise", "share", "upload", "unmask")
"""The stages in order; a stage is named by what clients send in it."""

_M = TypeVar("_M", bound=SecAggMessage)


def _sign_subtracts(u: ClientId, v: ClientId) -> bool:
    """Whether u subtracts PRG(s_uv) (u > v) rather than adds it (u < v)."""
    return u > v


class SecAggClient:
    """One client's side of a round. Call :meth:`advertise`, :meth:`share_keys`, :meth:`masked_input` once each,
    in order, then :meth:`unmask` (which may be asked again, but never to reveal both secrets of one peer)."""

    def __init__(self, config: RoundConfig, client: ClientId, *, rand_bytes: RandBytes = os.urandom) -> None:
        if client not in config.index:
            raise SecAggConfigError(f"client {client!r} is not in this round's cohort")
        self.config = config
        self.client = client
        self._rand = rand_bytes
        self._neighbours = frozenset(config.graph[client])
        self._done = 0  # stages completed
        self._c: KeyPair | None = None  # share encryption
        self._s: KeyPair | None = None  # mask agreement
        self._b = b""  # the self-mask seed, drawn in stage 1
        self._peer_s_public: dict[ClientId, bytes] = {}
        self._box_keys: dict[ClientId, bytes] = {}  # share-encryption key with each peer
        self._mask_peers: tuple[ClientId, ...] = ()  # neighbours in U2: the ones masked against
        self._held: dict[ClientId, tuple[bytes, bytes]] = {}  # peer -> (its b-share, its s_sk-share) held here
        self._revealed: dict[ClientId, Literal["b", "s"]] = {}

    def advertise(self) -> AdvertiseKeys:
        """Stage 0: two fresh X25519 key pairs; their public halves."""
        self._expect(0)
        self._c, self._s = generate_keypair(self._rand), generate_keypair(self._rand)
        self._done = 1
        return AdvertiseKeys(self.config.round, self.client, self._c.public, self._s.public)

    def share_keys(self, keys: NeighbourKeys) -> EncryptedShares:
        """Stage 1: draw the self-mask seed b, Shamir-share b and s_sk among the neighbours in ``keys`` (t of
        them recover each), and seal each neighbour's pair of shares for it."""
        self._addressed(keys)
        self._expect(1)
        assert self._c is not None and self._s is not None
        cfg, t = self.config, self.config.threshold
        foreign = set(keys.peers) - self._neighbours
        if foreign:
            raise ProtocolViolation(
                f"the server sent keys of {sorted(foreign)[:5]}, who are not neighbours of {self.client}"
            )
        if len(keys.peers) < t:
            raise ProtocolViolation(f"{self.client} has {len(keys.peers)} neighbours with keys, fewer than t = {t}")
        for v, c_pub, s_pub in zip(keys.peers, keys.c_publics, keys.s_publics, strict=True):
            pair = (self.client, v)
            self._box_keys[v] = derive_key(
                self._c.private, c_pub, context=cfg.context, pair=pair, purpose="share-encryption"
            )
            self._peer_s_public[v] = s_pub
        b = self._rand(32)
        xs = [cfg.x_of(v) for v in keys.peers]
        b_shares = split(b, t, xs, rand_bytes=self._rand)
        s_shares = split(self._s.private, t, xs, rand_bytes=self._rand)
        self._b = b
        bundles = tuple(
            seal(
                self._box_keys[v],
                share_value_to_bytes(bs) + share_value_to_bytes(ss),
                context=cfg.context,
                sender=self.client,
                recipient=v,
                rand_bytes=self._rand,
            )
            for v, bs, ss in zip(keys.peers, b_shares, s_shares, strict=True)
        )
        self._done = 2
        return EncryptedShares(cfg.round, self.client, keys.peers, bundles)

    def masked_input(
        self, delivery: ShareDelivery, vector: npt.ArrayLike, *, rng: np.random.Generator | None = None
    ) -> MaskedInput:
        """Stage 2: open the bundles addressed here (DecryptionError if any was tampered with), encode ``vector``
        into the ring and add the self mask and one pairwise mask per neighbour in ``delivery.senders``.

        Called once: a second masked upload of the same masks would let the server subtract the two.
        """
        self._addressed(delivery)
        if np.shape(vector) != (self.config.dim,):
            raise EncodingError(f"the vector has shape {np.shape(vector)}, the round sums vectors of {self.config.dim}")
        self._expect(2)
        assert self._s is not None
        cfg, t = self.config, self.config.threshold
        unknown = set(delivery.senders) - set(self._box_keys)
        if unknown:
            raise ProtocolViolation(f"bundles from {sorted(unknown)[:5]}, to whom {self.client} sent no shares")
        if len(delivery.senders) < t:
            raise ProtocolViolation(
                f"{self.client} got shares from {len(delivery.senders)} neighbours, fewer than t = {t}"
            )
        for v, sealed in zip(delivery.senders, delivery.bundles, strict=True):
            plain = open_sealed(self._box_keys[v], sealed, context=cfg.context, sender=v, recipient=self.client)
            self._held[v] = (plain[:SHARE_BYTES], plain[SHARE_BYTES:])
        self._mask_peers = delivery.senders
        y = encode(vector, cfg.plan, rng=rng)
        bits = cfg.plan.ring_bits
        apply_mask(y, self._b, bits)
        for v in delivery.senders:
            seed = derive_key(
                self._s.private, self._peer_s_public[v], context=cfg.context, pair=(self.client, v), purpose="mask"
            )
            apply_mask(y, seed, bits, subtract=_sign_subtracts(self.client, v))
        self._done = 3
        return MaskedInput(cfg.round, self.client, y)

    def unmask(self, request: UnmaskRequest) -> UnmaskShares:
        """Stage 3: the b-share of each surviving neighbour and the s_sk-share of each that dropped.

        ProtocolViolation, revealing nothing, when the request names a stranger, leaves fewer than t survivors, or
        would reveal the other share of a peer than one revealed before (in this or an earlier request).
        """
        self._addressed(request)
        if self._done < 3:
            raise ProtocolViolation(f"{self.client} was asked to unmask before it uploaded")
        t = self.config.threshold
        survivors = set(request.survivors)
        strangers = survivors - set(self._mask_peers)
        if strangers:
            raise ProtocolViolation(
                f"the unmask request names {sorted(strangers)[:5]}, not masked against by {self.client}"
            )
        if len(survivors) < t:
            raise ProtocolViolation(
                f"the unmask request leaves {len(survivors)} surviving neighbours of {self.client}, fewer than t = {t}"
            )
        wanted: dict[ClientId, Literal["b", "s"]] = {v: ("b" if v in survivors else "s") for v in self._mask_peers}
        both = sorted(v for v, kind in wanted.items() if self._revealed.get(v, kind) != kind)
        if both:
            raise ProtocolViolation(
                f"refusing to unmask: {self.client} already revealed the other share of {both[:5]}; revealing both "
                f"would expose their input"
            )
        self._revealed.update(wanted)
        self._done = 4
        b_owners = tuple(v for v in self._mask_peers if wanted[v] == "b")
        s_owners = tuple(v for v in self._mask_peers if wanted[v] == "s")
        return UnmaskShares(
            self.config.round,
            self.client,
            b_owners,
            tuple(self._held[v][0] for v in b_owners),
            s_owners,
            tuple(self._held[v][1] for v in s_owners),
        )

    def _expect(self, stage: int) -> None:
        if self._done != stage:
            raise ProtocolViolation(
                f"{self.client} cannot do stage {STAGES[stage]!r}: "
                + (f"it is at stage {STAGES[self._done]!r}" if self._done < stage else "it was done already")
            )

    def _addressed(self, message: SecAggMessage) -> None:
        if message.round != self.config.round or message.client != self.client:
            raise ProtocolViolation(
                f"a message for {message.client!r} in round {message.round} reached {self.client!r} in round "
                f"{self.config.round}"
            )


@dataclass(frozen=True, eq=False)
class AggregateResult:
    """What a finished round yields: the ring sum of the survivors' encoded vectors, and who they are."""

    sum_ring: RingVector  # (dim,) uint32: sum over U3 of encode(x_u), mod 2^ring_bits
    survivors: tuple[ClientId, ...]  # U3: whose vectors are in the sum (the caller averages by their weights)
    dropped: tuple[ClientId, ...]  # the rest of the cohort
    plan: RingPlan

    @property
    def decoded_sum(self) -> npt.NDArray[np.float64]:
        """The sum as real numbers (two's complement, divided by 2^frac_bits)."""
        return decode(self.sum_ring, self.plan)


class SecAggServer:
    """The server's side of a round: collect each stage's messages with ``receive_*`` (True if taken, False if
    ignored as late or repeated), then ``close_*`` the stage with whoever answered to get the next messages out.

    A ``close_*`` raises RoundAbandoned when too few clients remain to finish; the server then refuses everything.
    """

    def __init__(self, config: RoundConfig) -> None:
        self.config = config
        self._open = 0  # the stage open for messages; 4 when finished
        self._abandoned = False
        self._keys: dict[ClientId, AdvertiseKeys] = {}
        self._peers: dict[ClientId, tuple[ClientId, ...]] = {}  # N(u) in U1
        self._shares: dict[ClientId, dict[ClientId, bytes]] = {}  # sender -> recipient -> bundle
        self._share_msgs: dict[ClientId, EncryptedShares] = {}
        self._senders: dict[ClientId, tuple[ClientId, ...]] = {}  # N(u) in U2
        self._sum: RingVector = np.zeros(config.dim, dtype=np.uint32)
        self._uploads: dict[ClientId, bytes] = {}  # U3 so far: digest of each upload, to spot a changed repeat
        self._requests: dict[ClientId, UnmaskRequest] = {}
        self._needed_dropped: tuple[ClientId, ...] = ()
        self._replies: dict[ClientId, UnmaskShares] = {}

    @property
    def stage(self) -> Stage | None:
        """The stage open for messages; None once the round is finished or abandoned."""
        return None if self._abandoned or self._open >= len(STAGES) else STAGES[self._open]

    # --- stage 0: advertise -----------------------------------------------------------------------------------------

    def receive_advertise(self, message: AdvertiseKeys) -> bool:
        """Take a client's public keys."""
        if not self._accepts(message, 0, self.config.clients):
            return False
        return self._store(self._keys, message)

    def close_advertise(self) -> dict[ClientId, NeighbourKeys]:
        """End stage 0: U1 is who advertised, less anyone left with fewer than t advertised neighbours; each client
        of U1 gets its neighbours' public keys."""
        self._close(0)
        graph = self.config.graph
        u1 = self._prune(set(self._keys), lambda u: graph[u], stage="advertise")
        self._peers = {u: tuple(v for v in graph[u] if v in u1) for u in sorted(u1)}
        return {
            u: NeighbourKeys(
                self.config.round,
                u,
                peers,
                tuple(self._keys[v].c_public for v in peers),
                tuple(self._keys[v].s_public for v in peers),
            )
            for u, peers in self._peers.items()
        }

    # --- stage 1: share keys ----------------------------------------------------------------------------------------

    def receive_shares(self, message: EncryptedShares) -> bool:
        """Take a client's sealed share bundles, one for each of its U1 neighbours."""
        if not self._accepts(message, 1, self._peers):
            return False
        if message.recipients != self._peers[message.client]:
            raise ProtocolViolation(f"{message.client} sealed shares for other clients than its neighbours")
        return self._store(self._share_msgs, message)

    def close_share(self) -> dict[ClientId, ShareDelivery]:
        """End stage 1: U2 is who shared, less anyone left with fewer than t neighbours in U2 (its secrets could not
        be recovered); each client of U2 gets the bundles its U2 neighbours sealed for it."""
        self._close(1)
        u2 = self._prune(set(self._share_msgs), lambda u: self._peers[u], stage="share")
        self._shares = {
            u: dict(zip(m.recipients, m.bundles, strict=True)) for u, m in self._share_msgs.items() if u in u2
        }
        self._senders = {u: tuple(v for v in self._peers[u] if v in u2) for u in sorted(u2)}
        return {
            v: ShareDelivery(self.config.round, v, senders, tuple(self._shares[u][v] for u in senders))
            for v, senders in self._senders.items()
        }

    # --- stage 2: masked input --------------------------------------------------------------------------------------

    def receive_masked(self, message: MaskedInput) -> bool:
        """Take a client's masked vector (added to the running sum at once: the server keeps O(dim) memory)."""
        if not self._accepts(message, 2, self._senders):
            return False
        m = message.masked
        if m.shape[0] != self.config.dim:
            raise ProtocolViolation(
                f"{message.client} uploaded {m.shape[0]} coordinates, the round has {self.config.dim}"
            )
        if self.config.plan.ring_bits < 32 and int(m.max()) > self.config.plan.mask:
            raise ProtocolViolation(
                f"{message.client} uploaded values outside the {self.config.plan.ring_bits}-bit ring"
            )
        digest = hashlib.sha256(m.tobytes()).digest()
        if message.client in self._uploads:
            if self._uploads[message.client] != digest:
                raise ProtocolViolation(f"{message.client} uploaded two different masked vectors")
            return False
        self._uploads[message.client] = digest
        np.add(self._sum, m, out=self._sum)  # mod 2^32
        return True

    def close_upload(self) -> dict[ClientId, UnmaskRequest]:
        """End stage 2: U3 is who uploaded. Abandons the round when some mask could not be removed (a secret with
        fewer than t holders in U3); else each client of U3 is told which of its neighbours survived."""
        self._close(2)
        u3 = set(self._uploads)
        t = self.config.threshold
        if len(u3) < self.config.min_survivors:
            self._abandon(f"{len(u3)} clients uploaded, fewer than the minimum {self.config.min_survivors}", "upload")
        dropped = sorted({v for u in u3 for v in self._senders[u] if v not in u3})
        for owner in sorted(u3) + dropped:
            holders = sum(1 for w in self._senders[owner] if w in u3)
            if holders < t:
                self._abandon(f"{owner}'s masks need {t} shares, but only {holders} of its holders uploaded", "upload")
        self._needed_dropped = tuple(dropped)
        self._requests = {
            w: UnmaskRequest(self.config.round, w, tuple(v for v in self._senders[w] if v in u3)) for w in sorted(u3)
        }
        return dict(self._requests)

    # --- stage 3: unmask --------------------------------------------------------------------------------------------

    def receive_unmask(self, message: UnmaskShares) -> bool:
        """Take a client's shares: exactly the ones its unmask request asked for."""
        if not self._accepts(message, 3, self._requests):
            return False
        w = message.client
        survivors = self._requests[w].survivors
        expected_s = tuple(v for v in self._senders[w] if v not in self._uploads)
        if message.b_owners != survivors or message.s_owners != expected_s:
            raise ProtocolViolation(f"{w} answered the unmask request with shares of other clients than asked")
        return self._store(self._replies, message)

    def close_unmask(self) -> AggregateResult:
        """End stage 3: rebuild each survivor's self-mask seed and each dropped neighbour's masking key from t
        shares (ReconstructionError if a key does not match its advertised public key), remove their masks and
        return the sum of U3's encoded vectors."""
        self._close(3)
        cfg, bits = self.config, self.config.plan.ring_bits
        total = self._sum.copy()
        b_shares: dict[ClientId, list[Share]] = {}
        s_shares: dict[ClientId, list[Share]] = {}
        for w in sorted(self._replies):
            reply, x = self._replies[w], cfg.x_of(w)
            for owner, value in zip(reply.b_owners, reply.b_shares, strict=True):
                b_shares.setdefault(owner, []).append(Share(x, int.from_bytes(value, "big")))
            for owner, value in zip(reply.s_owners, reply.s_shares, strict=True):
                s_shares.setdefault(owner, []).append(Share(x, int.from_bytes(value, "big")))
        for u in sorted(self._uploads):
            b = self._reconstruct(u, b_shares.get(u, []), "self-mask seed")
            apply_mask(total, b, bits, subtract=True)
        for v in self._needed_dropped:
            s_sk = self._reconstruct(v, s_shares.get(v, []), "masking key")
            if public_key_of(s_sk) != self._keys[v].s_public:
                self._abandon(
                    f"{v}'s rebuilt masking key does not match its advertised public key: a share was tampered with",
                    "unmask",
                    ReconstructionError,
                )
            for u in self._senders[v]:
                if u in self._uploads:  # u masked against v: undo u's sign
                    seed = derive_key(s_sk, self._keys[u].s_public, context=cfg.context, pair=(u, v), purpose="mask")
                    apply_mask(total, seed, bits, subtract=not _sign_subtracts(u, v))
        total &= np.uint32(cfg.plan.mask)
        self._open = len(STAGES)
        survivors = tuple(sorted(self._uploads))
        dropped = tuple(c for c in cfg.clients if c not in self._uploads)
        return AggregateResult(sum_ring=total, survivors=survivors, dropped=dropped, plan=cfg.plan)

    # --- helpers ----------------------------------------------------------------------------------------------------

    def _reconstruct(self, owner: ClientId, shares: list[Share], what: str) -> bytes:
        t = self.config.threshold
        if len(shares) < t:
            self._abandon(f"{owner}'s {what} has {len(shares)} shares, {t} needed", "unmask")
        try:
            return combine(shares, t)
        except ShareError as exc:
            self._abandon(f"{owner}'s {what} cannot be rebuilt: {exc}", "unmask", ReconstructionError)

    def _prune(
        self, alive: set[ClientId], neighbours: Callable[[ClientId], Iterable[ClientId]], *, stage: Stage
    ) -> set[ClientId]:
        # Dropping a client can leave a neighbour short of t in turn: repeat until stable.
        t = self.config.threshold
        changed = True
        while changed:
            short = {u for u in alive if sum(1 for v in neighbours(u) if v in alive) < t}
            alive -= short
            changed = bool(short)
        if len(alive) < self.config.min_survivors:
            self._abandon(f"{len(alive)} clients remain, fewer than the minimum {self.config.min_survivors}", stage)
        return alive

    def _accepts(self, message: SecAggMessage, stage: int, allowed: Container[ClientId]) -> bool:
        if message.round != self.config.round:
            raise ProtocolViolation(f"a {message.KIND} message of round {message.round} in round {self.config.round}")
        if message.client not in self.config.index:
            raise ProtocolViolation(f"a {message.KIND} message from {message.client!r}, who is not in this round")
        if self._abandoned or self._open > stage:
            return False  # late: the stage was closed without it
        if self._open < stage:
            raise ProtocolViolation(f"a {message.KIND} message from {message.client} before its stage opened")
        return message.client in allowed  # else dropped earlier: ignored

    @staticmethod
    def _store(table: dict[ClientId, _M], message: _M) -> bool:
        previous = table.get(message.client)
        if previous is not None:
            if previous != message:
                raise ProtocolViolation(f"{message.client} sent two different {message.KIND} messages")
            return False
        table[message.client] = message
        return True

    def _close(self, stage: int) -> None:
        if self._abandoned:
            raise ProtocolViolation("the round was abandoned")
        if self._open != stage:
            raise ProtocolViolation(f"cannot close stage {STAGES[stage]!r}: the open stage is {self.stage!r}")
        self._open = stage + 1

    def _abandon(self, reason: str, stage: Stage, error: type[RoundAbandoned] = RoundAbandoned) -> NoReturn:
        self._abandoned = True
        raise error(reason, stage=stage)
