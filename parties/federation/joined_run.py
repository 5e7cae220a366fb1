"""What both kinds of federated party do around their training: the join and the run line held open
(:func:`join_and_hold`), and the leader's bytes to every party at the end (:func:`broadcast_bytes`):
:mod:`parties.federation.member` (vertical) and :mod:`parties.federation.hfl_member` (horizontal)."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from parties.federation.hello import HelloRefused
from parties.federation.jobfile import Job, split_address
from parties.federation.join import end_now
from parties.federation.leader import JoinFailed
from parties.federation.runline import LeaderLine, PartyLine


def join_and_hold(job: Job, rank: int, private: bytes, args: argparse.Namespace, say: Any, ended: str
                  ) -> tuple[Any, LeaderLine | PartyLine]:
    """The join (the leader leads, the others follow), then the run line held open for the run: a party
    whose process ends ends the run, named, each party's line ending with ``ended``. A failed join ends
    this process with its line."""
    from parties.federation.join import follow, lead

    name = args.name
    try:
        if rank == 0:
            bind = split_address(args.listen or job.leader.address)
            say(f"leading: the hello listens on {bind[0]}:{bind[1]}")
            joined = lead(job, private, bind, resume=args.resume, timeout=args.join_timeout, log=say,
                          fail=lambda line: end_now(f"vfl party {name}: {line}"))
        else:
            say(f"joining the leader {job.leader.name} at {job.leader.address}")
            joined = follow(job, rank, private, resume=args.resume, timeout=args.join_timeout, log=say,
                            fail=lambda line: end_now(f"vfl party {name}: {line}"))
    except (HelloRefused, JoinFailed) as err:
        end_now(f"vfl party {name}: {err}")
        raise AssertionError("not reached") from err

    def end_run(line: str) -> None:
        end_now(f"vfl party {name}: {line}; {ended}")

    if rank == 0:
        return joined, LeaderLine(joined.sessions, {p.name: r for r, p in enumerate(job.parties)}, end_run)
    return joined, PartyLine(joined.sessions[0], end_run)


def broadcast_bytes(comm: Any, rank: int, data: bytes, limit: int, what: str) -> bytes:
    """The leader's ``data`` (at most ``limit`` bytes) at every party: length, then bytes, buffer calls
    only; a length out of range ends the job naming the leader."""
    from mpi4py import MPI

    from protocols.errors import ProtocolViolation

    length = np.array([len(data)], dtype=np.int64)
    comm.Bcast([length, MPI.INT64_T], root=0)
    n = int(length[0])
    if not 0 < n <= limit:
        raise ProtocolViolation(0, what, f"{n} bytes (at most {limit})")
    buf = np.frombuffer(bytearray(data), dtype=np.uint8) if rank == 0 else np.empty(n, dtype=np.uint8)
    comm.Bcast([buf, MPI.BYTE], root=0)
    return buf.tobytes()
