"""The dominator's decryptions in a process of its own (``--label-privacy he``).

HEU holds the GIL for a whole call, so in the dominator's process every decryption of a passive
party's masked gradient (its communication thread) stopped the dominated loop, whose encryptions of ϑ
are the job's serial path; on a loaded machine a decryption call waits for cores while holding the GIL,
and the measured epoch was mostly that wait (docs/label-privacy.md, "Where an epoch's time goes").
:class:`KeyProcess` is a :class:`~protocols.label_he.LabelKey` whose key pair is generated in, and never
leaves, a child process (a plain ``subprocess`` with two pipes: nothing is forked from the MPI rank),
started by protocols/label_he_key_spawn.py as early in the rank as its plan allows; the parent encrypts
with the public key and sends each reply's bytes to the child to decrypt, waiting on a pipe read, which
releases the GIL.

The child (:func:`main`, started by label_he_key_spawn.py) checks every
payload as :meth:`LabelKey.decrypt` does (length, parse, count) before the library decrypts it, and
answers a failure with its one-line reason, which the parent raises as the
:class:`~protocols.errors.ProtocolViolation` naming the sender. Frames: a request is ``[most, text
length, payload length]`` (u64 each), then ``what`` and ``why`` joined by a newline, then the payload;
an answer ``[status, length]``, then the values as signed fixed-width integers (status 0) or the
reason in UTF-8 (status 1). The child ends when its input closes,
i.e. when the rank ends however it ends.
"""

from __future__ import annotations

import collections
import os
import struct
import threading

from protocols import label_he
from protocols.errors import ProtocolViolation
from protocols.label_he_key_spawn import Child, take

_HEADER = struct.Struct("<QQ")
_REQUEST = struct.Struct("<QQQ")
_OK, _REFUSED = 0, 1


def _read_exactly(fd: int, size: int) -> bytes | None:
    """``size`` bytes from ``fd``, or None at end of input."""
    parts, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _value_bytes(key_bits: int) -> int:
    """Bytes of one decrypted value, signed: a plaintext is below n in magnitude."""
    return key_bits // 8 + 1


class _Slot:
    """One request's place in line for its answer."""
    answer: tuple[int, bytes] | None = None


class KeyProcess(label_he.LabelKey):
    """A dominator's key whose secret half lives in a child process (module doc); encrypts here."""

    def __init__(self, scheme: str = "ou", key_bits: int = 2048, child: Child | None = None) -> None:
        """A key of ``child`` (label_he_key_spawn.py), by default the one this rank started early, else
        a new one; waits for its public half."""
        if scheme not in label_he.SCHEMES or key_bits not in label_he.KEY_BITS:
            raise ValueError(f"HE scheme must be one of {label_he.SCHEMES} with {label_he.KEY_BITS} bits, "
                             f"got {scheme!r} with {key_bits}")
        self._child, self._to_child, self._from_child = child if child is not None else take(scheme, key_bits)
        #: requests go out under one lock, answers come back in the same order under another: several
        #: may be in flight (one per decryption thread), so the child always has the next one queued
        self._write_lock, self._read_lock = threading.Lock(), threading.Lock()
        self._waiting: collections.deque[_Slot] = collections.deque()
        status, public = self._answer()
        if status != _OK:
            raise RuntimeError(f"the HE key process did not start: {public.decode(errors='replace')}")
        hnp, phe = label_he._heu()
        self.scheme, self.key_bits = scheme, key_bits
        self._kit = hnp.setup(phe.PublicKey.load_from(public))
        self._encoder = phe.IntegerEncoder(label_he._schema(scheme), 1)
        self._big = phe.BigintEncoder(label_he._schema(scheme))
        self._encryptor = self._kit.encryptor()
        self._modulus = label_he.paillier_modulus(self._kit.public_key()) if scheme == "paillier" else None
        if scheme == "paillier" and self._modulus is None:
            raise RuntimeError("HEU's Paillier key does not describe its modulus as expected")

    def _answer(self) -> tuple[int, bytes]:
        header = _read_exactly(self._from_child, _HEADER.size)
        body = None if header is None else _read_exactly(self._from_child, _HEADER.unpack(header)[1])
        if body is None:
            raise RuntimeError(f"the HE key process ended (exit code {self._child.poll()})")
        return _HEADER.unpack(header)[0], body

    def decrypt(self, source: int, payload: bytes, most: int, what: str, why: str) -> list:
        """:meth:`LabelKey.decrypt`, done by the child: the same checks, the same refusals."""
        text, slot = f"{what}\n{why}".encode(), _Slot()
        with self._write_lock:
            self._waiting.append(slot)
            view = memoryview(_REQUEST.pack(most, len(text), len(payload)) + text + payload)
            while view:
                view = view[os.write(self._to_child, view):]
        with self._read_lock:  # whoever reads hands each answer to the oldest request
            while slot.answer is None:
                self._waiting.popleft().answer = self._answer()
        status, body = slot.answer
        if status != _OK:
            raise ProtocolViolation(source, "masked gradient", body.decode(errors="replace"))
        width = _value_bytes(self.key_bits)
        return [int.from_bytes(body[i:i + width], "little", signed=True) for i in range(0, len(body), width)]


def _decrypt(key: label_he.LabelKey, payload: bytes, most: int, what: str, why: str) -> tuple[int, bytes]:
    """The child's answer to one request: :meth:`LabelKey.decrypt`'s checks and decryption."""
    try:
        values = key.decrypt(-1, payload, most, what, why)
    except ProtocolViolation as err:
        return _REFUSED, err.detail.encode()
    width = _value_bytes(key.key_bits)
    return _OK, b"".join(int(v).to_bytes(width, "little", signed=True) for v in values)


def main(argv: list[str]) -> None:
    """The child: a key pair, its public half to the parent, then one answer per request until EOF."""
    read_fd, write_fd, scheme, key_bits = int(argv[0]), int(argv[1]), argv[2], int(argv[3])

    def send(status: int, body: bytes) -> None:
        data = memoryview(_HEADER.pack(status, len(body)) + body)
        while data:
            data = data[os.write(write_fd, data):]

    try:
        key = label_he.LabelKey(scheme, key_bits)
    except ValueError as err:  # a scheme or size the parent's plan had wrong: its start reports it
        send(_REFUSED, str(err).encode())
        return
    send(_OK, key.public_bytes())
    while (header := _read_exactly(read_fd, _REQUEST.size)) is not None:
        most, text_length, length = _REQUEST.unpack(header)
        text, payload = _read_exactly(read_fd, text_length), _read_exactly(read_fd, length)
        if text is None or payload is None:
            return
        what, why = text.decode().split("\n", 1)
        send(*_decrypt(key, payload, int(most), what, why))

