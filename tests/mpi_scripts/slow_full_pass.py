"""Run under ``mpiexec -n 3``: an honest SVRG snapshot under ``--label-privacy he`` (party 0 the
dominator, 1 and 2 passive) on enough rows that its silent local steps (ϑ_0's encryption at party 0,
each passive party's masked pass) outlast ``--peer-timeout`` (``argv[1]`` seconds). Nobody may be named:
each rank prints ``PASSED <seconds the snapshot took>``."""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

from parties.runtime import PartyRuntime, PartyState, RuntimeOptions
from vertical.algorithms.vfb2 import Block, get_rule
from vertical.problems import get_problem

ROWS, WIDTH = 100_000, 3  # over 2 s on a quiet machine (60,000: 1.9 s there, 30,000: 1.5 s under load)


def main() -> None:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    rng = np.random.default_rng(rank)
    block = Block.from_matrix(rng.integers(0, 2, size=(ROWS, WIDTH)).astype(float))  # a9a-like
    problem = get_problem("logistic", lam=0.1)
    rule = get_rule("svrg")(block, problem.regularizer, problem.lam, 0.05, writers=2, lazy=False,
                            batch_size=16)
    party = PartyState(rank=rank, block=block, w=np.zeros(WIDTH), rule=rule,
                       problem=problem if rank == 0 else None,
                       y=rng.choice([-1.0, 1.0], ROWS) if rank == 0 else None)
    runtime = PartyRuntime(comm, party, RuntimeOptions(active_ranks=(0,), threads=1, seed=0, batch_size=16,
                                                       label_privacy="he", he_scheme="ou",
                                                       peer_timeout=float(sys.argv[1])))
    started = time.perf_counter()
    runtime.snapshot(0)
    took = time.perf_counter() - started
    runtime.barrier()
    runtime.close()
    print(f"PASSED {took:.2f}", flush=True)


if __name__ == "__main__":
    main()
