"""The hello: how a party proves who it is to the leader, and learns where to join, before any MPI.

The leader listens on the address its ``[[party]]`` table gives. A party connects (plain TCP, retried
until ``--join-timeout``) and the two run a short handshake of length-prefixed frames, each at most
:data:`MAX_FRAME` bytes and read under a timeout:

1. party → leader: ``{"hello", "party": its name, "nonce", "ephemeral", "digest", "resume"}``;
2. leader → party: ``{"hello", "party": the leader's name, "nonce", "ephemeral"}`` (or a refusal);
3. leader → party: ``{"mac"}``; 4. party → leader: ``{"mac"}``.

Both derive the session keys with HKDF-SHA256 from two X25519 agreements, the static one between the
keys the job file pins for the two names (authentication: only the holders of those private keys can
compute it) and one between fresh ephemeral keys (forward secrecy), salted with the hash of frames 1
and 2 (fresh nonces from both sides: no replay). Each side's MAC over that hash proves it derived the
keys; the leader speaks first, so a party never sends its proof to an impostor. From then on each
frame is sealed (ChaCha20-Poly1305, a counter per direction). The leader then compares the job
digests (on a mismatch both send their canonical job and each names the first differing field) and
the ``--resume`` flags, and later sends the MPI port name and the run's job id over the sealed
session; the MPI connection itself is bound to the session by :meth:`Session.token`.

Every frame is untrusted input: bounded, parsed as JSON (never pickled), each field checked for type
and size; a name or reason from the other side is printed escaped and cut short. Threat model and the
decisions behind it: ``docs/deployment.md``. The leader's half is :mod:`parties.federation.leader`.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from parties.federation.jobfile import Job, first_difference, split_address

PROTOCOL = "vfl-hello/1"
#: Largest frame either side accepts (a canonical job of 256 parties fits with room to spare).
MAX_FRAME = 64 * 1024
#: Seconds one connection may take for the handshake (a silent client cannot hold a handler longer).
HANDSHAKE_SECONDS = 10.0
#: Hello connections the leader handles at once; more are closed unread (a flood cannot exhaust it).
MAX_PENDING = 64
_LENGTH = struct.Struct(">I")


class HelloRefused(Exception):
    """The hello failed or was refused; the message is one line for the user."""


class FrameError(Exception):
    """A frame that is not one: EOF, oversized, not JSON, not a sealed frame, missing fields."""


# ----------------------------------------------------------------------------------------- frames


def send_frame(sock: socket.socket, data: bytes) -> None:
    if len(data) > MAX_FRAME:
        raise FrameError(f"a frame of {len(data)} bytes is over the {MAX_FRAME}-byte limit")
    try:
        sock.sendall(_LENGTH.pack(len(data)) + data)
    except OSError as err:
        raise FrameError(f"connection failed ({err.strerror or err})") from None


def recv_frame(sock: socket.socket) -> bytes:
    """One frame; its length is checked before anything is allocated."""
    (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    if length > MAX_FRAME:
        raise FrameError(f"announced a frame of {length} bytes (limit {MAX_FRAME})")
    return _recv_exactly(sock, length)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        try:
            chunk = sock.recv(min(left, 65536))
        except TimeoutError:
            raise FrameError("timed out") from None
        except OSError as err:
            raise FrameError(f"connection failed ({err.strerror or err})") from None
        if not chunk:
            raise FrameError("closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def parse(data: bytes) -> dict[str, Any]:
    """A frame's JSON object; FrameError for anything else."""
    try:
        message = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise FrameError("sent a frame that is not JSON") from None
    if not isinstance(message, dict):
        raise FrameError("sent a frame that is not a JSON object")
    return message


def field(message: dict[str, Any], key: str, kind: type, *, hex_bytes: int | None = None,
          longest: int = 256) -> Any:
    """``message[key]`` checked: of ``kind``, a string at most ``longest`` long, or exactly
    ``hex_bytes`` bytes in hex (returned as bytes)."""
    value = message.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise FrameError(f"sent no valid {key!r}")
    if isinstance(value, str):
        if hex_bytes is not None:
            if len(value) != 2 * hex_bytes:
                raise FrameError(f"sent a {key!r} that is not {hex_bytes} bytes of hex")
            try:
                return bytes.fromhex(value)
            except ValueError:
                raise FrameError(f"sent a {key!r} that is not hex") from None
        if len(value) > longest:
            raise FrameError(f"sent a {key!r} over {longest} characters")
    return value


def shown(text: Any, longest: int = 300) -> str:
    """Text from the other side, safe on one line: non-printable characters escaped, cut short."""
    text = str(text)
    safe = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text[:longest])
    return safe + ("..." if len(text) > longest else "")


# ------------------------------------------------------------------------------------------- keys


@dataclass(frozen=True)
class Keys:
    leader_mac: bytes
    party_mac: bytes
    to_party: bytes
    to_leader: bytes
    token: bytes


def derive(static_shared: bytes, ephemeral_shared: bytes, transcript: bytes) -> Keys:
    material = HKDF(algorithm=hashes.SHA256(), length=5 * 32, salt=transcript,
                    info=PROTOCOL.encode() + b" keys").derive(static_shared + ephemeral_shared)
    return Keys(*(material[i:i + 32] for i in range(0, 5 * 32, 32)))


def transcript_of(first: bytes, second: bytes) -> bytes:
    h = hashlib.sha256(PROTOCOL.encode())
    for frame in (first, second):
        h.update(_LENGTH.pack(len(frame)) + frame)
    return h.digest()


def mac(key: bytes, who: bytes, transcript: bytes) -> bytes:
    return hmac.new(key, who + transcript, hashlib.sha256).digest()


def agree(private: X25519PrivateKey, public: bytes) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:  # a low-order point: the shared secret would be all zeros
        raise FrameError("sent a public key that is not a valid X25519 point") from None


def _raw(private: X25519PrivateKey) -> bytes:
    return private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def hello_frame(name: str, nonce: bytes, ephemeral: X25519PrivateKey, **more: Any) -> bytes:
    body = {"hello": PROTOCOL, "party": name, "nonce": nonce.hex(), "ephemeral": _raw(ephemeral).hex()}
    return json.dumps({**body, **more}).encode()


class Session:
    """An authenticated hello connection: sealed JSON objects both ways, in order."""

    def __init__(self, sock: socket.socket, keys: Keys, *, leader_side: bool, peer: str,
                 address: str) -> None:
        self.sock = sock
        self.keys = keys
        self.peer = peer          # the other side's name, as the job file spells it
        self.address = address    # where its connection came from (or went to)
        send, receive = (keys.to_party, keys.to_leader) if leader_side else (keys.to_leader, keys.to_party)
        self._send, self._recv = ChaCha20Poly1305(send), ChaCha20Poly1305(receive)
        self._aad_send = b"leader->party" if leader_side else b"party->leader"
        self._aad_recv = b"party->leader" if leader_side else b"leader->party"
        self._sent = self._received = 0
        self.lock = threading.Lock()
        #: the leader's side: the party's first frame (its job digest and --resume, compared next)
        self.hello: dict[str, Any] = {}

    def send(self, message: dict[str, Any]) -> None:
        with self.lock:
            nonce = self._sent.to_bytes(12, "little")
            self._sent += 1
            send_frame(self.sock, self._send.encrypt(nonce, json.dumps(message).encode(), self._aad_send))

    def recv(self, timeout: float | None) -> dict[str, Any]:
        """The next sealed object; FrameError when it is not the next authentic one (or a plain
        ``{"refused"}`` from a leader that did not accept this party's proof: :class:`HelloRefused`)."""
        self.sock.settimeout(timeout)
        data = recv_frame(self.sock)
        try:
            plain = self._recv.decrypt(self._received.to_bytes(12, "little"), data, self._aad_recv)
        except InvalidTag:
            refusal = _plain_refusal(data)
            if refusal is not None:
                raise HelloRefused(f"the leader {self.peer} refused this party: {refusal}") from None
            raise FrameError("sent a frame that does not authenticate") from None
        self._received += 1
        return parse(plain)

    def token(self, port: str) -> bytes:
        """What the party sends over the new MPI connection to show it is the process of this session
        (the MPI port name is an address, not a secret)."""
        return hmac.new(self.keys.token, b"vfl-join/1|" + port.encode(), hashlib.sha256).digest()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def _plain_refusal(data: bytes) -> str | None:
    try:
        message = parse(data)
    except FrameError:
        return None
    reason = message.get("refused")
    return shown(reason) if isinstance(reason, str) else None


# --------------------------------------------------------------------------------- the party side


def party_hello(job: Job, rank: int, private_key: bytes, *, resume: bool, deadline: float) -> Session:
    """Connect to the leader (retrying until ``deadline``, ``time.monotonic()``), prove this party's
    key and check the leader's; the job digests are compared next (:func:`check_same_job`)."""
    me, leader = job.parties[rank], job.leader
    assert leader.address is not None
    host, port = split_address(leader.address)
    sock = _connect(host, port, deadline, f"the leader {leader.name} at {leader.address}")
    try:
        sock.settimeout(HANDSHAKE_SECONDS)
        own = X25519PrivateKey.from_private_bytes(private_key)
        ephemeral, nonce = X25519PrivateKey.generate(), os.urandom(32)
        first = hello_frame(me.name, nonce, ephemeral, digest=job.digest().hex(), resume=resume)
        send_frame(sock, first)
        second = recv_frame(sock)
        message = parse(second)
        if "refused" in message:
            raise HelloRefused(f"the leader {leader.name} refused this party: {shown(message['refused'])}")
        if field(message, "hello", str) != PROTOCOL or field(message, "party", str) != leader.name:
            raise FrameError(f"is not {leader.name} speaking {PROTOCOL}")
        field(message, "nonce", str, hex_bytes=32)
        their_ephemeral = field(message, "ephemeral", str, hex_bytes=32)
        transcript = transcript_of(first, second)
        keys = derive(agree(own, leader.public_key), agree(ephemeral, their_ephemeral), transcript)
        proof = field(parse(recv_frame(sock)), "mac", str, hex_bytes=32)
        if not hmac.compare_digest(proof, mac(keys.leader_mac, b"leader", transcript)):
            refuse(sock, "keys")
            raise HelloRefused(f"this party and the leader {leader.name} at {leader.address} do not agree on "
                               f"keys: {me.name}'s key (--key) is not the one the leader pins for it, or the "
                               f"process there does not hold the key pinned for {leader.name}; not joining")
        send_frame(sock, json.dumps({"mac": mac(keys.party_mac, b"party", transcript).hex()}).encode())
    except FrameError as err:
        sock.close()
        raise HelloRefused(f"the hello with the leader {leader.name} at {leader.address} failed: it {err}") \
            from None
    except BaseException:
        sock.close()
        raise
    return Session(sock, keys, leader_side=False, peer=leader.name, address=leader.address)


def check_same_job(session: Session, job: Job, timeout: float) -> None:
    """The leader's verdict on this party's job digest: nothing when they agree, else
    :class:`HelloRefused` naming the first differing field (this party sends its own canonical job so
    the leader can name it too)."""
    try:
        reply = session.recv(timeout)
        status = field(reply, "status", str)
        if status == "same":
            return
        if status == "differs":
            theirs = reply.get("job")
            session.send({"job": job.canonical()})
            found = first_difference(job.canonical(), theirs)
            what = ("the digest differs" if found is None
                    else f"{found[0]} is {found[1]} here, {found[2]} at {session.peer}")
            raise HelloRefused(f"this job file differs from the leader {session.peer}'s: {what}")
        if status == "refused":
            raise HelloRefused(f"the leader {session.peer} refused this party: "
                               f"{shown(field(reply, 'reason', str, longest=1000))}")
        raise FrameError(f"sent an unknown status {shown(status, 40)!r}")
    except FrameError as err:
        raise HelloRefused(f"the hello with the leader {session.peer} failed: it {err}") from None


def _connect(host: str, port: int, deadline: float, what: str) -> socket.socket:
    last = "no answer"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HelloRefused(f"{what} could not be reached before --join-timeout ({last}): is it started, "
                               "and is its port open to this host?")
        try:
            return socket.create_connection((host, port), timeout=min(left, HANDSHAKE_SECONDS))
        except OSError as err:
            last = err.strerror or str(err)
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def refuse(sock: socket.socket, reason: str) -> None:
    with contextlib.suppress(OSError, FrameError):
        send_frame(sock, json.dumps({"refused": reason}).encode())
    sock.close()


def await_turn(session: Session, deadline: float) -> tuple[str, bytes]:
    """A party waits for the leader's word: (MPI port name, job id) when its turn to connect comes;
    :class:`HelloRefused` with the leader's reason when the join ended, or when the leader is gone."""
    try:
        reply = session.recv(max(0.0, deadline - time.monotonic()))
        status = field(reply, "status", str)
        if status == "connect":
            return field(reply, "port", str, longest=1024), field(reply, "job_id", str, hex_bytes=16)
        if status == "abort":
            raise HelloRefused(f"the join ended: {shown(field(reply, 'reason', str, longest=1000))} "
                               f"(from the leader {session.peer})")
        raise FrameError(f"sent an unknown status {shown(status, 40)!r}")
    except FrameError as err:
        if "timed out" in str(err):
            raise HelloRefused(f"the leader {session.peer} gave no turn to join before the deadline") \
                from None
        raise HelloRefused(f"the join ended: the leader {session.peer} {err}") from None
