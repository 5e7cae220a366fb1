"""Run under ``mpiexec -n 3``: construct and close a VFB² runtime ``argv[1]`` times in one process
(``sync-global``, whose dominators agree on every step) and check that every communicator it
duplicated (data, control, the full passes') is ``MPI.COMM_NULL`` after each close. MPICH has a few
thousand context ids: a runtime that leaked its communicators would run out of them long before the
loop ends. Then the library call itself,
``parties.training.train``, twice in the same process (``argv[2]``: a run folder): every runtime it
made has freed its communicators when it returns. Prints ``NO LEAK <rank>``."""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

import parties.training
from parties.config import RunConfig
from parties.runtime import PartyRuntime, PartyState, RuntimeOptions
from vertical.algorithms.vfb2 import Block, get_rule
from vertical.problems import get_problem

N_ROWS, WIDTH = 20, 2


def main() -> None:
    rounds = int(sys.argv[1])
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    rng = np.random.default_rng(rank)
    block = Block.from_matrix(rng.normal(size=(N_ROWS, WIDTH)))
    problem = get_problem("logistic", lam=0.1)
    active = rank < 2
    party = PartyState(rank=rank, block=block, w=np.zeros(WIDTH),
                       rule=get_rule("sgd")(block, problem.regularizer, problem.lam, 0.05, writers=2),
                       problem=problem if active else None,
                       y=rng.choice([-1.0, 1.0], N_ROWS) if active else None)
    options = RuntimeOptions(active_ranks=(0, 1), threads=1, seed=0, mode="sync-global")
    started = time.perf_counter()
    for k in range(rounds):
        runtime = PartyRuntime(comm, party, options)
        if k == 0 and active:  # one segment of real traffic, so that closing has something to drain
            runtime.dominate(5)
            runtime.finish_segment()
        if k == 0:
            runtime.drain()
        comms = runtime.communicators()
        runtime.close()
        kept = [c for c in comms if c != MPI.COMM_NULL]
        if kept or len(comms) != 3:
            raise SystemExit(f"party {rank}: round {k} kept {len(kept)} of {len(comms)} communicators")
    trained = train_twice(comm, party, sys.argv[2])
    if trained != 2:
        raise SystemExit(f"party {rank}: {trained} of train's runtimes freed every communicator (2 calls)")
    print(f"NO LEAK {rank} ({rounds} runtimes in {time.perf_counter() - started:.1f} s)", flush=True)


def train_twice(comm: MPI.Comm, party: PartyState, out: str) -> int:
    """Call ``train`` twice; return how many runtimes it made whose communicators are all freed."""
    made: list[PartyRuntime] = []

    class Recorded(PartyRuntime):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    parties.training.PartyRuntime = Recorded
    for k in range(2):
        party.w[:] = 0.0
        config = RunConfig(parties=3, active=2, algorithm="sgd", epochs=1, threads=1, out=f"{out}/{k}",
                           progress=False)
        parties.training.train(comm, party, config)
    return sum(all(c == MPI.COMM_NULL for c in runtime.communicators()) for runtime in made)


if __name__ == "__main__":
    main()
