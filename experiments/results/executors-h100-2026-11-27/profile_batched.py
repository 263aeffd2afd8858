"""cProfile of the batched executor's rounds on CUDA (FedNTD setup), to see where a 0.3 s round goes.

Run from the repository root on a GPU machine, with MNIST's files under .devdata/mnist:
``python experiments/results/executors-h100-2026-11-27/profile_batched.py``.
"""

import cProfile
import pstats
import sys

sys.path.insert(0, "benchmarks")

import executors as bench

from fedge_io.experiment import prepare
from sim.executors import ExperimentClients, make_executor

exp = prepare(bench.setups(".devdata/mnist", quick=False)["fedntd"])
factory = ExperimentClients(exp.config, device="cuda")
path = bench.EnginePath(exp, make_executor("batched", 1, factory, threads_per_worker=1), "cuda")
path.round(1)  # warm-up: CUDA start-up, data resident on the device
path.round(2)
profile = cProfile.Profile()
profile.enable()
seconds = [path.round(r) for r in (3, 4, 5)]
profile.disable()
print("rounds", seconds, "evaluation", path.evaluation_s)
stats = pstats.Stats(profile)
stats.sort_stats("cumulative").print_stats(40)
stats.sort_stats("tottime").print_stats(25)
path.executor.close()
