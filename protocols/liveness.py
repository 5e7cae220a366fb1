"""Deadlines on peers: how long a party waits for what another party owes it (issue 26).

**The rule.** A party that waits for something a peer owes it (a tree sum, a barrier token, a control
word, a chunk of a list, an acknowledgement, a framed payload, a decryption) ends the job naming that
peer once the peer has *delivered nothing* for ``timeout`` seconds since the wait began. The clock
measures the peer's silence on the protocol, not the length of the exchange: every message the peer
delivers (on any plane) restarts it, so a slow peer whose messages keep coming is never cut off, while
heartbeats, which come from a thread of their own and say nothing about the protocol, do not count.

**Who is named.** When an honest party is silent because it waits for the culprit itself, both clocks
run, and the one nearer the culprit must fire first. So every wait has a *level* and its limit is
``timeout + level * stagger``: a party waits for what its peer can send without waiting for anyone (a
leaf's tree sum, a frame's payload, a decryption) at level 0, for a tree sum from a child whose subtree
has height h at level h, for a dominator's segment (``DONE``) at :attr:`Liveness.segment_level` (one
above the deepest tree) and for a barrier-time exchange at :attr:`Liveness.exchange_level` (one more).

:class:`Liveness` is one party's clock of its peers, shared by its threads and planes; :class:`Pending`
completes a set of nonblocking sends and receives under it (the control plane's exchanges, ``vfl
align``'s lists). Everything polls (``Test`` and a short, growing sleep) instead of blocking in MPI, so a
deadline can fire; the data plane's communication thread alone still blocks in ``Recv`` (its speed is
the runtime's, ``docs/runtime.md``), and its obligations are watched from the heartbeat thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from protocols.errors import ProtocolError, ProtocolViolation

if TYPE_CHECKING:  # imported where used: importing mpi4py.MPI starts MPI, which a launcher must not
    from mpi4py import MPI

__all__ = ["STAGGER_S", "STARTUP_TIMEOUT_S", "Backoff", "Liveness", "PeerTimeout", "Pending"]

#: Seconds added to a wait's limit per level (module docstring): far more than a message's latency and
#: a watchdog's tick on a loaded machine, small beside any ``--peer-timeout``.
STAGGER_S = 0.25
#: The limit of every wait before a job's runtime is up: parties load their data, compile kernels and
#: make keys at their own pace (an HE key of 3072 bits takes seconds, a large party file minutes), with
#: nothing to deliver meanwhile.
STARTUP_TIMEOUT_S = 300.0


class PeerTimeout(ProtocolError):
    """Party ``peer`` delivered nothing for ``silent`` seconds while party ``waiter`` waited for ``what``.

    ``peer`` is None for a collective call (creating a communicator), which cannot say who is missing.
    """

    def __init__(self, peer: int | None, waiter: int, what: str, silent: float, timeout: float) -> None:
        self.sender, self.waiter, self.what, self.silent, self.timeout = peer, waiter, what, silent, timeout
        who = "the other parties have" if peer is None else f"party {peer} has"
        super().__init__(f"{who} been silent for {silent:.1f} s while party {waiter} waited for {what} "
                         f"(heartbeats do not count); the limit is {timeout:g} s (--peer-timeout)")

    def __reduce__(self):
        return type(self), (self.sender, self.waiter, self.what, self.silent, self.timeout)


class Backoff:
    """Sleeps between polls: a few bare polls first (a reply is often microseconds away), then sleeps
    doubling from 20 µs to ``cap`` seconds, so a long wait costs no CPU."""

    def __init__(self, cap: float = 1e-3, spins: int = 50) -> None:
        self.cap, self.spins = cap, spins
        self._polls = 0
        self._pause = 20e-6

    def sleep(self) -> None:
        self._polls += 1
        if self._polls <= self.spins:
            return
        time.sleep(self._pause)
        self._pause = min(self._pause * 2, self.cap)


class Liveness:
    """When each peer of party ``rank`` (of ``size``) last delivered something, and the limits of waits.

    ``timeout`` (seconds, None: wait forever) may change: the runtime waits with
    :data:`STARTUP_TIMEOUT_S` until it is up, then with ``--peer-timeout``.
    """

    def __init__(self, rank: int, size: int, timeout: float | None, *, stagger: float = STAGGER_S,
                 depth: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.rank, self.size = rank, size
        self.timeout = timeout
        self.stagger = stagger
        self.clock = clock
        #: per peer, when it last delivered a protocol message (a list: the hot path writes it)
        self.heard = [clock()] * size
        #: the level of waiting for a dominator's segment: above any tree (``depth``: the deepest tree's
        #: height, at most q - 1)
        self.segment_level = (size - 1 if depth is None else depth) + 1
        #: the level of a barrier-time exchange: above a segment
        self.exchange_level = self.segment_level + 1

    def delivered(self, peer: int) -> None:
        """``peer`` delivered a protocol message just now (not a heartbeat)."""
        self.heard[peer] = self.clock()

    def limit(self, level: int) -> float:
        assert self.timeout is not None
        return self.timeout + level * self.stagger

    def check(self, owed: Mapping[int, int] | Iterable[int], since: float, what: str, level: int = 0) -> None:
        """Raise :class:`PeerTimeout` for a peer of ``owed`` (peer → level, or peers at ``level``) that
        has delivered nothing since ``since`` for longer than its limit."""
        if self.timeout is None:
            return
        now = self.clock()
        pairs = owed.items() if isinstance(owed, Mapping) else ((peer, level) for peer in owed)
        for peer, lvl in pairs:
            silent = now - max(since, self.heard[peer])
            if silent > self.limit(lvl):
                raise PeerTimeout(peer, self.rank, what, silent, self.timeout)

    def check_collective(self, since: float, what: str) -> None:
        """A collective call begun at ``since`` (every party must join; none can be named)."""
        if self.timeout is not None and self.clock() - since > self.limit(self.exchange_level):
            raise PeerTimeout(None, self.rank, what, self.clock() - since, self.timeout)

    def wait(self, done: Callable[[], bool], owed: Callable[[], Mapping[int, int] | Iterable[int]], what: str,
             *, level: int = 0, since: float | None = None) -> None:
        """Poll ``done()`` until it is true, checking ``owed()`` (see :meth:`check`) between polls."""
        since = self.clock() if since is None else since
        backoff = Backoff()
        while not done():
            self.check(owed(), since, what, level)
            backoff.sleep()

    def dup(self, comm: MPI.Comm, what: str = "the set-up of a communicator") -> MPI.Comm:
        """``comm.Dup()`` (collective) under a deadline: ``Idup`` and polling."""
        new, request = comm.Idup()
        since = self.clock()
        backoff = Backoff()
        while not request.Test():
            self.check_collective(since, what)
            backoff.sleep()
        return new


class Pending:
    """Nonblocking sends and exact-size receives on ``comm``, completed together under ``liveness``.

    :meth:`recv` posts a receive into a buffer of exactly the size expected; a longer or shorter message
    is its sender's fault (:class:`~protocols.errors.ProtocolViolation` naming it). :meth:`wait` polls
    every request until all are complete; a peer that neither sends what is awaited from it nor takes
    what is sent to it ends the wait with :class:`PeerTimeout` (``what`` names the exchange, ``level``
    its place in the waits, see the module docstring). Each completed receive counts as a delivery.
    """

    def __init__(self, comm: MPI.Comm, liveness: Liveness, what: str, level: int = 0) -> None:
        from mpi4py import MPI

        self.comm, self.liveness, self.what, self.level = comm, liveness, what, level
        self._open: list[tuple[MPI.Request, int, np.ndarray, bool, str]] = []
        self._status = MPI.Status()
        #: a buffer the caller hangs here (``parties.align`` keeps a list's pieces in one)
        self.buffer: np.ndarray | None = None

    def recv(self, buf: np.ndarray, source: int, tag: int, what: str | None = None) -> np.ndarray:
        from mpi4py import MPI

        request = self.comm.Irecv([buf, MPI.BYTE], source, tag)
        self._open.append((request, source, buf, True, what or self.what))
        return buf

    def send(self, buf: np.ndarray, dest: int, tag: int) -> None:
        from mpi4py import MPI

        self._open.append((self.comm.Isend([buf, MPI.BYTE], dest, tag), dest, buf, False, self.what))

    def poll(self) -> bool:
        """Complete what has arrived, without waiting; whether everything is complete."""
        from mpi4py import MPI

        still = []
        for item in self._open:
            request, peer, buf, receiving, what = item
            try:
                done = request.Test(self._status)
            except MPI.Exception as error:
                if error.Get_error_class() != MPI.ERR_TRUNCATE:
                    raise
                raise ProtocolViolation(peer, what, f"longer than the {buf.nbytes} bytes expected") from None
            if not done:
                still.append(item)
            elif receiving:
                got = self._status.Get_count(MPI.BYTE)
                if got != buf.nbytes:
                    raise ProtocolViolation(peer, what, f"{got} bytes, expected {buf.nbytes}")
                self.liveness.delivered(peer)
        self._open = still
        return not still

    def owed(self) -> dict[int, int]:
        return {peer: self.level for _, peer, _, _, _ in self._open}

    def wait(self, since: float | None = None) -> None:
        """Poll until every send and receive is complete (see the class docstring)."""
        label = self.what if self.what.startswith(("its ", "the ", "a ")) else f"its {self.what}"
        self.liveness.wait(self.poll, self.owed, label, since=since)
