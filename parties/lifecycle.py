"""How a party's job ends on purpose, and how its threads are named and guarded.

A party that finds a reason the user must read (the model diverged, a peer is silent or does not
deliver its part in time, a peer broke the protocol) ends the whole job with one line the launcher
repeats and an exit code of its own (``parties/outcomes.py``); any other exception in one of its
threads ends it too, with a traceback.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import traceback
from collections.abc import Callable

from mpi4py import MPI

from parties.outcomes import EXIT_CODES, STOP_LINE
from protocols.errors import ProtocolViolation
from protocols.liveness import PeerTimeout
from protocols.masking import AggregationOverflowError

#: Why a job stops when a score cannot be aggregated.
OUT_OF_RANGE = "the scores left the secure aggregation's range: the model diverged"


def stop_job(comm: MPI.Comm, rank: int, outcome: str, reason: str) -> None:
    """End the whole job for a reason the user must read (not a crash): one
    :data:`~parties.outcomes.STOP_LINE` that the launcher repeats, and the exit code of ``outcome``
    (:data:`parties.outcomes.EXIT_CODES`)."""
    print(STOP_LINE.format(rank=rank, outcome=outcome, reason=reason), file=sys.stderr, flush=True)
    comm.Abort(EXIT_CODES[outcome])


def name_os_thread(name: str) -> None:
    """Name the calling thread in the OS as well (Linux keeps 15 bytes), so that ``top -H`` and
    ``python -m experiments update_profile`` can tell a party's comm thread from its workers."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # no prctl in this libc: names are a convenience
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15 = PR_SET_NAME


def guarded(comm: MPI.Comm, rank: int, body: Callable[..., None]) -> Callable[..., None]:
    """``body`` for a thread of party ``rank``: any exception in it ends the whole job (on ``comm``)
    with a message naming the party."""

    def run(*args) -> None:
        name_os_thread(f"p{rank}-{threading.current_thread().name}")
        try:
            body(*args)
        except AggregationOverflowError:
            stop_job(comm, rank, "diverged", OUT_OF_RANGE)
        except PeerTimeout as exc:  # a peer that does not do its part: named, as a stop line
            stop_job(comm, rank, "failed", str(exc))
        except ProtocolViolation as exc:  # the sender's fault, not this party's: no traceback
            print(f"[party {rank}] {exc}", file=sys.stderr, flush=True)
            comm.Abort(EXIT_CODES["failed"])
        except BaseException as exc:
            print(f"[party {rank}] fatal error in thread {threading.current_thread().name}: "
                  f"{exc!r}", file=sys.stderr, flush=True)
            traceback.print_exc()
            comm.Abort(EXIT_CODES["failed"])

    return run
