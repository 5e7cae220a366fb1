"""Run under ``mpiexec -n 3``: the runtime with ``--engine compiled`` (the numba pump) where party 1 (a
dominator) sends party 0 one bad message with a raw ``Send`` after some honest training.

``argv[1]`` picks it: ``row`` (a (ϑ, i) message for row n + 1), ``request`` (an aggregation REQUEST for
row n), ``sum`` (a tree sum from a party that is not party 0's child). The pump must end the job naming
party 1; a pump that accepts it lets every rank close normally and print ``NOT REJECTED``.
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from parties.runtime import TAG_THETA, PartyRuntime, RuntimeOptions
from protocols.aggregation import Kind
from protocols.dispatch import pack
from protocols.transport import AGGREGATION_TAG
from tests.mpi_scripts.small_party import N_ROWS, small_party
from tests.mpi_scripts.verdict import await_verdict


def main() -> None:
    scenario = sys.argv[1]
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    party = small_party(rank, active=rank < 2)
    runtime = PartyRuntime(comm, party, RuntimeOptions(active_ranks=(0, 1), threads=1, seed=0,
                                                       engine="compiled"))
    if rank == 0:
        runtime.dominate(10)  # honest traffic first: the bad message is not the first one
    comm.Barrier()
    if rank == 1:
        if scenario == "row":
            bad, tag = pack(0, np.array([N_ROWS + 1]), np.array([0.5])).view(np.uint64), TAG_THETA
        elif scenario == "request":
            bad, tag = np.array([Kind.REQUEST, 1, 0, 0, N_ROWS], np.uint64), AGGREGATION_TAG
        else:  # request (0, 10) is not open at party 0 (it has finished 0..9), and 1 is no child of it there
            bad, tag = np.array([Kind.MASKED, 0, 9, 0, 123], np.uint64), AGGREGATION_TAG
        runtime.plane.data.Send([bad, MPI.BYTE], 0, tag)
    if rank == 0:
        await_verdict(runtime, source=1, accepted_after=1)
    runtime.close()
    print(f"NOT REJECTED {rank}", flush=True)


if __name__ == "__main__":
    main()
