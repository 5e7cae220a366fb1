"""The join: from separately started processes to one intracommunicator in the job file's rank order.

Each party runs under its own ``mpiexec -n 1``, so each is its own MPI world. The leader opens an MPI
port (``MPI.Open_port``) before its hello (:mod:`parties.federation.hello`) and, once every party has
proved its key and agreed on the job, lets them in one at a time, in rank order: it sends party r the
port name over r's sealed hello session; the group joined so far (leader and parties 1..r−1) calls
``Accept`` together (it is collective over the accepting group), party r calls ``Connect`` alone, and
both sides ``Merge`` the intercommunicator. Before the merge, party r sends over the new connection a
token that only the process of r's authenticated hello session can compute (the port name is an
address, anyone who reaches it may connect): a process that connects in r's turn without it ends the
join, named. A last ``Split(0, key=rank)`` makes the rank order the job file's by construction.

Nothing here can wait forever: the leader's watchdog ends the join for everyone (one line, over every
hello session, then exit) when a party does not connect in its turn or leaves during the join; a
party's watchdog ends it when the leader says so or goes away. Exit code 1 with the line on stderr.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import select
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from parties.federation.hello import (
    HANDSHAKE_SECONDS,
    FrameError,
    HelloRefused,
    Session,
    await_turn,
    check_same_job,
    field,
    party_hello,
    shown,
)
from parties.federation.jobfile import Job
from parties.federation.leader import HelloServer, JoinFailed

#: Seconds a party has to connect to the MPI port once its turn came (and the leader to accept it).
ROUND_SECONDS = 30.0
#: MPI tag of the join token on the new intercommunicator.
JOIN_TAG = 7707
TOKEN_BYTES = 32


@dataclass
class Joined:
    """What a join gives a party: the communicator in rank order, the run's job id, and the open
    hello sessions (the leader: every party's; a party: its one with the leader)."""

    comm: MPI.Intracomm
    job_id: bytes
    sessions: list[Session]


def end_now(line: str, code: int = 1) -> None:
    """Print the one line and leave at once: an MPI finalize could wait on a half-made connection."""
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


# ----------------------------------------------------------------------------------------- leader


def lead(job: Job, private_key: bytes, bind: tuple[str, int], *, resume: bool, timeout: float,
         log: Callable[[str], None], fail: Callable[[str], None] = end_now) -> Joined:
    """The leader's join: the joined communicator (this party rank 0), the run's fresh job id and the
    parties' sessions (kept open: :mod:`parties.federation.runline`); on a failure every party in the
    hello gets the line, and ``fail`` is called with it."""
    started = time.monotonic()
    port = MPI.Open_port()
    job_id = os.urandom(16)
    try:
        server = HelloServer(job, private_key, bind, resume=resume, log=log)
    except OSError as err:
        MPI.Close_port(port)
        raise HelloRefused(f"cannot listen for the hello on {bind[0]}:{bind[1]} ({err.strerror or err}); "
                           "pass --listen HOST:PORT for an address of this host") from None
    try:
        sessions = server.wait(started + timeout, timeout)
    except JoinFailed as err:
        server.abort_all(f"{err}")
        fail(f"the join ended: {err}")
        raise
    helloed = time.monotonic()
    watchdog = _LeaderWatchdog(server, sessions, fail)
    group: MPI.Intracomm = MPI.COMM_SELF
    for session in sessions:
        deadline = max(started + timeout, time.monotonic() + ROUND_SECONDS)
        watchdog.expect(session.peer, deadline)
        try:
            session.send({"status": "connect", "port": port, "job_id": job_id.hex()})
        except FrameError:
            line = f"{session.peer} left during the join (its hello connection closed)"
            watchdog.fail_join(line)
            raise JoinFailed(line) from None
        inter = group.Accept(port, root=0)
        if not _token_ok(inter, session.token(port), deadline):
            line = (f"the process that connected to the MPI port in {session.peer}'s turn did not prove it "
                    f"is {session.peer} (whose hello came from {session.address})")
            watchdog.fail_join(line)
            raise JoinFailed(line)
        group = inter.Merge(high=False)
    comm = group.Split(0, key=0)
    watchdog.stop()
    for session in sessions:
        with contextlib.suppress(FrameError):  # a party gone by now is the run line's to notice
            session.send({"status": "joined"})
    MPI.Close_port(port)
    done = time.monotonic()
    log(f"joined {len(job.parties)} parties in {done - started:.2f} s (the last hello "
        f"{helloed - started:.2f} s after this party listened, then the MPI join {done - helloed:.2f} s)")
    return Joined(comm, job_id, sessions)


def _token_ok(inter: MPI.Intercomm, expected: bytes, deadline: float) -> bool:
    """The token on the new connection is the one of the session whose turn it is (at most 64 bytes
    are received: a longer message is a truncation error, refused like a wrong token)."""
    buf = np.zeros(2 * TOKEN_BYTES, dtype=np.uint8)
    status = MPI.Status()
    try:
        request = inter.Irecv([buf, MPI.BYTE], source=0, tag=JOIN_TAG)
        while not request.Test(status):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
    except MPI.Exception:
        return False
    count = status.Get_count(MPI.BYTE)
    return count == TOKEN_BYTES and hmac.compare_digest(buf[:TOKEN_BYTES].tobytes(), expected)


class _LeaderWatchdog:
    """While the leader accepts the parties one by one: ends the join for everyone if the party whose
    turn it is does not connect by its deadline, or if any party's hello connection closes or speaks
    (a party says nothing between its hello and the end of the join)."""

    def __init__(self, server: HelloServer, sessions: list[Session], fail: Callable[[str], None]) -> None:
        self._server, self._sessions, self._fail = server, sessions, fail
        self._turn: tuple[str, float] | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="join-watchdog", daemon=True)
        self._thread.start()

    def expect(self, name: str, deadline: float) -> None:
        self._turn = (name, deadline)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def fail_join(self, line: str) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._done.set()
            self._server.abort_all(line)
            self._fail(f"the join ended: {line}")

    def _watch(self) -> None:
        socks = {s.sock: s for s in self._sessions}
        while not self._done.wait(0.05):
            turn = self._turn
            if turn is not None and time.monotonic() > turn[1]:
                self.fail_join(f"{turn[0]} did not connect to the MPI port within {ROUND_SECONDS:g} s of its "
                               "turn")
                return
            try:
                readable, _, _ = select.select(list(socks), [], [], 0)
            except (OSError, ValueError):
                readable = list(socks)
            if readable and not self._done.is_set():
                session = socks[readable[0]]
                self.fail_join(f"{session.peer} left during the join (its hello connection closed)")
                return


# ------------------------------------------------------------------------------------------ party


def follow(job: Job, rank: int, private_key: bytes, *, resume: bool, timeout: float,
           log: Callable[[str], None], fail: Callable[[str], None] = end_now) -> Joined:
    """A party's join: hello, same job, its turn, ``Connect`` and the remaining rounds; returns the
    joined communicator (this party at its job-file rank), the run's job id and its session with the
    leader (kept open: :mod:`parties.federation.runline`)."""
    leader = job.leader.name
    session = party_hello(job, rank, private_key, resume=resume, deadline=time.monotonic() + timeout)
    check_same_job(session, job, HANDSHAKE_SECONDS)
    log(f"the leader {leader} authenticated this party and runs the same job; waiting for the others")
    q = len(job.parties)
    port, job_id = await_turn(session, time.monotonic() + timeout + q * ROUND_SECONDS)
    watchdog = _PartyWatchdog(session, time.monotonic() + q * ROUND_SECONDS, fail)
    inter = MPI.COMM_SELF.Connect(port)
    inter.Send([np.frombuffer(session.token(port), dtype=np.uint8), MPI.BYTE], dest=0, tag=JOIN_TAG)
    group = inter.Merge(high=True)
    while group.Get_size() < q:
        group = group.Accept(port, root=0).Merge(high=False)
    comm = group.Split(0, key=rank)
    watchdog.joined()
    return Joined(comm, job_id, [session])


class _PartyWatchdog:
    """While a party joins: waits on its hello session for the leader's "joined"; an "abort" (the
    leader's line), the session closing, or no "joined" by the deadline ends this party."""

    def __init__(self, session: Session, deadline: float, fail: Callable[[str], None]) -> None:
        self._session, self._deadline, self._fail = session, deadline, fail
        self._joined = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="join-watchdog", daemon=True)
        self._thread.start()

    def joined(self) -> None:
        """Wait for the leader's "joined" (it follows the last Split at once)."""
        self._thread.join(timeout=max(0.0, self._deadline - time.monotonic()) + 1.0)

    def _watch(self) -> None:
        leader = self._session.peer
        try:
            reply = self._session.recv(max(0.1, self._deadline - time.monotonic()))
            status = field(reply, "status", str)
            if status == "joined":
                self._joined.set()
                return
            if status == "abort":
                reason = shown(field(reply, "reason", str, longest=1000))
                line = f"the join ended: {reason} (from the leader {leader})"
            else:
                line = f"the join ended: the leader {leader} sent an unknown status {shown(status, 40)!r}"
        except (FrameError, HelloRefused) as err:
            line = (f"the join ended: the leader {leader} did not finish the join in time"
                    if "timed out" in str(err) else f"the join ended: the leader {leader} {err}")
        self._fail(line)
