"""Run under ``mpiexec -n 3``: a real VFB² runtime where party 1 (a dominator) sends party 0 one bad
message with a raw ``Send`` after some honest training, as a tampering party would.

``argv[1]`` picks the message: ``row`` (a (ϑ, i) message for row n + 1, which used to reach the numba
update kernel and crash it), ``truncated`` (a (ϑ, i) message one word short) or ``pickle`` (a pickle
payload that would create ``argv[2]`` if anything unpickled it). Party 0 must end the job naming party 1;
without that, every rank closes normally and prints ``NOT REJECTED``. ``argv[3]``, when given, is the
folder of the ranks' verdict files (``parties.lifecycle.report_verdicts_to``), as ``vfl train`` sets it.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from parties.lifecycle import report_verdicts_to
from parties.runtime import TAG_THETA, PartyRuntime, RuntimeOptions
from protocols.dispatch import pack
from tests.mpi_scripts.small_party import N_ROWS, small_party
from tests.mpi_scripts.verdict import await_verdict


class _WritesMarker:
    """Unpickling this calls ``open(path, "w")``: proof that a receiver executed a peer's payload."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def main() -> None:
    scenario = sys.argv[1]
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if len(sys.argv) > 3:
        report_verdicts_to(Path(sys.argv[3]) / f"verdict-{rank}.txt")
    party = small_party(rank, active=rank < 2)
    runtime = PartyRuntime(comm, party, RuntimeOptions(active_ranks=(0, 1), threads=1, seed=0))
    if rank == 0:
        runtime.dominate(10)  # honest traffic first: the bad message is not the first one
    comm.Barrier()
    if rank == 1:
        if scenario == "row":
            bad = pack(0, np.array([N_ROWS + 1]), np.array([0.5]))
        elif scenario == "truncated":
            bad = pack(0, np.array([3]), np.array([0.5]))[:-1].copy()
        else:
            bad = np.frombuffer(pickle.dumps(_WritesMarker(sys.argv[2])), dtype=np.uint8).copy()
        runtime.plane.data.Send([bad, MPI.BYTE], 0, TAG_THETA)
    if rank == 0:  # a correct party 0 ends the job on the message; a broken one applies it
        await_verdict(runtime, source=1, accepted_after=1)
    runtime.close()  # the others wait here (a collective) for party 0: its verdict, or the job's end
    print(f"NOT REJECTED {rank} {os.path.exists(sys.argv[2]) if len(sys.argv) > 2 else ''}", flush=True)


if __name__ == "__main__":
    main()
