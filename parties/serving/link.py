"""The leader's local link: its HTTP front (:mod:`parties.serving.supervisor`) and the MPI process of one
federation (:mod:`parties.serving.federated`), over a Unix socket in the leader's own folder.

Both ends belong to the same organisation, so the link is trusted, yet it carries buffers only (no
pickle) and every frame is checked where it is read: a frame is ``[kind u32, length u32, payload]``,
its length bounded before anything is allocated. The front sends ``SCORE`` (int64 ids) and ``STOP``;
the federation's process says ``READY`` once the federation is formed (a u32: the model's class count
C, 1 for a model that answers one score per id: a linear block, or a network of two classes), then
answers each request with ``SCORES`` (2n float64: the n scores, then 1/0 whether every party holds the
id) or, for C > 2, ``CLASSES`` (n·(C+1) float64: the n held flags, then each id's C probabilities),
and says ``DOWN`` or ``EXCLUDED`` (one UTF-8 line naming the party at fault) just before it ends. An
answer whose size does not fit the request and C, a flag not 0/1 or a value not finite is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading

import numpy as np

READY, SCORE, SCORES, DOWN, EXCLUDED, STOP, CLASSES = 1, 2, 3, 4, 5, 6, 7
KINDS = (READY, SCORE, SCORES, DOWN, EXCLUDED, STOP, CLASSES)
#: a line (DOWN, EXCLUDED) is at most this many bytes
LINE_BYTES = 4096
#: the most classes a served model may have (a READY that says more is refused)
MAX_CLASSES = 1 << 10
_HEADER = struct.Struct("<II")
_CLASS_COUNT = struct.Struct("<I")


class LinkError(RuntimeError):
    """A frame that is not one (unknown kind, length out of range, a closed link)."""


def frame(kind: int, payload: bytes = b"") -> bytes:
    return _HEADER.pack(kind, len(payload)) + payload


def line_frame(kind: int, line: str) -> bytes:
    return frame(kind, line.encode("utf-8", "replace")[:LINE_BYTES])


def check_header(header: bytes, limit: int) -> tuple[int, int]:
    """``(kind, length)`` of a header, refused when the kind is unknown or the length over ``limit``."""
    kind, length = _HEADER.unpack(header)
    if kind not in KINDS:
        raise LinkError(f"unknown frame kind {kind}")
    bound = LINE_BYTES if kind in (DOWN, EXCLUDED) else limit
    if (length > bound or (kind == STOP and length) or (kind == READY and length != _CLASS_COUNT.size)
            or (kind in (SCORE, SCORES, CLASSES) and length % 8)):
        raise LinkError(f"a frame of kind {kind} with {length} bytes")
    return kind, length


def ids_of(payload: bytes, max_batch: int) -> np.ndarray:
    ids = np.frombuffer(payload, dtype=np.int64)
    if not 1 <= ids.size <= max_batch:
        raise LinkError(f"a request of {ids.size} ids (1 to {max_batch})")
    return ids


def ready_frame(classes: int) -> bytes:
    """READY, with the model's class count C (1: one score per id)."""
    return frame(READY, _CLASS_COUNT.pack(classes))


def classes_of_ready(payload: bytes) -> int:
    """C of a READY frame: 1, or 3 to :data:`MAX_CLASSES` (two classes are answered as one score)."""
    (classes,) = _CLASS_COUNT.unpack(payload)
    if not (classes == 1 or 3 <= classes <= MAX_CLASSES):
        raise LinkError(f"a READY frame for {classes} classes (1, or 3 to {MAX_CLASSES})")
    return classes


def answer_bytes(max_batch: int, classes: int) -> int:
    """The longest answer to a request of up to ``max_batch`` ids from a model of C = ``classes``."""
    return 8 * max_batch * (classes + 1)


def _checked_held(values: np.ndarray, n: int, per_id: int) -> np.ndarray:
    """The held flags of an answer (the last n values of SCORES, the first n of CLASSES), each exactly
    0 or 1, once its size fits and every value is finite."""
    if values.size != (per_id + 1) * n:
        raise LinkError(f"{values.size} values answer a request of {n} ids ({per_id} per id and a flag)")
    if not np.all(np.isfinite(values)):
        raise LinkError("an answer holds a value that is not finite")
    flags = values[n:] if per_id == 1 else values[:n]
    if not np.all((flags == 0.0) | (flags == 1.0)):
        raise LinkError("an answer's held flag is neither 0 nor 1")
    return flags == 1.0


def scores_of(payload: bytes, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(z, held)`` of a SCORES frame answering a request of ``n`` ids."""
    values = np.frombuffer(payload, dtype=np.float64)
    held = _checked_held(values, n, 1)
    return np.where(held, values[:n], np.nan), held


def scores_frame(z: np.ndarray, held: np.ndarray) -> bytes:
    return frame(SCORES, np.concatenate([np.where(held, z, 0.0), held.astype(np.float64)]).tobytes())


def classes_of(payload: bytes, n: int, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """``(probabilities (n, C), held)`` of a CLASSES frame answering ``n`` ids of a model of C =
    ``classes`` (NaN rows where an id is not held)."""
    values = np.frombuffer(payload, dtype=np.float64)
    held = _checked_held(values, n, classes)
    proba = values[n:].reshape(n, classes).copy()
    proba[~held] = np.nan
    return proba, held


def classes_frame(probabilities: np.ndarray, held: np.ndarray) -> bytes:
    values = np.where(held[:, None], probabilities, 0.0)
    return frame(CLASSES, np.concatenate([held.astype(np.float64), values.ravel()]).tobytes())


class ProcessEnd:
    """The federation's end of the link (blocking; sends from any thread, under a lock)."""

    def __init__(self, path: str, max_batch: int) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.limit = 8 * max_batch
        self.max_batch = max_batch
        self._lock = threading.Lock()

    def send(self, data: bytes) -> None:
        with self._lock:
            self.sock.sendall(data)

    def tell(self, kind: int, line: str) -> None:
        """A last line for the front (best effort: the front may be gone)."""
        with contextlib.suppress(OSError):
            self.send(line_frame(kind, line))

    def receive(self) -> tuple[int, bytes]:
        kind, length = check_header(self._exactly(_HEADER.size), self.limit)
        return kind, self._exactly(length)

    def _exactly(self, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise LinkError("the front closed the link")
            data += chunk
        return bytes(data)


async def read_frame(reader: asyncio.StreamReader, limit: int) -> tuple[int, bytes]:
    """The next frame at the front; LinkError when the process closed the link or sent a bad one."""
    try:
        kind, length = check_header(await reader.readexactly(_HEADER.size), limit)
        return kind, await reader.readexactly(length)
    except (asyncio.IncompleteReadError, ConnectionError):
        raise LinkError("the federation's process closed the link") from None
