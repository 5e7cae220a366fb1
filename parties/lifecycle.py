"""How a party's job ends on purpose, and how its threads are named and guarded.

A party that finds a reason the user must read (the model diverged, a peer is silent or does not
deliver its part in time, a peer broke the protocol) ends the whole job with one line the launcher
repeats and an exit code of its own (``parties/outcomes.py``); any other exception in one of its
threads ends it too, with a traceback.

The line goes to the rank's standard error *and*, before the abort, to its verdict file
(:func:`report_verdicts_to`): ``mpiexec`` kills the other ranks within milliseconds of an abort, and
what a rank printed just before may never reach the launcher through Hydra's output forwarding (an
audit lost the naming line in 5 of 27 runs, and the launcher then named the victim). A file written
before ``Abort`` is there when ``mpiexec`` returns, whatever happened to the pipe.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from mpi4py import MPI

from parties.outcomes import EXIT_CODES, STOP_LINE
from protocols.errors import ProtocolViolation
from protocols.liveness import PeerTimeout
from protocols.masking import AggregationOverflowError

#: Why a job stops when a score cannot be aggregated.
OUT_OF_RANGE = "the scores left the secure aggregation's range: the model diverged"

#: This process's verdict file (one rank per process), set once at start by :func:`report_verdicts_to`.
_verdict_file: Path | None = None


def report_verdicts_to(path: Path | None) -> None:
    """Write this rank's verdict line, should it end the job, to ``path`` (``<out>/verdict-<rank>.txt``,
    read by :func:`parties.outcomes.read_verdicts`); None: nowhere."""
    global _verdict_file
    _verdict_file = None if path is None else Path(path)


def write_verdict(line: str) -> None:
    """The first verdict of this process, with the wall clock in ns (the launcher orders verdicts by
    it): created exclusively and without following a symlink, so a second failing thread, or a file
    planted at that path, changes nothing. Best effort: the abort must happen anyway."""
    if _verdict_file is None:
        return
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    with contextlib.suppress(OSError):
        fd = os.open(_verdict_file, flags, 0o644)
        with os.fdopen(fd, "w") as fh:
            fh.write(f"{time.time_ns()} {line}\n")


def end_job(comm: MPI.Comm, line: str, code: int) -> None:
    """End the whole job with ``line`` (its verdict file first, then standard error) and exit ``code``."""
    write_verdict(line)
    print(line, file=sys.stderr, flush=True)
    comm.Abort(code)


def stop_job(comm: MPI.Comm, rank: int, outcome: str, reason: str) -> None:
    """End the whole job for a reason the user must read (not a crash): one
    :data:`~parties.outcomes.STOP_LINE` that the launcher repeats, and the exit code of ``outcome``
    (:data:`parties.outcomes.EXIT_CODES`)."""
    end_job(comm, STOP_LINE.format(rank=rank, outcome=outcome, reason=reason), EXIT_CODES[outcome])


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
            end_job(comm, f"[party {rank}] {exc}", EXIT_CODES["failed"])
        except BaseException as exc:
            line = f"[party {rank}] fatal error in thread {threading.current_thread().name}: {exc!r}"
            write_verdict(line)
            print(line, file=sys.stderr, flush=True)
            traceback.print_exc()
            comm.Abort(EXIT_CODES["failed"])

    return run


def exit_now() -> None:
    """End this rank at once after a job that finished: flush its output, finalize MPI, then the C
    library's ``exit(0)``.

    Everything the job writes is complete by then (checkpoints and ``result.json`` are written whole and
    closed, every thread is joined), so what is skipped is only the interpreter's teardown of numba,
    scipy and their thousands of objects: 1.3 s of a q = 4 job's wall time on a loaded 2-core machine,
    0.1 s this way (``python -m experiments startup``). Not ``os._exit``: it skips the C library's exit
    handlers too, and Hydra's proxy then took 10-30 % of such exits, after a complete ``MPI_Finalize``,
    for a crash and SIGKILLed the other ranks of a job that had finished (a 3-rank job that only
    finalizes, measured here: 20 of 100 loaded runs, 0 of 300 with ``exit``; ``test_rank_exit.py``).
    A rank that fails never gets here: it aborts the job with its own exit code.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    libc = ctypes.CDLL(None)
    libc.exit(0)
    os._exit(0)  # no C library to call (not reached on Linux)
