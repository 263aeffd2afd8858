"""Key agreement, key derivation and share encryption: X25519, HKDF-SHA256 and AES-256-GCM from ``cryptography``.

Bonawitz et al. 2017 (Section 3, "Key Agreement", "Authenticated Encryption") and Bell et al. 2020 (Section 3):
every client makes two key pairs per round, (c_pk, c_sk) to encrypt the Shamir shares it relays through the server
and (s_pk, s_sk) to agree on pairwise mask seeds. Each Diffie-Hellman result goes through HKDF-SHA256 with an
``info`` string that binds the run, the session, the round, the (sorted) pair of clients and the purpose, so a key
is never reused across rounds, runs, pairs or purposes even if a key pair were. Share bundles are sealed with
AES-256-GCM under the pair's share-encryption key, with associated data naming the run, session, round, sender and
recipient: a bundle replayed from another round, or relayed to the wrong client, fails authentication like a
tampered one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, TypeAlias

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedge.secagg.errors import DecryptionError, KeyAgreementError, SecAggError
from fedge.secagg.shamir import RandBytes

KEY_BYTES = 32
"""X25519 private and public keys, and every derived key, are 32 bytes."""

NONCE_BYTES = 12
TAG_BYTES = 16
SEAL_OVERHEAD = NONCE_BYTES + TAG_BYTES
"""Bytes a sealed bundle adds to its plaintext: the random GCM nonce in front, the tag behind."""

Purpose: TypeAlias = Literal["mask", "share-encryption"]
"""What a derived key is for: a pairwise mask seed, or the key that seals share bundles between two clients."""

PURPOSES: tuple[Purpose, ...] = ("mask", "share-encryption")
_DOMAIN = b"fedge-secagg/v1"


@dataclass(frozen=True)
class RoundContext:
    """What every derived key and every sealed bundle is bound to: the run, the coordinator's session, the round."""

    run: str
    session: str
    round: int

    def __post_init__(self) -> None:
        if not isinstance(self.round, int) or self.round < 0:
            raise SecAggError(f"round must be a non-negative integer, got {self.round!r}")


@dataclass(frozen=True)
class KeyPair:
    """An X25519 key pair as raw bytes."""

    private: bytes
    public: bytes

    def __repr__(self) -> str:  # never print a private key into a log
        return f"KeyPair(public={self.public.hex()}, private=<{KEY_BYTES} bytes>)"


def generate_keypair(rand_bytes: RandBytes = os.urandom) -> KeyPair:
    """A fresh X25519 key pair from ``rand_bytes`` (os.urandom in use; a seeded stream in tests)."""
    private = rand_bytes(KEY_BYTES)
    return KeyPair(private=private, public=public_key_of(private))


def public_key_of(private: bytes) -> bytes:
    """The X25519 public key of raw private key ``private``."""
    if len(private) != KEY_BYTES:
        raise KeyAgreementError(f"an X25519 private key is {KEY_BYTES} bytes, got {len(private)}")
    key = X25519PrivateKey.from_private_bytes(private).public_key()
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def derive_key(
    private: bytes, peer_public: bytes, *, context: RoundContext, pair: tuple[str, str], purpose: Purpose
) -> bytes:
    """HKDF-SHA256(X25519(private, peer_public)) bound to ``context``, the pair of clients and ``purpose``.

    Both ends get the same key: the pair is sorted before it enters ``info``.
    """
    if purpose not in PURPOSES:
        raise SecAggError(f"unknown key purpose {purpose!r}")
    if len(private) != KEY_BYTES:
        raise KeyAgreementError(f"an X25519 private key is {KEY_BYTES} bytes, got {len(private)}")
    if len(peer_public) != KEY_BYTES:
        raise KeyAgreementError(f"an X25519 public key is {KEY_BYTES} bytes, got {len(peer_public)}")
    try:
        shared = X25519PrivateKey.from_private_bytes(private).exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as exc:  # a low-order point gives an all-zero secret, which cryptography refuses
        raise KeyAgreementError(f"key agreement with public key {peer_public.hex()} failed: {exc}") from None
    a, b = sorted(pair)
    info = _frame(_DOMAIN, purpose, context.run, context.session, str(context.round), a, b)
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(shared)


def seal(
    key: bytes,
    plaintext: bytes,
    *,
    context: RoundContext,
    sender: str,
    recipient: str,
    rand_bytes: RandBytes = os.urandom,
) -> bytes:
    """AES-256-GCM of ``plaintext`` as nonce || ciphertext || tag, authenticated with the round and both clients.

    The nonce is random: the pair's key seals one bundle in each direction, and a random 96-bit nonce keeps the
    two apart without the two ends having to agree who uses which.
    """
    nonce = rand_bytes(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, _associated(context, sender, recipient))


def open_sealed(key: bytes, sealed: bytes, *, context: RoundContext, sender: str, recipient: str) -> bytes:
    """The plaintext of a :func:`seal` output; DecryptionError when it was tampered with or sealed for another
    round, run, session, sender or recipient."""
    if len(sealed) < SEAL_OVERHEAD:
        raise DecryptionError(f"a sealed bundle from {sender!r} is {len(sealed)} bytes, shorter than nonce and tag")
    try:
        return AESGCM(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], _associated(context, sender, recipient))
    except InvalidTag:
        raise DecryptionError(
            f"the share bundle from {sender!r} to {recipient!r} failed authentication (tampered, misrouted or from "
            f"another round); refusing it"
        ) from None


def _associated(context: RoundContext, sender: str, recipient: str) -> bytes:
    return _frame(_DOMAIN, "shares", context.run, context.session, str(context.round), sender, recipient)


def _frame(*parts: bytes | str) -> bytes:
    # Length-prefixed, so that no two different tuples of fields give the same bytes ("ab","c" vs "a","bc").
    out = bytearray()
    for part in parts:
        raw = part.encode("utf-8") if isinstance(part, str) else part
        out += len(raw).to_bytes(4, "big") + raw
    return bytes(out)
