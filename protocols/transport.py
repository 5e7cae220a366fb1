"""Thin message layers under the protocols: MPI (the real thing) and in-process threads.

A transport moves whole-word buffers (header + payload, see :mod:`protocols.aggregation`) between
ranks and knows nothing of their meaning:

* ``send(dest, buffer)`` never blocks on the receiver (``Isend``); ownership of ``buffer`` passes to the
  transport until the send completes. Blocking sends could deadlock: two roots' trees may point in
  opposite directions between the same two parties.
* ``recv()`` blocks until the next message for this protocol arrives, from any rank, and returns
  ``(source, buffer)``; the caller owns ``buffer``.
* ``flush()`` waits until every send issued so far has completed.

:class:`MpiTransport` is the one MPI message layer of every party-to-party path: the secure
aggregation's full passes (:class:`~protocols.secure_aggregation.SecureAggregator`) and the VFB²
runtime's data plane (``parties/data_plane.py``) both use it. It multiplexes tags: ``send(dest, buffer,
tag)`` from any thread (a lock keeps sends, and sealed links' counters, in one order), ``recv()`` for
its own ``tag`` and ``recv_any()`` for every tag, which the runtime's one communication thread uses to
serve all its message kinds. With ``channels`` (:class:`~protocols.channels.SecureChannels`) every
message to another party is sealed (authenticated encryption) and every one from another party opened
before its words are returned; a message to itself travels as it is.

The receiver waits in one blocking ``Recv(ANY_SOURCE, tag)`` (or ``ANY_TAG``) into a reused receive
buffer of fixed capacity (64 KiB by default) and copies the message out. It never probes: with more ranks than
cores, a thread waiting in ``Probe``/``Mprobe`` and then receiving measured 1-8 ms per round trip here, a
plain blocking ``Recv`` tens of µs (the VFB² runtime's communication thread receives the same way,
``parties/data_plane.py``). A message longer than the capacity goes as two: a 4-byte
*frame* holding its length in words, on ``tag``, then the words themselves on ``tag + 1``, which the
receiver takes with an exact-size blocking ``Recv`` from the frame's source. Every ordinary message is a
whole number of 8-byte words, so a 4-byte message can only be a frame, and MPI keeps the messages from one
sender on one tag in order, so the k-th frame from a rank announces its k-th payload.

With ``liveness`` (:class:`~protocols.liveness.Liveness`) the transport counts every message it receives
as its sender's delivery (except those on ``silent_tags``: heartbeats), receives a frame's payload by
polling under a deadline (a frame whose payload never comes ends the wait naming its sender), and
``recv(wait=...)``, ``recv_any(wait=...)`` and ``flush(level=...)`` poll as well, calling ``wait`` between
polls so that the caller's deadline can fire; without them they block in MPI as before (the data
plane's communication thread, whose speed depends on it).

A frame's length comes from another party, so it is checked before anything is allocated: it must exceed
the capacity (shorter messages are never framed) and must not exceed ``max_message_words``, the largest
message the protocol above can legitimately send (by default a header plus
:data:`~protocols.aggregation.DEFAULT_MAX_BATCH` values; :meth:`SecureAggregator.over_mpi
<protocols.secure_aggregation.SecureAggregator.over_mpi>` derives it from its ``max_batch``). The payload
must then be exactly that long. An empty message, one that is not a whole number of words, an unframed
one longer than the capacity, or a payload of the wrong size all raise
:class:`~protocols.errors.ProtocolViolation` naming the sender. Messages up to the
capacity travel as they are, one buffer each: that is all of the VFB² runtime's hot path, whose
receive capacity is its largest message. With ``recv()``, other tags on the communicator are left alone.

:class:`RecordingTransport` wraps any transport and keeps a copy of everything received: the transcript
used to audit what each party saw.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np
from mpi4py import MPI

from protocols.aggregation import DEFAULT_MAX_BATCH, HEADER_WORDS
from protocols.errors import ProtocolViolation
from protocols.liveness import Backoff
from protocols.masking import Words

if TYPE_CHECKING:
    from protocols.channels import SecureChannels
    from protocols.liveness import Liveness

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
    """Buffer-based MPI messaging over ``comm``: ``tag`` by default (``tag + 1`` carries framed
    payloads), any tag on request.

    Messages up to ``capacity_words`` words are received into one reused buffer (see the module
    docstring); longer ones are framed. Only one thread may receive (:meth:`recv` or
    :meth:`recv_any`); :meth:`send` and :meth:`flush` may be called from any thread. ``channels`` seals
    every message between parties.
    """

    DEFAULT_CAPACITY_WORDS = 1 << 13  # 64 KiB
    DEFAULT_MAX_MESSAGE_WORDS = HEADER_WORDS + DEFAULT_MAX_BATCH
    _PRUNE_EVERY = 32
    _FRAME_BYTES = 4

    def __init__(self, comm: MPI.Comm, tag: int = AGGREGATION_TAG, *,
                 capacity_words: int = DEFAULT_CAPACITY_WORDS,
                 max_message_words: int = DEFAULT_MAX_MESSAGE_WORDS,
                 channels: SecureChannels | None = None, kinds: Mapping[int, str] | None = None,
                 liveness: Liveness | None = None, silent_tags: frozenset[int] = frozenset()) -> None:
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
        self.channels = channels
        #: what each tag carries, for error messages ("party 2 sent an invalid (ϑ, i) message: ...")
        self.kinds = dict(kinds or {})
        self._rank = comm.Get_rank()
        self._inbox = np.empty(capacity_words, dtype=np.uint64)
        self._inbox_spec = [self._inbox, MPI.BYTE]
        self._status = MPI.Status()
        self._in_flight: list[tuple[MPI.Request, np.ndarray, int]] = []
        self.liveness = liveness
        self._silent_tags = silent_tags
        #: held while a message is sealed and handed to MPI: sends from several threads keep one
        #: order per link, which sealed links' counters need
        self.send_lock = threading.Lock()

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    def send(self, dest: int, buffer: np.ndarray, tag: int | None = None) -> None:
        """Send ``buffer`` (whole words, any 8-byte dtype) to ``dest`` on ``tag`` (default: the
        transport's), sealed when channels are on and ``dest`` is another party; never blocks."""
        tag = self.tag if tag is None else tag
        with self.send_lock:
            if self.channels is not None and dest != self._rank:
                buffer = self.channels.seal(dest, tag, buffer)
            if buffer.size > self.capacity_words:
                if buffer.size >= 1 << 32:
                    raise ValueError(f"a message of {buffer.size} words is too long to frame (at most "
                                     f"2**32 - 1)")
                frame = np.array([buffer.size], dtype=np.uint32)
                self._track(self.comm.Isend([frame, MPI.BYTE], dest=dest, tag=tag), frame, dest)
                self._track(self.comm.Isend([buffer, MPI.BYTE], dest=dest, tag=tag + 1), buffer, dest)
            else:
                self._track(self.comm.Isend([buffer, MPI.BYTE], dest=dest, tag=tag), buffer, dest)

    def recv(self, wait: Callable[[], None] | None = None) -> tuple[int, Words]:
        """The next message on this transport's tag: ``(source, words)``; a malformed one raises
        ``ProtocolViolation(source)``. With ``wait``, polls and calls it between polls (it raises to
        give up, e.g. :class:`~protocols.liveness.PeerTimeout`)."""
        source, _, words = self._next(self.tag, wait)
        return source, words

    def recv_any(self, wait: Callable[[], None] | None = None) -> tuple[int, int, Words]:
        """The next message on any tag: ``(source, tag, words)`` (a framed payload is collected from
        ``tag + 1`` of its frame's tag); ``wait`` as for :meth:`recv`."""
        return self._next(MPI.ANY_TAG, wait)

    def _next(self, tag: int, wait: Callable[[], None] | None = None) -> tuple[int, int, Words]:
        status = self._status
        self._receive(self._inbox_spec, MPI.ANY_SOURCE, tag, status, wait=wait)
        source, tag, nbytes = status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE)
        if self.liveness is not None and tag not in self._silent_tags:
            self.liveness.delivered(source)
        what = self.kinds.get(tag, "message")
        if nbytes != self._FRAME_BYTES:
            if nbytes == 0 or nbytes % 8:
                raise ProtocolViolation(source, what, f"{nbytes} bytes is not a whole, non-zero number of "
                                                      f"8-byte words")
            if nbytes // 8 > self.max_message_words:
                raise ProtocolViolation(source, what, f"{nbytes // 8} words exceed the limit of "
                                                      f"{self.max_message_words}")
            return source, tag, self._open(source, tag, self._inbox[:nbytes // 8].copy())
        words = int(self._inbox.view(np.uint32)[0])
        if not self.capacity_words < words <= self.max_message_words:
            raise ProtocolViolation(source, "frame", f"announces {words} words; a framed message has "
                                                     f"more than {self.capacity_words} (else it is sent "
                                                     f"whole) and at most {self.max_message_words}")
        buffer = np.empty(words, dtype=np.uint64)
        payload_wait = None
        if self.liveness is not None:  # the frame's sender owes its payload now: a deadline, level 0
            since, liveness = self.liveness.clock(), self.liveness

            def payload_wait() -> None:
                liveness.check((source,), since, "the payload of its frame")
        self._receive([buffer, MPI.BYTE], source, tag + 1, status, "framed payload", wait=payload_wait)
        if status.Get_count(MPI.BYTE) != buffer.nbytes:
            raise ProtocolViolation(source, "framed payload", f"{status.Get_count(MPI.BYTE)} bytes where its "
                                                              f"frame announced {buffer.nbytes}")
        return source, tag, self._open(source, tag, buffer)

    def _open(self, source: int, tag: int, words: Words) -> Words:
        if self.channels is None or source == self._rank:
            return words
        return self.channels.open(source, tag, words)

    def _receive(self, spec: list, source: int, tag: int, status: MPI.Status, what: str | None = None, *,
                 wait: Callable[[], None] | None = None) -> None:
        """A blocking ``Recv``, or with ``wait`` an ``Irecv`` polled with ``wait()`` between polls; a
        message longer than the buffer is the sender's fault, and says so."""
        try:
            if wait is None:
                self.comm.Recv(spec, source, tag, status)
            else:
                request = self.comm.Irecv(spec, source, tag)
                backoff = Backoff()
                while not request.Test(status):
                    try:
                        wait()
                    except BaseException:  # giving up: the reused buffer must not be written later
                        request.Cancel()
                        request.Wait()
                        raise
                    backoff.sleep()
        except MPI.Exception as error:
            if error.Get_error_class() != MPI.ERR_TRUNCATE:
                raise
            what = what or self.kinds.get(status.Get_tag(), "message")
            raise ProtocolViolation(status.Get_source(), what, f"longer than the {spec[0].nbytes} bytes "
                                                               f"expected") from None

    def flush(self, level: int | None = None) -> None:
        """Wait until every send issued so far has completed. With ``liveness`` and a ``level``, polls:
        a receiver that does not take its message in time ends the wait (its deadline at ``level``)."""
        with self.send_lock:
            in_flight, self._in_flight = self._in_flight, []
        if not in_flight:
            return
        if self.liveness is None or level is None:
            MPI.Request.Waitall([r for r, _, _ in in_flight])
            return
        open_ = in_flight

        def done() -> bool:
            nonlocal open_
            open_ = [item for item in open_ if not item[0].Test()]
            return not open_

        self.liveness.wait(done, lambda: {dest: level for _, _, dest in open_},
                           "it to take the messages sent to it")

    def _track(self, request: MPI.Request, buffer: np.ndarray, dest: int) -> None:
        """Keep ``buffer`` alive until its send completes; drop completed sends now and then."""
        self._in_flight.append((request, buffer, dest))
        if len(self._in_flight) >= self._PRUNE_EVERY:
            self._in_flight = [item for item in self._in_flight if not item[0].Test()]


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

    def recv(self, *wait) -> tuple[int, Words]:
        """The inner transport's next message (``wait`` passed on, for a polling one), recorded."""
        source, buffer = self.inner.recv(*wait)
        self.received.append((source, buffer.copy()))  # the receiver sums into its buffer in place
        return source, buffer

    def flush(self, *level) -> None:
        self.inner.flush(*level)


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
