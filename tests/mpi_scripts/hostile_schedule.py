"""Run under ``mpiexec -n 3``: a real VFB² runtime (dominators 0 and 1, ``--peer-timeout 3``) in which
dominator 1, after some honest steps, asks or broadcasts beyond what its schedule allows.

``argv[1]`` picks how (``argv[2]``, when given, is the folder of the ranks' verdict files; ``argv[3]``,
when given, is the ``--engine`` of parties 0 and 2: ``compiled`` runs them on the numba pump at B = 1,
with party 1 on the Python path, whose calls it misuses; ``argv[4]``, when given, is every party's
``--inflight``):

* ``flood`` - it announces request after request (well-formed, B rows each) without waiting for any
  to finish or broadcasting their (ϑ, i): every party would compute for it at its rate;
* ``unrequested`` - a (ϑ, i) numbered correctly for rows it never had aggregated;
* ``rows`` - it has rows aggregated honestly, then broadcasts ϑ's for other rows;
* ``twice`` - it has one step aggregated and broadcasts two (ϑ, i) for it.

Party 1 prints ``ATTACK <time>`` just before; the others must end the job naming party 1. Without the
checks, every rank closes normally and prints ``NOT REJECTED``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from parties.lifecycle import report_verdicts_to
from parties.runtime import TAG_THETA, PartyRuntime, RuntimeOptions
from protocols.dispatch import pack
from tests.mpi_scripts.small_party import small_party

TIMEOUT = 3.0
HOSTILE = 1


def _attack(plane, scenario: str) -> None:
    others = [r for r in range(plane.q) if r != plane.rank]
    b = plane.batch_size
    rows = np.array([3, 5])[:b]
    print(f"ATTACK {time.time():.3f}", flush=True)
    if scenario == "flood":
        for _ in range(1000):
            with plane.node_lock:
                _, announcements = plane.node.announce(rows)
            plane._send_all(announcements)
        return
    if scenario in ("rows", "twice"):
        plane.request(rows).get()  # aggregated honestly, every party contributing
    steps = [(plane.sent, rows)] if scenario != "rows" else [(plane.sent, np.array([7, 9])[:b])]
    if scenario == "twice":
        steps.append((plane.sent + 1, rows))
    for seq, sent_rows in steps:
        for dest in others:
            plane.transport.send(dest, pack(seq, sent_rows, np.full(b, 0.5)), TAG_THETA)


def main() -> None:
    scenario = sys.argv[1]
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if len(sys.argv) > 2:
        report_verdicts_to(Path(sys.argv[2]) / f"verdict-{rank}.txt")
    engine = sys.argv[3] if len(sys.argv) > 3 and rank != HOSTILE else "python"
    b = 1 if len(sys.argv) > 3 and sys.argv[3] == "compiled" else 2  # the pump runs B = 1
    party = small_party(rank, active=rank < 2, batch_size=b)
    inflight = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    options = RuntimeOptions(active_ranks=(0, 1), threads=1, seed=0, batch_size=b, peer_timeout=TIMEOUT,
                             engine=engine, inflight=inflight)
    runtime = PartyRuntime(comm, party, options)
    if rank in (0, 1):
        runtime.dominate(10)  # honest traffic first: both dominators' schedules are under way
    runtime.barrier()
    if rank == HOSTILE:
        _attack(runtime.plane, scenario)
    time.sleep(TIMEOUT + 20)  # a correct party ends the job long before
    print(f"NOT REJECTED {rank}", flush=True)
    runtime.close()


if __name__ == "__main__":
    main()
