"""ChaCha20 masks: the RFC keystream, uniformity, one stream per seed, in-place application."""

from __future__ import annotations

import numpy as np
import pytest

from fedge.secagg.errors import SecAggError
from fedge.secagg.masks import apply_mask, expand_mask


def test_known_answer_rfc_8439() -> None:
    # RFC 8439 A.1, test vector 1: all-zero key and nonce, block counter 0; keystream 76 b8 e0 ad a0 f1 3d 90 ...
    np.testing.assert_array_equal(expand_mask(bytes(32), 4), [0xADE0B876, 0x903DF1A0, 0xE56A5D40, 0x28BD8653])


def test_uniform_and_seed_dependent() -> None:
    a = expand_mask(b"\x01" * 32, 200_000)
    b = expand_mask(b"\x02" * 32, 200_000)
    assert a.dtype == np.uint32 and a.shape == (200_000,)
    for m in (a, b):
        assert abs(m.astype(np.float64).mean() / 2**31 - 1) < 0.01  # standard error 0.13%
        assert (m < 2**31).mean() == pytest.approx(0.5, abs=0.01)  # the top bit is fair too
    assert (a == b).mean() < 1e-3
    np.testing.assert_array_equal(a, expand_mask(b"\x01" * 32, 200_000))
    np.testing.assert_array_equal(a[:10], expand_mask(b"\x01" * 32, 10))  # a prefix of the same stream


def test_smaller_ring() -> None:
    m = expand_mask(b"\x03" * 32, 100_000, ring_bits=16)
    assert int(m.max()) < 2**16
    assert abs(m.mean() / 2**15 - 1) < 0.01
    np.testing.assert_array_equal(m, expand_mask(b"\x03" * 32, 100_000) & 0xFFFF)


@pytest.mark.parametrize("bits", [32, 20])
def test_apply_adds_and_subtracts_in_place(bits: int) -> None:
    x = np.random.default_rng(0).integers(0, 2**bits, size=1000, dtype=np.uint64).astype(np.uint32)
    acc = x.copy()
    apply_mask(acc, b"\x04" * 32, bits)
    np.testing.assert_array_equal(acc, (x.astype(np.uint64) + expand_mask(b"\x04" * 32, 1000, bits)) % 2**bits)
    apply_mask(acc, b"\x04" * 32, bits, subtract=True)
    np.testing.assert_array_equal(acc, x)


def test_refuses_bad_input() -> None:
    with pytest.raises(SecAggError, match="32 bytes"):
        expand_mask(b"short", 4)
    with pytest.raises(SecAggError, match="uint32"):
        apply_mask(np.zeros(4, dtype=np.int64), bytes(32))
    assert expand_mask(bytes(32), 4).flags.writeable  # a fresh array, not the cipher's read-only buffer
