"""The backward-updating dispatcher: (ϑ, i) from a dominator to its collaborators, exactly once.

This is the only label-dependent message of VFB²: one float ϑ and one sample index i per
dominated update. A message is a small float64 buffer ``[seq, B, i_1..i_B, ϑ_1..ϑ_B]`` (B = 1 is the
paper's case) sent with the capitalised buffer calls, never pickled. Indices and sequence numbers
are exact in float64 up to 2**53.

Exactly-once: every dominator numbers its broadcasts 0, 1, 2, ... and sends each to every
collaborator. MPI delivers messages between two ranks on one communicator in order, so a collaborator
must see exactly the next number from each source: a repeat (duplicate, replay), a gap (lost message)
or a number out of order is a protocol violation, raised loudly instead of silently biasing the
iteration. The per-source counts are also what the SVRG outer-loop barrier uses to drain
in-flight messages, so a dominator's ``DONE`` count must equal them (:meth:`Inbox.done`).

Piggybacking (``--piggyback``): a dominator may hold step t's broadcast back and send it inside step
t + 1's aggregation request, which goes to every collaborator anyway: one message fewer per
collaborator and step, 3(q − 1) instead of 4(q − 1) in all. :func:`piggyback` builds such a message as
``[k, the k words of the (ϑ, i) message, the request's words]`` and :func:`split_piggyback` takes it
apart at the receiver, checking ``k`` before either part is read; the (ϑ, i) part is then validated by
:meth:`Inbox.unpack` like any other and keeps its sequence number, so exactly-once is unchanged.

Validation: a dominator is trusted only to follow the protocol, and its rows go straight into compiled
kernels that write ``w[indices[p]]`` without bounds checks; so :meth:`Inbox.unpack` checks every field
(sequence number, batch size, exact length, rows integral and in ``0..n_rows - 1``, ϑ finite) before
anything reaches a worker, and raises :class:`DispatchError` (a
:class:`~protocols.errors.ProtocolViolation` naming the sender) otherwise.
"""

from __future__ import annotations

import math

import numpy as np

from protocols.errors import ProtocolViolation

__all__ = ["MAX_BATCH", "DispatchError", "Inbox", "pack", "piggyback", "split_piggyback"]

#: Largest B a (ϑ, i) message may carry by default. The runtime sends B = 1; anything much larger on
#: the hot path is not something the protocol produces.
MAX_BATCH = 1 << 12
_SCALAR_BATCH = 8
_EXACT = float(1 << 53)  # float64 integers are exact below this
_WHAT = "(ϑ, i) message"


class DispatchError(ProtocolViolation):
    """A (ϑ, i) message or a ``DONE`` count that the protocol cannot have produced (see the module doc)."""


def pack(seq: int, rows: np.ndarray, thetas: np.ndarray) -> np.ndarray:
    """The wire buffer of one broadcast: ``[seq, B, rows..., thetas...]`` as float64; ``thetas`` holds
    B·k values, each row's k together (``vertical/nn/messages.py``'s layout; k = 1 for VFB²)."""
    b = rows.size
    buf = np.empty(2 + b + thetas.size, dtype=np.float64)
    buf[0] = seq
    buf[1] = b
    buf[2:2 + b] = rows
    buf[2 + b:] = thetas
    return buf


def piggyback(theta_message: np.ndarray, request: np.ndarray) -> np.ndarray:
    """One wire buffer (uint64 words) carrying a :func:`pack` message and an aggregation request."""
    words = np.empty(1 + theta_message.size + request.size, dtype=np.uint64)
    words[0] = theta_message.size
    words[1:1 + theta_message.size] = theta_message.view(np.uint64)
    words[1 + theta_message.size:] = request
    return words


def split_piggyback(source: int, words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (ϑ, i) part (float64, for :meth:`Inbox.unpack`) and the request part (uint64 words) of a
    :func:`piggyback` message from ``source``; a length word that does not leave room for both raises
    :class:`DispatchError`."""
    if words.size < 1:
        raise DispatchError(source, "piggybacked (ϑ, i) message", "is empty")
    k = int(words[0])
    if not 4 <= k <= words.size - 2:
        raise DispatchError(source, "piggybacked (ϑ, i) message",
                            f"announces {k} words of (ϑ, i) in a message of {words.size} (at least 4, "
                            f"leaving room for the request)")
    return words[1:1 + k].view(np.float64), words[1 + k:]


def _count(value: float) -> int | None:
    """``value`` as a non-negative integer if it is one exactly (finite, integral, < 2**53), else None."""
    if not (0.0 <= value < _EXACT) or value != int(value):  # NaN fails the first test
        return None
    return int(value)


class Inbox:
    """Collaborator side: validates every (ϑ, i) message, checks sequence numbers per source, counts.

    ``n_rows`` (this party's number of training rows) may be given here or per :meth:`unpack` call;
    ``max_batch`` bounds B; ``width`` is the k of each row's ϑ (a network's cut layer; 1 for VFB²'s
    scalar ϑ), fixed by the job, so a message of B rows has exactly ``2 + B + B·width`` words.
    """

    def __init__(self, n_sources: int, n_rows: int | None = None, *, max_batch: int = MAX_BATCH,
                 width: int = 1) -> None:
        if max_batch < 1 or width < 1:
            raise ValueError(f"max_batch and width must be at least 1, got {max_batch} and {width}")
        self.n_rows = n_rows
        self.max_batch = max_batch
        self.width = width
        self.received = np.zeros(n_sources, dtype=np.int64)
        #: per source: the last ``DONE`` count it announced
        self.announced = np.zeros(n_sources, dtype=np.int64)

    def unpack(self, source: int, buf: np.ndarray, n_rows: int | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """Rows (int64) and ϑ's of a message from ``source``, after checking every field of it.

        Raises :class:`DispatchError` for a truncated or over-long buffer, a B outside
        ``1..max_batch``, a row that is not an integer in ``0..n_rows - 1``, a ϑ that is NaN or
        infinite, or a sequence number other than the next one expected from ``source``.
        """
        n_rows = self.n_rows if n_rows is None else n_rows
        if n_rows is None:
            raise ValueError("Inbox.unpack needs n_rows (this party's number of rows)")
        self._check_source(source)
        buf = np.asarray(buf)
        if buf.dtype != np.float64 or buf.ndim != 1:
            raise DispatchError(source, _WHAT, f"expected a 1-D float64 buffer, got {buf.dtype} {buf.shape}")
        if buf.size < 4:
            raise DispatchError(source, _WHAT, f"{buf.size} words is truncated (at least 4: seq, B, i, ϑ)")
        seq, b = _count(float(buf[0])), _count(float(buf[1]))
        if seq is None:
            raise DispatchError(source, _WHAT, f"sequence number {float(buf[0])!r} is not a non-negative "
                                               f"integer")
        if b is None or not 1 <= b <= self.max_batch:
            raise DispatchError(source, _WHAT, f"batch size B = {float(buf[1])!r} is not an integer in "
                                               f"1..{self.max_batch}")
        expected = 2 + b + b * self.width
        if buf.size != expected:
            kind = "truncated" if buf.size < expected else "over-long"
            raise DispatchError(source, _WHAT, f"{buf.size} words for B = {b} is {kind} (expected "
                                               f"exactly {expected})")
        rows, thetas = buf[2:2 + b], buf[2 + b:]
        if b <= _SCALAR_BATCH:  # the B = 1 hot path: Python floats beat a handful of numpy calls
            for row in rows.tolist():
                if not (0.0 <= row < n_rows and row == int(row)):  # NaN fails the range test
                    raise DispatchError(source, _WHAT, f"row {row!r} is not an integer in 0..{n_rows - 1}")
            for theta in thetas.tolist():
                if not math.isfinite(theta):
                    raise DispatchError(source, _WHAT, f"ϑ = {theta!r} is not finite")
        else:
            bad = ~((rows >= 0) & (rows < n_rows) & (rows == np.floor(rows)))  # NaN compares False
            if bad.any():
                raise DispatchError(source, _WHAT, f"row {float(rows[bad][0])!r} is not an integer in "
                                                   f"0..{n_rows - 1}")
            finite = np.isfinite(thetas)
            if not finite.all():
                raise DispatchError(source, _WHAT, f"ϑ = {float(thetas[~finite][0])!r} is not finite")
        self.next_sequence(source, seq)
        return rows.astype(np.int64), thetas.copy()

    def next_sequence(self, source: int, seq: int, what: str = _WHAT) -> None:
        """Count a dispatch from ``source`` if ``seq`` is exactly the next number expected from it
        (also for the encrypted batches of ``--label-privacy he``, which share the numbering)."""
        self._check_source(source)
        expected = int(self.received[source])
        if seq != expected:
            kind = ("a duplicate or replay" if seq < expected
                    else "out of order or after a lost message")
            raise DispatchError(source, what, f"sequence number #{seq} where #{expected} was expected "
                                              f"({kind})")
        self.received[source] = expected + 1

    def done(self, source: int, buf: np.ndarray) -> int:
        """Validate a ``DONE`` count (one int64: how many (ϑ, i) ``source`` has sent in total).

        The count must be exactly what has arrived from ``source``: MPI keeps one sender's messages in
        order and a dominator sends ``DONE`` after its broadcasts, so a larger count claims messages
        never sent and a smaller one would let the receiver's drain end with broadcasts still to apply.
        """
        self._check_source(source)
        buf = np.asarray(buf)
        if buf.dtype != np.int64 or buf.shape != (1,):
            raise DispatchError(source, "DONE message", f"expected one int64 word, got {buf.dtype} "
                                                        f"{buf.shape}")
        count = int(buf[0])
        received = int(self.received[source])
        if count < 0:
            raise DispatchError(source, "DONE message", f"count {count} is negative")
        if count > received:
            raise DispatchError(source, "DONE message", f"count {count} exceeds the "
                                                        f"{received} (ϑ, i) messages received")
        if count < received:
            raise DispatchError(source, "DONE message", f"count {count} is below the {received} (ϑ, i) "
                                                        f"messages received before it")
        self.announced[source] = count
        return count

    def _check_source(self, source: int) -> None:
        if not 0 <= source < self.received.size:
            raise ValueError(f"source {source} is not a party of 0..{self.received.size - 1}")
