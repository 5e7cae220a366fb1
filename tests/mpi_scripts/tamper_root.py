"""Run under ``mpiexec -n 3``: a real VFB² runtime in which passive party 2 roots an aggregation.

A party that could root one would read the model's score of every row it names (sign(z) = y on 83-84 %
of a9a) and make every other party compute for it. Party 2 sends a well-formed ``REQUEST`` for root 2 to
both dominators after some honest training; they must end the job naming party 2. Without that check,
every rank closes normally and prints ``NOT REJECTED``. No sleep is needed: ``close`` ends only when a
STOP from every party has arrived, and MPI keeps party 2's REQUEST ahead of its STOP.
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from parties.runtime import PartyRuntime, RuntimeOptions
from protocols.aggregation import Kind
from protocols.transport import AGGREGATION_TAG
from tests.mpi_scripts.small_party import small_party


def main() -> None:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    runtime = PartyRuntime(comm, small_party(rank, active=rank < 2),
                           RuntimeOptions(active_ranks=(0, 1), threads=1, seed=0))
    if rank == 0:
        runtime.dominate(10)  # honest traffic first: the bad message is not the first one
    comm.Barrier()
    if rank == 2:
        request = np.array([Kind.REQUEST, 2, 0, 0, 3, 5], dtype=np.uint64)  # root 2, request 0, rows 3, 5
        for dominator in (0, 1):
            runtime.plane.transport.send(dominator, request, AGGREGATION_TAG)
    runtime.close()
    print(f"NOT REJECTED {rank}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
