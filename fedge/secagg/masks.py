"""Masks: a 32-byte seed expanded into a vector of uniform ring elements by the ChaCha20 stream cipher.

Bonawitz et al. 2017 (Section 3, "PRG") and Bell et al. 2020 (Section 3) mask each input with PRG(b_u), the
client's self mask, and +-PRG(s_uv), one pairwise mask per neighbour. The PRG here is ChaCha20 (RFC 8439) from the
``cryptography`` package: its keystream over zero bytes, read as little-endian uint32 and reduced to ``ring_bits``
bits. Reducing a uniform 32-bit word modulo 2^ring_bits keeps it uniform because 2^ring_bits divides 2^32.

The nonce is fixed at zero: a (key, nonce) pair must never encrypt two messages, and here every key is used for one
stream only. Self-mask seeds are drawn fresh per client and round; pairwise seeds come out of HKDF with the run,
session, round and pair of clients in its ``info`` (:mod:`fedge.secagg.keys`), so no two streams share a key.
Both ends of a pair expand the same seed on purpose: that is how their masks cancel.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from fedge.secagg.encoding import MAX_RING_BITS, RingVector
from fedge.secagg.errors import SecAggError

SEED_BYTES = 32
"""A mask seed is a 256-bit ChaCha20 key."""

MAX_LENGTH = 1 << 31
"""Most ring elements one seed expands to (8 GiB of keystream; ChaCha20's 32-bit block counter allows 256 GiB)."""

_NONCE = bytes(16)  # cryptography's ChaCha20 nonce: a 4-byte little-endian block counter, then a 12-byte nonce


def expand_mask(seed: bytes, length: int, ring_bits: int = 32) -> RingVector:
    """PRG(seed): ``length`` uniform elements of Z_{2^ring_bits} as a new uint32 array."""
    words = _keystream_words(seed, length, ring_bits)
    if ring_bits == MAX_RING_BITS:
        return words.copy()  # the keystream view is read-only
    return words & np.uint32((1 << ring_bits) - 1)


def apply_mask(acc: RingVector, seed: bytes, ring_bits: int = 32, *, subtract: bool = False) -> None:
    """``acc`` += PRG(seed) (or -= with ``subtract``) in place, modulo 2^ring_bits; no extra copy of the mask."""
    if acc.dtype != np.uint32 or acc.ndim != 1:
        raise SecAggError(f"a mask is applied to a 1-D uint32 vector, got {acc.dtype} of shape {acc.shape}")
    words = _keystream_words(seed, acc.shape[0], ring_bits)
    (np.subtract if subtract else np.add)(acc, words, out=acc)  # uint32 wraps modulo 2^32
    if ring_bits < MAX_RING_BITS:
        np.bitwise_and(acc, np.uint32((1 << ring_bits) - 1), out=acc)


def _keystream_words(seed: bytes, length: int, ring_bits: int) -> npt.NDArray[np.uint32]:
    if not isinstance(seed, bytes) or len(seed) != SEED_BYTES:
        raise SecAggError(f"a mask seed is {SEED_BYTES} bytes")
    if not 0 <= length <= MAX_LENGTH:
        raise SecAggError(f"a mask has between 0 and {MAX_LENGTH} elements, got {length}")
    if not 1 <= ring_bits <= MAX_RING_BITS:
        raise SecAggError(f"ring_bits must lie in [1, {MAX_RING_BITS}], got {ring_bits}")
    encryptor = Cipher(algorithms.ChaCha20(seed, _NONCE), mode=None).encryptor()
    stream = encryptor.update(bytes(4 * length))  # keystream XOR zeros = keystream
    return np.frombuffer(stream, dtype="<u4").astype(np.uint32, copy=False)  # (length,), read-only view
