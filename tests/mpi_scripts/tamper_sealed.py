"""Run under ``mpiexec -n 3``: a VFB² runtime with sealed channels where party 1 tampers with, or
replays, a sealed message to party 0 (``argv[1]``: ``tampered`` or ``replayed``). Party 0 must end the
job naming party 1; without that every rank closes normally and prints ``NOT REJECTED``.

The message is a heartbeat, valid in content at any time, so that only the seal can reject it: a
(ϑ, i) of a step party 1 never requested is refused for that already (``protocols/schedule.py``)."""

from __future__ import annotations

import hashlib
import sys

import numpy as np
from mpi4py import MPI

from parties.runtime import TAG_HEARTBEAT, PartyRuntime, RuntimeOptions
from protocols.channels import ChannelKeys, public_key
from tests.mpi_scripts.small_party import small_party
from tests.mpi_scripts.verdict import await_verdict


def main() -> None:
    scenario = sys.argv[1]
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    privates = [hashlib.sha256(f"test key {r}".encode()).digest() for r in range(comm.Get_size())]
    keys = ChannelKeys(privates[rank], tuple(public_key(p) for p in privates), b"test job")
    party = small_party(rank, active=rank < 2)
    runtime = PartyRuntime(comm, party, RuntimeOptions(active_ranks=(0, 1), threads=1, seed=0, keys=keys))
    if rank == 0:
        runtime.dominate(10)  # honest sealed traffic first
    comm.Barrier()
    if rank == 1:
        with runtime.transport.send_lock:  # the next counter of the link to party 0, as an honest send
            sealed = runtime.plane.channels.seal(0, TAG_HEARTBEAT, np.zeros(1, dtype=np.uint64))
            if scenario == "tampered":
                sealed[1] ^= np.uint64(1)  # one bit of the ciphertext
            runtime.plane.data.Send(sealed, 0, TAG_HEARTBEAT)
            if scenario == "replayed":
                runtime.plane.data.Send(sealed, 0, TAG_HEARTBEAT)
    if rank == 0:  # a heartbeat applies nothing: the wait ends early only with the job (the verdict)
        await_verdict(runtime, source=1, accepted_after=1)
    runtime.close()  # the others wait here (a collective) for party 0: its verdict, or the job's end
    print(f"NOT REJECTED {rank}", flush=True)


if __name__ == "__main__":
    main()
