"""The run line: the hello sessions stay open during training, so a party that dies ends the run.

Under one ``mpiexec``, Hydra kills every rank when one dies. Joined parties have no common launcher,
and MPICH's OFI/tcp netmod, asked to send to a process that is gone, can block inside libfabric's
reconnect while holding MPICH's lock (measured: the heartbeat thread stuck in ``connect`` under
``MPI_Isend``, every other MPI call of the party waiting), so the runtime's own ``--peer-timeout``
never fires. The sealed hello session of each party to the leader is kept instead, with TCP
keepalive: when a party's process ends, the kernel closes its connection, the leader learns it at once
and tells every other party, and each ends with one line naming the party (its checkpoints are
whole: they are written atomically). When the leader's process ends, every party sees its connection
close. At the end of a run both sides say "done" before closing, so a normal end is not a death.

A frozen (stopped) party keeps its connection open: that is still the runtime's heartbeats' case.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Callable

from parties.federation.hello import FrameError, HelloRefused, Session, field, shown

#: TCP keepalive on the run line: a host that vanishes without closing (power, network) is noticed
#: after about IDLE + INTERVAL·COUNT seconds.
KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 10, 5, 3


def keep_alive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        if hasattr(socket, name):  # Linux; elsewhere the system's keepalive timing
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class LeaderLine:
    """The leader's side: watches every party's session; a party whose connection closes (or that
    sends anything but "done") ends the run for everyone, named."""

    def __init__(self, sessions: list[Session], ranks: dict[str, int], fail: Callable[[str], None]) -> None:
        self._sessions, self._ranks, self._fail = sessions, ranks, fail
        self._finishing = threading.Event()
        self._done: set[str] = set()
        for session in sessions:
            session.sock.settimeout(None)
            keep_alive(session.sock)
        self._thread = threading.Thread(target=self._watch, name="run-line", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        by_sock = {s.sock: s for s in self._sessions}
        while by_sock and not self._finishing.is_set():
            try:
                readable, _, _ = select.select(list(by_sock), [], [], 0.2)
            except (OSError, ValueError):
                return  # closed by finish()
            for sock in readable:
                session = by_sock.pop(sock)
                try:
                    said = field(session.recv(5.0), "status", str)
                except (FrameError, HelloRefused):
                    said = None
                if said == "done":
                    self._done.add(session.peer)
                    continue
                if self._finishing.is_set():
                    return
                self._end(f"{session.peer} (party {self._ranks[session.peer]}) left the run: its process "
                          "ended or its host became unreachable (its connection to the leader closed)")
                return

    def _end(self, line: str) -> None:
        for session in self._sessions:
            with contextlib.suppress(FrameError, OSError):
                session.send({"status": "abort", "reason": line})
        self._fail(f"the run ended: {line}")

    def finish(self) -> None:
        """The run is over at every party (after the last collective): say "done" and close."""
        self._finishing.set()
        self._thread.join(timeout=1.0)
        for session in self._sessions:
            with contextlib.suppress(FrameError, OSError):
                session.send({"status": "done"})
            session.close()


class PartyLine:
    """A party's side: the leader's "abort" (with the line) or its connection closing ends this party."""

    def __init__(self, session: Session, fail: Callable[[str], None]) -> None:
        self._session, self._fail = session, fail
        self._finishing = threading.Event()
        session.sock.settimeout(None)
        keep_alive(session.sock)
        self._thread = threading.Thread(target=self._watch, name="run-line", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        leader = self._session.peer
        try:
            reply = self._session.recv(None)
            status = field(reply, "status", str)
            if status == "done":
                return
            if status == "abort":
                reason = shown(field(reply, "reason", str, longest=1000))
                line = f"the run ended: {reason} (from the leader {leader})"
            else:
                line = f"the run ended: the leader {leader} sent an unknown status {shown(status, 40)!r}"
        except (FrameError, HelloRefused, OSError):
            if self._finishing.is_set():
                return
            line = (f"the run ended: the leader {leader} left the run: its process ended or its host became "
                    "unreachable (its connection closed)")
        if not self._finishing.is_set():
            self._fail(line)

    def finish(self) -> None:
        """The run is over at every party: say "done", wait briefly for the leader's, close."""
        self._finishing.set()
        with contextlib.suppress(FrameError, OSError):
            self._session.send({"status": "done"})
        self._thread.join(timeout=2.0)
        self._session.close()
