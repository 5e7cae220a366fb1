"""Run under ``mpiexec -n 3``: a real VFB² runtime (party 0 the dominator, ``--peer-timeout 3``) where
party 2 stops doing its part while its process, and its heartbeat thread, go on: the job must end
naming party 2 within the timeout plus the levels' stagger, heartbeats or not.

``argv[1]`` picks how party 2 stalls, after some honest traffic:

* ``tree`` - its communication thread stops answering REQUESTs and tree sums (party 0 dominates);
* ``fullpass`` - it stops joining the batched full passes (the epoch-end evaluation's exchange);
* ``barrier`` - it never reaches a control-plane barrier;
* ``frame`` - in a full pass it sends its tree-1 sum to party 0 as a frame announcing a long message,
  and never the payload (its tree-2 sum goes normally).

``argv[2]``, when given, is the ``--engine`` of every party but party 2 (``compiled``: the numba pump's
partial-sum deadlines; party 2 stays on the Python path, whose handler it replaces, and speaks the same
wire). Party 2 prints ``STALL <time>`` when it stops; every party prints ``NOT ENDED`` if the job outlives
its stall by a minute (the test's failure).
"""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

from parties.lifecycle import stop_job
from parties.runtime import PartyRuntime, RuntimeOptions
from protocols.aggregation import Kind
from protocols.errors import ProtocolViolation
from protocols.liveness import PeerTimeout
from protocols.transport import AGGREGATION_TAG
from tests.mpi_scripts.small_party import small_party

TIMEOUT = 3.0
HOSTILE = 2


def _stall() -> None:
    print(f"STALL {time.time():.3f}", flush=True)
    time.sleep(60)


def _frame_instead_of_tree_sum(runtime: PartyRuntime) -> None:
    """Party 2's part of one full pass rooted at 0, with its tree-1 sum replaced by a bare frame."""
    aggregator = runtime.aggregator
    rid = aggregator.node.claim_request_id(0)
    requested = aggregator._await_announcement(0, rid)
    step = aggregator.node.start(0, rid, np.zeros(requested.indices.size))
    for message in step.outgoing:
        if int(message.buffer[0]) == Kind.MASKED:  # tree 1: a star for q = 3, so to party 0
            frame = np.array([aggregator.transport.capacity_words + 1000], dtype=np.uint32)
            aggregator.transport.comm.Send([frame, MPI.BYTE], message.dest, AGGREGATION_TAG)
        else:
            aggregator.transport.send(message.dest, message.buffer)
    aggregator.transport.flush()


def main() -> None:
    scenario = sys.argv[1]
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    party = small_party(rank, active=rank == 0)
    engine = sys.argv[2] if len(sys.argv) > 2 and rank != HOSTILE else "python"
    runtime = PartyRuntime(comm, party, RuntimeOptions(active_ranks=(0,), threads=1, seed=0,
                                                       peer_timeout=TIMEOUT, engine=engine))
    try:
        if scenario == "tree":
            if rank == 0:
                runtime.dominate(20)  # honest traffic first
            runtime.barrier()
            if rank == HOSTILE:
                runtime.plane._on_aggregation = lambda source, buf: None  # heartbeats go on
                _stall()
            elif rank == 0:
                runtime.dominate(10**7)
            time.sleep(60)
        else:
            for step in range(10**6):
                if rank == HOSTILE and step == 3:
                    if scenario == "frame":
                        _frame_instead_of_tree_sum(runtime)
                    _stall()
                if scenario == "barrier":
                    runtime.barrier()
                else:
                    runtime.full_scores(root=0)
    except (PeerTimeout, ProtocolViolation) as err:  # as parties/rank.py does
        stop_job(comm, rank, "failed", str(err))
        return
    print(f"NOT ENDED {rank}", flush=True)


if __name__ == "__main__":
    main()
