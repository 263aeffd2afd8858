"""The round's state machines stage by stage: exact sums with dropouts, tampering refused, the share-revealing rule
against a coordinator that asks for both, abandonment below threshold, messages out of order."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

import numpy as np
import pytest

from fedge.secagg.config import RoundConfig
from fedge.secagg.errors import (
    DecryptionError,
    EncodingError,
    ProtocolViolation,
    ReconstructionError,
    RoundAbandoned,
)
from fedge.secagg.messages import AdvertiseKeys, EncryptedShares, NeighbourKeys, UnmaskRequest, UnmaskShares
from fedge.secagg.protocol import SecAggClient, SecAggServer
from fedge.secagg.shamir import PRIME, SHARE_BYTES

Seeded = Callable[[int], Callable[[int], bytes]]
DIM = 8


class Round:
    """A cohort and its server, driven stage by stage by the test."""

    def __init__(self, seeded: Seeded, n: int = 6, **config: int) -> None:
        self.cfg = RoundConfig.new(
            run="run",
            session="s",
            round=1,
            clients=[f"c{i:02d}" for i in range(n)],
            round_seed=b"\x11" * 32,
            dim=DIM,
            bound=4.0,
            **config,  # type: ignore[arg-type]
        )
        rand = seeded(0)
        self.clients = {c: SecAggClient(self.cfg, c, rand_bytes=rand) for c in self.cfg.clients}
        self.server = SecAggServer(self.cfg)
        # On the fixed-point grid (multiples of 1/8), so stochastic rounding is exact and sums compare exactly.
        gen = np.random.default_rng(5)
        self.vectors = {c: gen.integers(-32, 32, DIM) / 8.0 for c in self.cfg.clients}

    def advertise(self, absent: Iterable[str] = ()) -> dict:
        for c in self.clients:
            if c not in absent:
                assert self.server.receive_advertise(self.clients[c].advertise())
        return self.server.close_advertise()

    def share(self, absent: Iterable[str] = ()) -> dict:
        for c, keys in self.advertise().items():
            if c not in absent:
                self.server.receive_shares(self.clients[c].share_keys(keys))
        return self.server.close_share()

    def upload(self, absent: Iterable[str] = ()) -> dict[str, UnmaskRequest]:
        for c, delivery in self.share().items():
            if c not in absent:
                self.server.receive_masked(self.clients[c].masked_input(delivery, self.vectors[c]))
        return self.server.close_upload()

    def replies(self, requests: dict[str, UnmaskRequest], absent: Iterable[str] = ()) -> dict[str, UnmaskShares]:
        return {c: self.clients[c].unmask(r) for c, r in requests.items() if c not in absent}


def test_exact_sum_with_dropouts_at_each_stage(seeded: Seeded) -> None:
    r = Round(seeded, n=8)  # complete graph: k = 7, t = 4
    requests = r.upload(absent={"c02", "c05"})  # vanish after sharing keys
    for reply in r.replies(requests, absent={"c07"}).values():  # c07 uploaded but never answers
        assert r.server.receive_unmask(reply)
    result = r.server.close_unmask()
    survivors = [c for c in r.cfg.clients if c not in ("c02", "c05")]
    assert result.survivors == tuple(survivors) and result.dropped == ("c02", "c05")
    np.testing.assert_array_equal(result.decoded_sum, sum(r.vectors[c] for c in survivors))


def test_masked_uploads_hide_the_inputs(seeded: Seeded) -> None:
    r = Round(seeded)
    deliveries = r.share()
    masked = r.clients["c00"].masked_input(deliveries["c00"], np.zeros(DIM)).masked
    assert np.count_nonzero(masked) == DIM and masked.std() > 2**28  # zeros went in; uniform-looking words came out


def test_a_tampered_ciphertext_is_refused(seeded: Seeded) -> None:
    r = Round(seeded)
    deliveries = r.share()
    d = deliveries["c01"]
    flipped = bytearray(d.bundles[0])
    flipped[40] ^= 0x80
    with pytest.raises(DecryptionError, match="c00"):
        r.clients["c01"].masked_input(replace(d, bundles=(bytes(flipped), *d.bundles[1:])), r.vectors["c01"])
    # A bundle relayed to the wrong recipient fails the same way: the sealed data names sender and recipient.
    other = deliveries["c02"]
    misrouted = replace(other, bundles=(deliveries["c03"].bundles[0], *other.bundles[1:]))
    with pytest.raises(DecryptionError):
        r.clients["c02"].masked_input(misrouted, r.vectors["c02"])


def test_a_tampered_key_share_is_refused(seeded: Seeded) -> None:
    r = Round(seeded)
    requests = r.upload(absent={"c03"})
    replies = r.replies(requests)
    for reply in replies.values():
        # Shift every holder's share of c03's masking key by one: it still interpolates to a 32-byte value (the
        # secret plus one), which only the check against c03's advertised public key can catch.
        shifted = tuple(
            (int.from_bytes(s, "big") + 1).to_bytes(SHARE_BYTES, "big") if owner == "c03" else s
            for owner, s in zip(reply.s_owners, reply.s_shares, strict=True)
        )
        assert r.server.receive_unmask(replace(reply, s_shares=shifted))
    with pytest.raises(ReconstructionError, match=r"c03.*public key"):
        r.server.close_unmask()
    assert r.server.stage is None


def test_a_garbled_self_mask_share_is_refused(seeded: Seeded) -> None:
    r = Round(seeded)
    requests = r.upload()
    garbled = int.from_bytes(seeded(9)(SHARE_BYTES), "big") % PRIME
    for reply in r.replies(requests).values():
        shares = tuple(
            garbled.to_bytes(SHARE_BYTES, "big") if owner == "c04" else s
            for owner, s in zip(reply.b_owners, reply.b_shares, strict=True)
        )
        r.server.receive_unmask(replace(reply, b_shares=shares))
    with pytest.raises(ReconstructionError, match="c04's self-mask seed"):
        r.server.close_unmask()


def test_never_both_shares_of_one_peer(seeded: Seeded) -> None:
    r = Round(seeded)
    requests = r.upload()
    client = r.clients["c00"]
    first = client.unmask(requests["c00"])
    assert "c03" in first.b_owners and first.s_owners == ()
    assert client.unmask(requests["c00"]) == first  # asking again for the same is harmless
    # A coordinator that now claims c03 dropped would get c03's key share on top of its self-mask share: refused.
    lie = UnmaskRequest(1, "c00", tuple(c for c in requests["c00"].survivors if c != "c03"))
    with pytest.raises(ProtocolViolation, match="c03"):
        client.unmask(lie)
    assert client.unmask(requests["c00"]) == first  # the refusal changed nothing


def test_never_both_shares_the_other_way_round(seeded: Seeded) -> None:
    r = Round(seeded)
    requests = r.upload(absent={"c03"})
    client = r.clients["c00"]
    first = client.unmask(requests["c00"])
    assert first.s_owners == ("c03",)
    # Claiming afterwards that c03 survived would reveal its self-mask share as well: refused.
    lie = UnmaskRequest(1, "c00", tuple(sorted((*requests["c00"].survivors, "c03"))))
    with pytest.raises(ProtocolViolation, match="already revealed"):
        client.unmask(lie)


def test_unmask_requests_that_cannot_be_honest_are_refused(seeded: Seeded) -> None:
    r = Round(seeded)  # k = 5, t = 3
    requests = r.upload()
    client = r.clients["c00"]
    with pytest.raises(ProtocolViolation, match="fewer than t"):
        client.unmask(UnmaskRequest(1, "c00", ("c01", "c02")))
    with pytest.raises(ProtocolViolation, match="c00"):  # itself, not a neighbour
        client.unmask(UnmaskRequest(1, "c00", ("c00", "c01", "c02")))
    with pytest.raises(ProtocolViolation, match="reached"):
        client.unmask(requests["c01"])


def test_abandoned_when_too_few_upload(seeded: Seeded) -> None:
    r = Round(seeded)  # t = 3 = min_survivors
    with pytest.raises(RoundAbandoned, match="2 clients uploaded") as info:
        r.upload(absent={"c00", "c01", "c02", "c03"})
    assert info.value.stage == "upload"
    assert r.server.stage is None
    with pytest.raises(ProtocolViolation, match="abandoned"):
        r.server.close_unmask()


def test_abandoned_when_too_few_advertise(seeded: Seeded) -> None:
    r = Round(seeded)
    with pytest.raises(RoundAbandoned, match="fewer than the minimum") as info:
        r.advertise(absent={"c00", "c01", "c02", "c03"})
    assert info.value.stage == "advertise"


def test_abandoned_when_too_few_answer_the_unmask_request(seeded: Seeded) -> None:
    r = Round(seeded)
    requests = r.upload()
    for reply in r.replies(requests, absent={"c00", "c01", "c02", "c03"}).values():
        r.server.receive_unmask(reply)
    with pytest.raises(RoundAbandoned, match="2 shares, 3 needed") as info:
        r.server.close_unmask()
    assert info.value.stage == "unmask"


def test_a_client_short_of_neighbours_is_left_out(seeded: Seeded) -> None:
    r = Round(seeded, n=20)  # k = 11, t = 6
    target = "c00"
    absent = set(r.cfg.graph[target][:6])  # leaves it 5 advertised neighbours
    keys = r.advertise(absent=absent)
    assert target not in keys
    assert all(len(k.peers) >= r.cfg.threshold for k in keys.values())
    assert all(set(k.peers) <= set(r.cfg.graph[c]) for c, k in keys.items())


def test_messages_out_of_order_late_or_changed(seeded: Seeded) -> None:
    r = Round(seeded)
    with pytest.raises(ProtocolViolation, match="at stage 'advertise'"):
        r.clients["c00"].share_keys(NeighbourKeys(1, "c00", (), (), ()))
    r.clients["c00"].advertise()
    with pytest.raises(ProtocolViolation, match="done already"):
        r.clients["c00"].advertise()
    r2 = Round(seeded)
    advert = r2.clients["c00"].advertise()
    assert r2.server.receive_advertise(advert)
    assert not r2.server.receive_advertise(advert)  # a repeat (QoS 1 delivers at least once): ignored
    with pytest.raises(ProtocolViolation, match="two different"):
        r2.server.receive_advertise(AdvertiseKeys(1, "c00", b"\x05" * 32, advert.s_public))
    with pytest.raises(ProtocolViolation, match="round 7"):
        r2.server.receive_advertise(AdvertiseKeys(7, "c01", b"\x05" * 32, b"\x06" * 32))
    with pytest.raises(ProtocolViolation, match="not in this round"):
        r2.server.receive_advertise(AdvertiseKeys(1, "c99", b"\x05" * 32, b"\x06" * 32))
    with pytest.raises(ProtocolViolation, match="before its stage"):
        r2.server.receive_shares(EncryptedShares(1, "c00", (), ()))
    with pytest.raises(ProtocolViolation, match="open stage"):
        r2.server.close_share()


def test_late_and_foreign_uploads(seeded: Seeded) -> None:
    r = Round(seeded)
    deliveries = r.share()
    late = r.clients["c05"].masked_input(deliveries["c05"], r.vectors["c05"])
    for c in ("c00", "c01", "c02", "c03", "c04"):
        r.server.receive_masked(r.clients[c].masked_input(deliveries[c], r.vectors[c]))
    with pytest.raises(ProtocolViolation, match="done already"):
        r.clients["c00"].masked_input(deliveries["c00"], r.vectors["c00"])  # never a second upload
    with pytest.raises(ProtocolViolation, match="two different"):
        r.server.receive_masked(replace(late, client="c00"))
    requests = r.server.close_upload()
    assert not r.server.receive_masked(late)  # after the deadline: ignored, not summed
    for reply in r.replies(requests).values():
        r.server.receive_unmask(reply)
    result = r.server.close_unmask()
    assert "c05" in result.dropped
    np.testing.assert_array_equal(result.decoded_sum, sum(r.vectors[c] for c in result.survivors))


def test_shares_for_strangers_and_wrong_vectors_are_refused(seeded: Seeded) -> None:
    r = Round(seeded)
    keys = r.advertise()
    shares = r.clients["c00"].share_keys(keys["c00"])
    with pytest.raises(ProtocolViolation, match="other clients"):
        r.server.receive_shares(replace(shares, recipients=shares.recipients[:-1], bundles=shares.bundles[:-1]))
    r2 = Round(seeded)
    deliveries = r2.share()
    with pytest.raises(EncodingError, match="shape"):
        r2.clients["c00"].masked_input(deliveries["c00"], np.zeros(DIM + 1))
    r2.clients["c00"].masked_input(deliveries["c00"], np.zeros(DIM))  # the refusal used up nothing
