"""The serving messages between the leader and a passive party: int64/uint8 buffers, never pickle.

The leader sends a *request* ``[kind, n, id_1 … id_n]`` (int64 words) and the passive party
acknowledges it with one word, ``n``, before its part of the secure sum. ``STOP`` ends the service. Whatever a
passive party receives is checked here, at the boundary, before it indexes anything: a malformed
message raises :class:`~protocols.errors.ProtocolViolation` naming the leader (and the leader checks
each answer the same way, naming the passive party). With ``channels`` (a ``--secure-channels`` run,
:mod:`parties.serving.sealing`) every message travels sealed: :func:`on_wire` seals it, and
:func:`opened` opens it, as the next authentic message of its link, before any other check.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from protocols.channels import OVERHEAD_WORDS, SecureChannels
from protocols.errors import ProtocolViolation

#: MPI tags on the service's own communicator (a duplicate: never mixed with the aggregation's)
TAG_REQUEST, TAG_ACK = 1, 2
#: the first word of a leader's message
SCORE, STOP = 1, 2
LEADER = 0


class RequestInbox:
    """A passive party's receive buffer for the leader's requests, sized by ``max_batch`` once."""

    def __init__(self, comm: MPI.Comm, max_batch: int, channels: SecureChannels | None = None) -> None:
        self.comm, self.max_batch, self.channels = comm, max_batch, channels
        self._buffer = np.empty(2 + max_batch + overhead(channels), dtype=np.int64)

    def receive(self, wait) -> tuple[int, np.ndarray]:
        """The next ``(kind, ids)`` from the leader; ``wait()`` is called between polls (a backoff)."""
        status = MPI.Status()
        request = self.comm.Irecv([self._buffer, MPI.BYTE], source=LEADER, tag=TAG_REQUEST)
        try:
            while not request.Test(status):
                wait()
        except MPI.Exception as error:
            if error.Get_error_class() != MPI.ERR_TRUNCATE:
                raise
            raise ProtocolViolation(LEADER, "serving request", f"longer than {self._buffer.nbytes} bytes "
                                                               f"(more than {self.max_batch} ids)") from None
        words, nbytes = opened(self.channels, LEADER, TAG_REQUEST, self._buffer, status.Get_count(MPI.BYTE))
        return decode_request(words, nbytes, self.max_batch)


def overhead(channels: SecureChannels | None) -> int:
    """The words a sealed message carries beside its own (none in clear)."""
    return 0 if channels is None else OVERHEAD_WORDS


def on_wire(channels: SecureChannels | None, dest: int, tag: int, message: np.ndarray) -> np.ndarray:
    """``message`` as it leaves for ``dest``: itself in clear, else sealed for that link."""
    return message if channels is None else channels.seal(dest, tag, message)


def opened(channels: SecureChannels | None, source: int, tag: int, buffer: np.ndarray,
           nbytes: int) -> tuple[np.ndarray, int]:
    """``(words, nbytes)`` of a message of ``nbytes`` received from ``source`` into ``buffer``: the
    buffer itself in clear; else the opened plaintext (int64), or ProtocolViolation naming the sender."""
    if channels is None:
        return buffer, nbytes
    if nbytes % 8:
        raise ProtocolViolation(source, "sealed message", f"{nbytes} bytes is not whole 8-byte words")
    plain = channels.open(source, tag, buffer.view(np.uint64)[:nbytes // 8]).view(np.int64)
    return plain, plain.nbytes


def decode_request(buffer: np.ndarray, nbytes: int, max_batch: int) -> tuple[int, np.ndarray]:
    """``(kind, ids)`` of a request of ``nbytes`` in ``buffer``, every field checked."""
    if nbytes % 8 or nbytes < 16:
        raise ProtocolViolation(LEADER, "serving request", f"{nbytes} bytes is not a header of 2 words "
                                                           "and whole 8-byte ids")
    words = nbytes // 8
    kind, n = int(buffer[0]), int(buffer[1])
    if kind == STOP and n == 0 and words == 2:
        return STOP, buffer[:0]
    if kind != SCORE:
        raise ProtocolViolation(LEADER, "serving request", f"kind {kind} is neither SCORE nor STOP")
    if not 1 <= n <= max_batch or words != 2 + n:
        raise ProtocolViolation(LEADER, "serving request", f"announces {n} ids in a message of "
                                                           f"{words - 2} (at most {max_batch})")
    return SCORE, buffer[2:2 + n].copy()


def encode_request(ids: np.ndarray) -> np.ndarray:
    message = np.empty(2 + ids.size, dtype=np.int64)
    message[0], message[1], message[2:] = SCORE, ids.size, ids
    return message


def stop_message() -> np.ndarray:
    return np.array([STOP, 0], dtype=np.int64)


def check_ack(sender: int, word: np.ndarray, nbytes: int, n: int) -> None:
    """A passive party's acknowledgement of a request of ``n`` ids: one word, ``n``."""
    if nbytes != 8 or int(word[0]) != n:
        raise ProtocolViolation(sender, "serving acknowledgement", f"{nbytes} bytes, not the one word {n}")
