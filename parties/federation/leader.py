"""The leader's half of the hello (:mod:`parties.federation.hello`): authenticating each incoming
party, checking it runs the same job, and waiting until every party of the job has arrived.

Each connection is handled in its own thread, bounded in number and in time, so a flood of
connections or a silent client cannot stop the leader from hearing the real parties; everything a
connection sends is untrusted input (bounded frames, checked fields, escaped names).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import socket
import threading
import time
from typing import Any

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from parties.federation.hello import (
    HANDSHAKE_SECONDS,
    MAX_PENDING,
    PROTOCOL,
    FrameError,
    HelloRefused,
    Session,
    agree,
    derive,
    field,
    hello_frame,
    mac,
    parse,
    recv_frame,
    refuse,
    send_frame,
    shown,
    transcript_of,
)
from parties.federation.jobfile import Job, first_difference


class Refused(Exception):
    """A hello the leader refused: ``claimed`` is the name it gave (escaped), the message says why."""

    def __init__(self, claimed: str, line: str) -> None:
        super().__init__(line)
        self.claimed = claimed


def leader_handshake(sock: socket.socket, address: str, job: Job, private_key: bytes) -> Session:
    """Authenticate one incoming hello (the leader's half of :func:`party_hello`); :class:`Refused`
    naming the claimed party and the address when it cannot prove the key pinned for its name."""
    claimed = "?"
    try:
        sock.settimeout(HANDSHAKE_SECONDS)
        first = recv_frame(sock)
        message = parse(first)
        if field(message, "hello", str) != PROTOCOL:
            raise FrameError(f"does not speak {PROTOCOL}")
        claimed = shown(field(message, "party", str, longest=64), 64)
        names = [p.name for p in job.parties[1:]]
        if claimed not in names:
            refuse(sock, f"no party named {claimed!r} joins this job")
            raise Refused(claimed, f"refused a hello from {address} claiming to be {claimed!r}: no party of "
                                   "that name in the job file")
        field(message, "nonce", str, hex_bytes=32)
        their_ephemeral = field(message, "ephemeral", str, hex_bytes=32)
        field(message, "digest", str, hex_bytes=32)
        field(message, "resume", bool)
        party = job.parties[job.rank_of(claimed)]
        ephemeral, nonce = X25519PrivateKey.generate(), os.urandom(32)
        second = hello_frame(job.leader.name, nonce, ephemeral)
        send_frame(sock, second)
        transcript = transcript_of(first, second)
        own = X25519PrivateKey.from_private_bytes(private_key)
        keys = derive(agree(own, party.public_key), agree(ephemeral, their_ephemeral), transcript)
        send_frame(sock, json.dumps({"mac": mac(keys.leader_mac, b"leader", transcript).hex()}).encode())
        answer = parse(recv_frame(sock))
        if "refused" in answer:  # it could not check the leader's proof: the keys do not agree
            sock.close()
            raise Refused(claimed, f"refused a hello from {address} claiming to be {claimed!r}: the keys do "
                                   f"not agree (it does not hold the key pinned here for {claimed}, or does "
                                   f"not pin {job.leader.name}'s)")
        proof = field(answer, "mac", str, hex_bytes=32)
        if not hmac.compare_digest(proof, mac(keys.party_mac, b"party", transcript)):
            refuse(sock, "authentication failed")
            raise Refused(claimed, f"refused a hello from {address} claiming to be {claimed!r}: it does not "
                                   f"hold the key the job file pins for {claimed}")
    except FrameError as err:
        sock.close()
        line = f"refused a hello from {address} claiming to be {claimed!r}: it {err}"
        raise Refused(claimed, line) from None
    session = Session(sock, keys, leader_side=True, peer=claimed, address=address)
    session.hello = message
    return session


class JoinFailed(Exception):
    """The join ended for every party; the message is the one line each of them prints."""


class HelloServer:
    """The leader's listener: each incoming hello is authenticated in its own thread (at most
    :data:`MAX_PENDING` at once, each bounded by :data:`HANDSHAKE_SECONDS`) until every party of the
    job has joined, the deadline passes, or a party turns out to run another job.

    A refused hello (unknown name, wrong key, garbage) is reported through ``log`` at once, and the
    leader keeps waiting for the real party until the deadline: a stranger cannot end the join, and a
    party whose key is wrong is named when time runs out, with the refusals of its name attached.
    """

    def __init__(self, job: Job, private_key: bytes, bind: tuple[str, int], *, resume: bool,
                 log: Any = print) -> None:
        self.job, self.resume, self.log = job, resume, log
        self._private = private_key
        self._canonical = job.canonical()
        self._digest = job.digest()
        self.listener = socket.create_server(bind, backlog=MAX_PENDING)
        self.listener.settimeout(0.2)
        self.sessions: dict[str, Session] = {}
        self.refusals: dict[str, list[str]] = {}
        self.fatal: str | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._slots = threading.BoundedSemaphore(MAX_PENDING)
        self._thread = threading.Thread(target=self._serve, name="hello-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, peer = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                conn.close()
                continue
            address = f"{peer[0]}:{peer[1]}"
            threading.Thread(target=self._handle, args=(conn, address), daemon=True,
                             name=f"hello-{address}").start()

    def _handle(self, conn: socket.socket, address: str) -> None:
        try:
            session = leader_handshake(conn, address, self.job, self._private)
        except Refused as refused:
            with self._cond:
                self.refusals.setdefault(refused.claimed, []).append(str(refused))
            self.log(str(refused))
            return
        except Exception as err:
            conn.close()
            self.log(f"refused a hello from {address}: {shown(repr(err))}")
            return
        finally:
            self._slots.release()
        try:
            self._admit(session)
        except FrameError as err:
            session.close()
            self.log(f"dropped {session.peer} ({address}) during the hello: it {err}")

    def _admit(self, session: Session) -> None:
        name, hello = session.peer, session.hello
        if bytes.fromhex(hello["digest"]) != self._digest:
            session.send({"status": "differs", "job": self._canonical})
            try:
                theirs = session.recv(HANDSHAKE_SECONDS).get("job")
            except (FrameError, HelloRefused):
                theirs = None
            session.close()
            found = first_difference(self._canonical, theirs)
            what = ("its job digest differs" if found is None
                    else f"{found[0]} is {found[2]} at {name}, {found[1]} at {self.job.leader.name}")
            self._fail(f"{name} runs another job than the leader {self.job.leader.name}: {what}")
            return
        if hello["resume"] != self.resume:
            def started(flag: bool) -> str:
                return "with" if flag else "without"
            reason = (f"{name} was started {started(hello['resume'])} --resume, the leader "
                      f"{self.job.leader.name} {started(self.resume)}: every party resumes, or none")
            session.send({"status": "refused", "reason": reason})
            session.close()
            self._fail(reason)
            return
        with self._cond:
            if self._closed or self.fatal is not None:
                session.close()
                return
            if name in self.sessions:
                session.send({"status": "refused", "reason": f"{name} has joined already"})
                session.close()
                self.log(f"refused a second hello of {name} from {session.address}: {name} has joined "
                         f"already (from {self.sessions[name].address})")
                return
            self.sessions[name] = session
            session.send({"status": "same"})
            self._cond.notify_all()
        self.log(f"{name} joined the hello from {session.address}")

    def _fail(self, line: str) -> None:
        with self._cond:
            if self.fatal is None:
                self.fatal = line
            self._cond.notify_all()

    def wait(self, deadline: float, timeout: float) -> list[Session]:
        """Every other party's session, in rank order, once all have joined; :class:`JoinFailed`
        naming the parties missing at ``deadline`` (``time.monotonic()``), or the one that runs
        another job. The listener is closed either way: later hellos are refused by the system."""
        names = [p.name for p in self.job.parties[1:]]
        with self._cond:
            while self.fatal is None and len(self.sessions) < len(names):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            self._closed = True
            fatal, missing = self.fatal, [n for n in names if n not in self.sessions]
            refusals = {n: list(self.refusals.get(n, ())) for n in missing}
        self.listener.close()
        if fatal is not None:
            raise JoinFailed(fatal)
        if missing:
            notes = "".join(f"; {line}" for n in missing for line in refusals[n][:2])
            raise JoinFailed(f"{' and '.join(missing)} did not join within {timeout:g} s (--join-timeout)"
                             f"{notes}")
        return [self.sessions[n] for n in names]

    def abort_all(self, line: str) -> None:
        """Tell every party in the hello that the join ended, and why (best effort)."""
        with self._cond:
            self._closed = True
            sessions = list(self.sessions.values())
        for session in sessions:
            with contextlib.suppress(FrameError, OSError):
                session.send({"status": "abort", "reason": line})
            session.close()
        with contextlib.suppress(OSError):
            self.listener.close()


