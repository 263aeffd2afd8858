"""cProfile of the batched executor's rounds on CUDA (FedNTD setup), to see where a 0.3 s round goes."""

import cProfile, pstats, sys, time

sys.path.insert(0, "benchmarks")
import torch
import executors as B
from sim.executors import ExperimentClients, make_executor
from fedge_io.experiment import prepare

cfg = B.setups(".devdata/mnist", quick=False)["fedntd"]
exp = prepare(cfg)
factory = ExperimentClients(exp.config, device="cuda")
path = B.EnginePath(exp, make_executor("batched", 1, factory, threads_per_worker=1), "cuda")
path.round(1)
path.round(2)
pr = cProfile.Profile()
pr.enable()
ts = [path.round(r) for r in (3, 4, 5)]
pr.disable()
print("rounds", ts, "evaluation", path.evaluation_s)
st = pstats.Stats(pr)
st.sort_stats("cumulative").print_stats(40)
st.sort_stats("tottime").print_stats(25)
path.executor.close()
