"""fedge.tensors.l2_norm, the norm every DP and secure-aggregation clip compares with its bound: the same bits
whatever the BLAS and OpenMP thread counts (np.linalg.norm's BLAS dot sums in a thread-dependent order), and the
norm."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from fedge.tensors import l2_norm

# fedavg_cnn's size: long enough that a threaded BLAS splits its dot.
PROGRAM = """
import numpy as np
from fedge.tensors import l2_norm
x = np.random.default_rng(0).normal(size=1_663_371) * 1e-3
print(l2_norm(x).hex())
"""


def _norm_bits(threads: int) -> str:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    env["MKL_NUM_THREADS"] = str(threads)
    done = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_norm_does_not_depend_on_the_thread_count() -> None:
    assert _norm_bits(1) == _norm_bits(2) == _norm_bits(4)


def test_it_is_the_l2_norm() -> None:
    x = np.random.default_rng(1).normal(size=10_001)
    assert abs(l2_norm(x) - float(np.sqrt(np.sum(x.astype(np.longdouble) ** 2)))) <= 1e-12 * l2_norm(x)
    assert l2_norm(np.array([3.0, 4.0])) == 5.0 and l2_norm(np.zeros(3)) == 0.0
