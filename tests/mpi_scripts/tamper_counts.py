"""Run under ``mpiexec -n 3``: a real VFB² runtime where party 1 breaks a control word of the data plane
after honest traffic; party 0 must end the job naming party 1, else every rank prints ``NOT REJECTED``.

``argv[1]``:

* ``done-low`` - party 1 (a dominator) broadcasts 10 (ϑ, i), then sends a DONE counting 5;
* ``done-twice`` - party 1 ends its segment (an honest DONE), then sends the same DONE again;
* ``ack-replay`` - ``--mode sync``: party 0 dominates 5 steps, each acknowledged, then party 1 sends
  the acknowledgement of step 2 again.

``argv[2]``, when given, is the ``--engine`` of parties 0 and 2 (``compiled``: the numba pump counts the
(ϑ, i) that the DONE check reads; party 1 stays on the Python path).
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from parties.runtime import TAG_ACK, TAG_DONE, PartyRuntime, RuntimeOptions
from tests.mpi_scripts.small_party import small_party


def main() -> None:
    scenario = sys.argv[1]
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    sync = scenario == "ack-replay"
    party = small_party(rank, active=rank < 2)
    engine = sys.argv[2] if len(sys.argv) > 2 and rank != 1 else "python"
    runtime = PartyRuntime(comm, party, RuntimeOptions(active_ranks=(0, 1), threads=1, seed=0,
                                                       mode="sync" if sync else "async", engine=engine))
    plane = runtime.plane
    if scenario == "done-low" and rank == 1:
        runtime.dominate(10)
        plane.transport.send(0, np.array([1, 5], dtype=np.int64), TAG_DONE)
    elif scenario == "done-twice" and rank == 1:
        runtime.dominate(10)
        runtime.finish_segment()
        plane.transport.send(0, np.array([1, 10], dtype=np.int64), TAG_DONE)
    elif scenario == "ack-replay":
        if rank == 0:
            runtime.dominate(5)  # every step waits for both acknowledgements
        runtime.barrier()
        if rank == 1:
            plane.transport.send(0, np.array([2], dtype=np.uint64), TAG_ACK)
    runtime.close()  # party 0 handles party 1's messages before its STOP (MPI keeps them in order)
    print(f"NOT REJECTED {rank}", flush=True)


if __name__ == "__main__":
    main()
