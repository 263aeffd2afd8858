"""X25519 + HKDF key agreement and AES-GCM share sealing: both ends agree, every binding counts, tampering fails."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fedge.secagg.errors import DecryptionError, KeyAgreementError
from fedge.secagg.keys import RoundContext, derive_key, generate_keypair, open_sealed, public_key_of, seal

Seeded = Callable[[int], Callable[[int], bytes]]
CTX = RoundContext(run="run-1", session="s1", round=3)


def test_both_ends_derive_the_same_key(seeded: Seeded) -> None:
    rand = seeded(0)
    a, b = generate_keypair(rand), generate_keypair(rand)
    assert public_key_of(a.private) == a.public
    k_ab = derive_key(a.private, b.public, context=CTX, pair=("c1", "c2"), purpose="mask")
    k_ba = derive_key(b.private, a.public, context=CTX, pair=("c2", "c1"), purpose="mask")
    assert k_ab == k_ba and len(k_ab) == 32


def test_every_binding_changes_the_key(seeded: Seeded) -> None:
    rand = seeded(1)
    a, b = generate_keypair(rand), generate_keypair(rand)
    base = derive_key(a.private, b.public, context=CTX, pair=("c1", "c2"), purpose="mask")
    variants = [
        derive_key(a.private, b.public, context=CTX, pair=("c1", "c2"), purpose="share-encryption"),
        derive_key(a.private, b.public, context=RoundContext("run-1", "s1", 4), pair=("c1", "c2"), purpose="mask"),
        derive_key(a.private, b.public, context=RoundContext("run-2", "s1", 3), pair=("c1", "c2"), purpose="mask"),
        derive_key(a.private, b.public, context=RoundContext("run-1", "s2", 3), pair=("c1", "c2"), purpose="mask"),
        derive_key(a.private, b.public, context=CTX, pair=("c1", "c3"), purpose="mask"),
        # Length-prefixed fields: ("c1", "c2") and ("c1c", "2") must not collide.
        derive_key(a.private, b.public, context=CTX, pair=("c", "1c2"), purpose="mask"),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_bad_public_keys_are_refused(seeded: Seeded) -> None:
    a = generate_keypair(seeded(2))
    with pytest.raises(KeyAgreementError, match="failed"):  # a low-order point: the shared secret would be 0
        derive_key(a.private, bytes(32), context=CTX, pair=("c1", "c2"), purpose="mask")
    with pytest.raises(KeyAgreementError, match="32 bytes"):
        derive_key(a.private, b"\x01" * 31, context=CTX, pair=("c1", "c2"), purpose="mask")


def test_seal_round_trip_and_tampering(seeded: Seeded) -> None:
    key, rand = seeded(3)(32), seeded(4)
    sealed = seal(key, b"shares" * 22, context=CTX, sender="c1", recipient="c2", rand_bytes=rand)
    assert len(sealed) == 132 + 28
    assert open_sealed(key, sealed, context=CTX, sender="c1", recipient="c2") == b"shares" * 22
    for i in (0, 20, len(sealed) - 1):  # nonce, ciphertext, tag
        flipped = bytearray(sealed)
        flipped[i] ^= 0x01
        with pytest.raises(DecryptionError, match="failed authentication"):
            open_sealed(key, bytes(flipped), context=CTX, sender="c1", recipient="c2")
    with pytest.raises(DecryptionError):  # relayed to the wrong client
        open_sealed(key, sealed, context=CTX, sender="c1", recipient="c3")
    with pytest.raises(DecryptionError):  # the reverse direction
        open_sealed(key, sealed, context=CTX, sender="c2", recipient="c1")
    with pytest.raises(DecryptionError):  # replayed in another round
        open_sealed(key, sealed, context=RoundContext("run-1", "s1", 4), sender="c1", recipient="c2")
    with pytest.raises(DecryptionError, match="shorter"):
        open_sealed(key, sealed[:10], context=CTX, sender="c1", recipient="c2")


def test_key_pairs_do_not_print_private_keys(seeded: Seeded) -> None:
    pair = generate_keypair(seeded(5))
    assert pair.private.hex() not in repr(pair)
