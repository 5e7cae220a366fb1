"""The serving messages between the leader and a passive party: int64/uint8 buffers, never pickle.

The leader sends a *request* ``[kind, n, id_1 … id_n]`` (int64 words) and the passive party
acknowledges it with one word, ``n``, before its part of the secure sum. ``STOP`` ends the service. Whatever a
passive party receives is checked here, at the boundary, before it indexes anything: a malformed
message raises :class:`~protocols.errors.ProtocolViolation` naming the leader (and the leader checks
each answer the same way, naming the passive party).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from protocols.errors import ProtocolViolation

#: MPI tags on the service's own communicator (a duplicate: never mixed with the aggregation's)
TAG_REQUEST, TAG_ACK = 1, 2
#: the first word of a leader's message
SCORE, STOP = 1, 2
LEADER = 0


class RequestInbox:
    """A passive party's receive buffer for the leader's requests, sized by ``max_batch`` once."""

    def __init__(self, comm: MPI.Comm, max_batch: int) -> None:
        self.comm, self.max_batch = comm, max_batch
        self._buffer = np.empty(2 + max_batch, dtype=np.int64)

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
        return decode_request(self._buffer, status.Get_count(MPI.BYTE), self.max_batch)


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
