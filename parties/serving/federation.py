"""The federation behind the endpoint: the leader's :class:`Federation` and the passive parties' loop.

One scoring round for a batch of n ids (every party takes part, in this order):

1. the leader sends the ids to every passive party (:mod:`parties.serving.wire`); each acknowledges
   at once, straight to the leader (the acknowledgement is what names a party that falls silent: the
   leader's event loop gives each round ``--peer-timeout`` seconds, :meth:`Federation.unacknowledged`);
2. every party contributes ``2n`` values to one secure sum at the leader (the masked trees of
   :class:`protocols.secure_aggregation.SecureAggregator`, as in training and ``vfl predict``): its
   ``w_l·x_i`` for the ids it holds (0 for the others), then 1 for each id it holds (0 otherwise);
3. the leader gets ``z_i = w·x_i`` and, per id, *how many* parties hold it: an id held by fewer than
   q parties gets a per-id "unknown" answer, never a score made without some party's features.

So a passive party learns the ids asked for, nothing else; the leader learns the scores and how many
parties hold each id, not which. The sums wait in MPI's blocking receives, as ``vfl predict``'s do (a
polled wait with deadlines took twice the wall time of a round on the loaded 2-core machine); only an
idle passive party polls, with sleeps, for the next request. With ``channels`` (a ``--secure-channels``
run) the ids and acknowledgements travel sealed (:mod:`parties.serving.sealing`), as do the sums.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from parties.serving import wire
from parties.serving.store import PartyModel
from protocols.channels import SecureChannels
from protocols.errors import ProtocolViolation
from protocols.liveness import Backoff

#: the longest sleep of an idle passive party between polls for the next request: a request waits at
#: most this long to be picked up, and an idle party wakes at most 1/IDLE_POLL_S times a second
IDLE_POLL_S = 2e-4


class PartyUnavailable(RuntimeError):
    """A party stopped taking part within the peer timeout: the endpoint answers 503 naming it."""

    def __init__(self, rank: int | None, seconds: float) -> None:
        self.rank = rank
        if rank is None:  # every party took the request, and one stalled inside the sum
            super().__init__(f"the secure sum did not complete within {seconds:g} s (every party had "
                             "acknowledged the request)")
        else:
            super().__init__(f"party {rank} did not answer within {seconds:g} s")


@dataclass
class BatchScores:
    """The scores of one batch: ``z[k]`` where ``held[k]`` (every party holds that id), NaN elsewhere."""

    z: np.ndarray
    held: np.ndarray


def contribution(model: PartyModel, ids: np.ndarray) -> np.ndarray:
    """This party's ``2n`` values of a round: ``w_l·x_i`` where it holds id i (else 0), then 1/0 held."""
    rows = model.lookup(ids)
    held = rows >= 0
    values = np.zeros(2 * ids.size)
    if held.any():
        values[:ids.size] = np.where(held, model.request_rows(rows) @ model.w, 0.0)
    values[ids.size:] = held
    return values


class Federation:
    """The leader's side: score a batch of ids through the live parties (collective with them)."""

    def __init__(self, service: MPI.Comm, aggregator, model: PartyModel, *, peer_timeout: float,
                 channels: SecureChannels | None = None) -> None:
        self.service, self.aggregator, self.model = service, aggregator, model
        self.parties = service.Get_size()
        self.passive = list(range(1, self.parties))
        self.peer_timeout = peer_timeout
        self.channels = channels
        self._acks = np.empty((self.parties, 1 + wire.overhead(channels)), dtype=np.int64)
        self._pending: list = []  # this round's acknowledgement receives, tested under the lock
        self._lock = threading.Lock()

    def score(self, ids: np.ndarray) -> BatchScores:
        """``z`` for the ids every party holds (``held``), in the batch's order."""
        request = wire.encode_request(ids)
        messages = [wire.on_wire(self.channels, p, wire.TAG_REQUEST, request) for p in self.passive]
        with self._lock:
            acks = [self.service.Irecv([self._acks[p], MPI.BYTE], source=p, tag=wire.TAG_ACK)
                    for p in self.passive]
            self._pending = list(zip(self.passive, acks, strict=True))
        sends = [self.service.Isend([m, MPI.BYTE], dest=p, tag=wire.TAG_REQUEST)
                 for p, m in zip(self.passive, messages, strict=True)]
        total = self.aggregator.sum(contribution(self.model, ids), root=wire.LEADER)
        self._collect(ids.size)
        MPI.Request.Waitall(sends)
        n = ids.size
        held = np.rint(total[n:]) == self.parties
        return BatchScores(np.where(held, total[:n], np.nan), held)

    def _collect(self, n: int) -> None:
        """Every acknowledgement (all were sent before the sum completed), each checked."""
        status = MPI.Status()
        for party, ack in self._pending:
            backoff = Backoff(cap=1e-4)
            while not self._test(party, ack, status):
                backoff.sleep()
            word, nbytes = wire.opened(self.channels, party, wire.TAG_ACK, self._acks[party],
                                       status.Get_count(MPI.BYTE))
            wire.check_ack(party, word, nbytes, n)
        self._pending = []

    def _test(self, party: int, ack, status) -> bool:
        try:
            with self._lock:
                return ack.Test(status)
        except MPI.Exception as error:
            if error.Get_error_class() != MPI.ERR_TRUNCATE:
                raise
            raise ProtocolViolation(party, "serving acknowledgement",
                                    f"longer than {self._acks[party].nbytes} bytes") from None

    def unacknowledged(self) -> list[int]:
        """The passive parties that have not acknowledged the round in progress (from another thread,
        once the round has run past the peer timeout: they are the silent ones)."""
        with self._lock:
            return [party for party, ack in self._pending if not ack.Test()]

    def stop(self) -> None:
        """Tell every passive party the service ends (each then finalizes and exits)."""
        stop = wire.stop_message()
        MPI.Request.Waitall([self.service.Isend([wire.on_wire(self.channels, p, wire.TAG_REQUEST, stop),
                                                 MPI.BYTE], dest=p, tag=wire.TAG_REQUEST)
                             for p in self.passive])


def serve_passive(service: MPI.Comm, aggregator, model: PartyModel, *, max_batch: int,
                  channels: SecureChannels | None = None) -> int:
    """A passive party's loop: answer the leader's requests until ``STOP``; returns how many it took."""
    inbox = wire.RequestInbox(service, max_batch, channels)
    served = 0
    while True:
        backoff = Backoff(cap=IDLE_POLL_S)  # idle between requests: no spinning core
        kind, ids = inbox.receive(backoff.sleep)
        if kind == wire.STOP:
            return served
        ack = wire.on_wire(channels, wire.LEADER, wire.TAG_ACK, np.array([ids.size], dtype=np.int64))
        sent = service.Isend([ack, MPI.BYTE], dest=wire.LEADER, tag=wire.TAG_ACK)
        aggregator.sum(contribution(model, ids), root=wire.LEADER)
        sent.Wait()
        served += 1
