"""Run under ``mpiexec -n 2``: party 0 answers party 1's HE full pass with a decryption of the wrong
length (``argv[1]``: ``short``, 3 words for 4, or ``long``, 5); party 1 must refuse it naming party 0
before it unmasks anything, else it prints ``NOT REJECTED`` with the words it would have unmasked.
``progress``: party 0 sends progress words forever instead of its encrypted ϑ_0, where the work allows
3; party 1 must refuse the fourth."""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from parties.audit import AuditLog
from parties.control_plane import ControlPlane
from parties.messages import TAG_HE_FULL, TAG_HE_FULL_DECRYPTED
from protocols.errors import ProtocolViolation
from protocols.liveness import Liveness

WORDS = 4  # 2 d_l for a passive block of two columns


def main() -> None:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    control = ControlPlane(comm, AuditLog(rank, False), Liveness(rank, comm.Get_size(), 10.0))
    if sys.argv[1] == "progress":
        return _progress_forever(control, rank)
    if rank == 0:
        sent = WORDS - 1 if sys.argv[1] == "short" else WORDS + 1
        control.comm.Send(np.arange(sent, dtype=np.uint64), 1, TAG_HE_FULL_DECRYPTED)
    else:
        try:
            words = control.recv_he_full_decrypted(0, WORDS)
            print(f"NOT REJECTED {words.tolist()}", flush=True)
        except ProtocolViolation as err:
            print(f"[party 1] {err}", flush=True)
    control.close()


def _progress_forever(control: ControlPlane, rank: int) -> None:
    if rank == 0:
        for _ in range(4):
            control.send_progress(TAG_HE_FULL, [1])
    else:
        try:
            control.recv_he_full(0, 100, progress=3)
            print("NOT REJECTED", flush=True)
        except ProtocolViolation as err:
            print(f"[party 1] {err}", flush=True)
    control.comm.Barrier()
    control.close()


if __name__ == "__main__":
    main()
