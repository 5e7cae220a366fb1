"""Thin message layers under the aggregation protocol: MPI (the real thing) and in-process threads.

A transport moves whole ``uint64`` buffers (header + payload, see :mod:`protocols.aggregation`) between
ranks and knows nothing of their meaning:

* ``send(dest, buffer)`` never blocks on the receiver (``Isend``); ownership of ``buffer`` passes to the
  transport until the send completes. Blocking sends could deadlock: two roots' trees may point in
  opposite directions between the same two parties.
* ``recv()`` blocks until the next message for this protocol arrives, from any rank, and returns
  ``(source, buffer)``; the caller owns ``buffer``.
* ``flush()`` waits until every send issued so far has completed.

:class:`MpiTransport` waits in one blocking ``Recv(ANY_SOURCE, tag)`` into a reused receive buffer of
fixed capacity (64 KiB by default) and copies the message out. It never probes: with more ranks than
cores, a thread waiting in ``Probe``/``Mprobe`` and then receiving measured 1-8 ms per round trip here, a
plain blocking ``Recv`` tens of µs (the VFB² runtime's communication thread receives the same way,
``parties/runtime.py``). A message longer than the capacity goes as two: a 4-byte
*frame* holding its length in words, on ``tag``, then the words themselves on ``tag + 1``, which the
receiver takes with an exact-size blocking ``Recv`` from the frame's source. Every ordinary message is a
whole number of 8-byte words, so a 4-byte message can only be a frame, and MPI keeps the messages from one
sender on one tag in order, so the k-th frame from a rank announces its k-th payload.

A frame's length comes from another party, so it is checked before anything is allocated: it must exceed
the capacity (shorter messages are never framed) and must not exceed ``max_message_words``, the largest
message the protocol above can legitimately send (by default a header plus
:data:`~protocols.aggregation.DEFAULT_MAX_BATCH` values; :meth:`SecureAggregator.over_mpi
<protocols.secure_aggregation.SecureAggregator.over_mpi>` derives it from its ``max_batch``). The payload
must then be exactly that long. An empty message, one that is not a whole number of words, an unframed
one longer than the capacity, or a payload of the wrong size all raise
:class:`~protocols.errors.ProtocolViolation` naming the sender. Messages up to the
capacity travel as they are, one buffer each: that is all of the VFB² runtime's hot path, which sends and
receives its few-word ``AGGREGATION_TAG`` messages itself. Other tags on the communicator are left alone.

:class:`RecordingTransport` wraps any transport and keeps a copy of everything received: the transcript
used to audit what each party saw.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Protocol, TypeVar

import numpy as np
from mpi4py import MPI

from protocols.aggregation import DEFAULT_MAX_BATCH, HEADER_WORDS
from protocols.errors import ProtocolViolation
from protocols.masking import Words

__all__ = [
    "AGGREGATION_TAG",
    "InProcessNetwork",
    "MpiTransport",
    "RecordingTransport",
    "Transport",
    "run_parties",
]

#: MPI tag of every secure-aggregation message; the header inside says which request and tree.
AGGREGATION_TAG = 0x5ECA

_T = TypeVar("_T")


class Transport(Protocol):
    """What the aggregation drivers need from a network (see the module docstring)."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def send(self, dest: int, buffer: Words) -> None: ...

    def recv(self) -> tuple[int, Words]: ...

    def flush(self) -> None: ...


class MpiTransport:
    """Buffer-based MPI messaging for the aggregation protocol over ``comm`` on ``tag`` and ``tag + 1``.

    Messages up to ``capacity_words`` words are received into one reused buffer (see the module
    docstring); longer ones are framed. Only one thread may call :meth:`recv`; :meth:`send` and
    :meth:`flush` belong to the same thread.
    """

    DEFAULT_CAPACITY_WORDS = 1 << 13  # 64 KiB
    DEFAULT_MAX_MESSAGE_WORDS = HEADER_WORDS + DEFAULT_MAX_BATCH
    _PRUNE_EVERY = 32
    _FRAME_BYTES = 4

    def __init__(self, comm: MPI.Comm, tag: int = AGGREGATION_TAG, *,
                 capacity_words: int = DEFAULT_CAPACITY_WORDS,
                 max_message_words: int = DEFAULT_MAX_MESSAGE_WORDS) -> None:
        tag_limit = comm.Get_attr(MPI.TAG_UB)
        if not 0 <= tag < tag_limit:
            raise ValueError(f"tag must be in 0..{tag_limit - 1} (tag + 1 is used too), got {tag}")
        if capacity_words < 1:
            raise ValueError(f"capacity_words must be at least 1, got {capacity_words}")
        if not 1 <= max_message_words < 1 << 32:
            raise ValueError(f"max_message_words must be in 1..2**32 - 1, got {max_message_words}")
        self.comm = comm
        self.tag = tag
        self.capacity_words = capacity_words
        self.max_message_words = max_message_words
        self._inbox = np.empty(capacity_words, dtype=np.uint64)
        self._inbox_spec = [self._inbox, MPI.BYTE]
        self._status = MPI.Status()
        self._in_flight: list[tuple[MPI.Request, np.ndarray]] = []

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    def send(self, dest: int, buffer: Words) -> None:
        if buffer.size > self.capacity_words:
            if buffer.size >= 1 << 32:
                raise ValueError(f"a message of {buffer.size} words is too long to frame (at most 2**32 - 1)")
            frame = np.array([buffer.size], dtype=np.uint32)
            self._track(self.comm.Isend([frame, MPI.BYTE], dest=dest, tag=self.tag), frame)
            self._track(self.comm.Isend([buffer, MPI.BYTE], dest=dest, tag=self.tag + 1), buffer)
        else:
            self._track(self.comm.Isend([buffer, MPI.BYTE], dest=dest, tag=self.tag), buffer)

    def recv(self) -> tuple[int, Words]:
        """The next message: ``(source, words)``; a malformed one raises ``ProtocolViolation(source)``."""
        status = self._status
        self._receive(self._inbox_spec, MPI.ANY_SOURCE, self.tag, status, "message")
        source, nbytes = status.Get_source(), status.Get_count(MPI.BYTE)
        if nbytes != self._FRAME_BYTES:
            if nbytes == 0 or nbytes % 8:
                raise ProtocolViolation(source, "message", f"{nbytes} bytes is not a whole, non-zero number "
                                                           f"of 8-byte words")
            if nbytes // 8 > self.max_message_words:
                raise ProtocolViolation(source, "message", f"{nbytes // 8} words exceed the limit of "
                                                           f"{self.max_message_words}")
            return source, self._inbox[:nbytes // 8].copy()
        words = int(self._inbox.view(np.uint32)[0])
        if not self.capacity_words < words <= self.max_message_words:
            raise ProtocolViolation(source, "frame", f"announces {words} words; a framed message has "
                                                     f"more than {self.capacity_words} (else it is sent "
                                                     f"whole) and at most {self.max_message_words}")
        buffer = np.empty(words, dtype=np.uint64)
        self._receive([buffer, MPI.BYTE], source, self.tag + 1, status, "framed payload")
        if status.Get_count(MPI.BYTE) != buffer.nbytes:
            raise ProtocolViolation(source, "framed payload", f"{status.Get_count(MPI.BYTE)} bytes where its "
                                                              f"frame announced {buffer.nbytes}")
        return source, buffer

    def _receive(self, spec: list, source: int, tag: int, status: MPI.Status, what: str) -> None:
        """A blocking ``Recv``; a message longer than the buffer is the sender's fault, and says so."""
        try:
            self.comm.Recv(spec, source, tag, status)
        except MPI.Exception as error:
            if error.Get_error_class() != MPI.ERR_TRUNCATE:
                raise
            raise ProtocolViolation(status.Get_source(), what, f"longer than the {spec[0].nbytes} bytes "
                                                               f"expected") from None

    def flush(self) -> None:
        if self._in_flight:
            MPI.Request.Waitall([r for r, _ in self._in_flight])
            self._in_flight.clear()

    def _track(self, request: MPI.Request, buffer: np.ndarray) -> None:
        """Keep ``buffer`` alive until its send completes; drop completed sends now and then."""
        self._in_flight.append((request, buffer))
        if len(self._in_flight) >= self._PRUNE_EVERY:
            self._in_flight = [(r, b) for r, b in self._in_flight if not r.Test()]


class InProcessNetwork:
    """``size`` ranks in one process, one inbox each; hand :meth:`transport` to one thread per rank.

    ``timeout`` (seconds) bounds every ``recv``: a protocol bug then fails with :class:`TimeoutError`
    instead of hanging the test suite.
    """

    def __init__(self, size: int, *, timeout: float | None = 60.0) -> None:
        if size < 1:
            raise ValueError(f"a network needs at least one rank, got {size}")
        self.size = size
        self.timeout = timeout
        self._inboxes: list[queue.SimpleQueue[tuple[int, Words]]] = [queue.SimpleQueue() for _ in range(size)]

    def transport(self, rank: int) -> InProcessTransport:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in 0..{self.size - 1}")
        return InProcessTransport(self, rank)


class InProcessTransport:
    """One rank's endpoint of an :class:`InProcessNetwork`."""

    def __init__(self, network: InProcessNetwork, rank: int) -> None:
        self._network = network
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._network.size

    def send(self, dest: int, buffer: Words) -> None:
        self._network._inboxes[dest].put((self._rank, buffer))

    def recv(self) -> tuple[int, Words]:
        try:
            return self._network._inboxes[self._rank].get(timeout=self._network.timeout)
        except queue.Empty:
            raise TimeoutError(f"rank {self._rank} waited {self._network.timeout} s for a message") from None

    def flush(self) -> None:
        """Nothing to wait for: an in-process send completes when it is queued."""


class RecordingTransport:
    """Wraps a transport and records ``(source, copy of buffer)`` for every message received."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.received: list[tuple[int, Words]] = []

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    def send(self, dest: int, buffer: Words) -> None:
        self.inner.send(dest, buffer)

    def recv(self) -> tuple[int, Words]:
        source, buffer = self.inner.recv()
        self.received.append((source, buffer.copy()))  # the receiver sums into its buffer in place
        return source, buffer

    def flush(self) -> None:
        self.inner.flush()


def run_parties(size: int, party: Callable[[InProcessTransport], _T], *,
                timeout: float | None = 60.0) -> list[_T]:
    """Run ``party(transport)`` for every rank of a fresh in-process network, one thread each.

    Returns the per-rank results in rank order; re-raises the first exception a party raised.
    """
    network = InProcessNetwork(size, timeout=timeout)
    results: list[_T | None] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = party(network.transport(rank))
        except BaseException as error:  # re-raised in the caller's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(r,), name=f"party-{r}") for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results  # type: ignore[return-value]
