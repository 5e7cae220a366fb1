"""The federation behind the endpoint: the leader's :class:`Federation` and the passive parties' loop.

One scoring round for a batch of ids (every party takes part, in this order):

1. the leader sends the ids to every passive party (:mod:`parties.serving.wire`);
2. each passive party answers which of them it holds;
3. the rows every party holds are scored by the secure aggregation of training and ``vfl predict``
   (:class:`protocols.secure_aggregation.SecureAggregator`): each party contributes its masked
   ``w_l·x`` for those positions, and only the leader learns ``z = w·x``; the others get a per-id
   "unknown" answer and are never aggregated (no score is ever made of a missing party's zeros).

So a passive party learns the ids asked for and which of them every party holds, nothing else. Only
the leader's thread that calls :meth:`Federation.score` touches MPI at the leader.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from parties.serving import wire
from parties.serving.store import PartyModel
from protocols.errors import ProtocolViolation
from protocols.liveness import Backoff


class PartyUnavailable(RuntimeError):
    """A passive party did not answer within the peer timeout: the endpoint answers 503 naming it."""

    def __init__(self, rank: int, seconds: float) -> None:
        self.rank = rank
        super().__init__(f"party {rank} did not answer within {seconds:g} s")


@dataclass
class BatchScores:
    """The scores of one batch: ``z[k]`` for position k where ``held[k]`` (every party holds that id),
    NaN elsewhere."""

    z: np.ndarray
    held: np.ndarray


class Federation:
    """The leader's side: score a batch of ids through the live parties (collective with them)."""

    def __init__(self, service: MPI.Comm, aggregator, model: PartyModel, *, max_batch: int,
                 peer_timeout: float) -> None:
        self.service, self.aggregator, self.model = service, aggregator, model
        self.passive = list(range(1, service.Get_size()))
        self.max_batch, self.peer_timeout = max_batch, peer_timeout
        self._answer = np.empty(max_batch, dtype=np.uint8)

    def score(self, ids: np.ndarray) -> BatchScores:
        """``z`` for the ids every party holds (``held``), in the batch's order."""
        message = wire.encode_request(ids)
        sends = [self.service.Isend([message, MPI.BYTE], dest=p, tag=wire.TAG_REQUEST) for p in self.passive]
        rows = self.model.lookup(ids)
        held = rows >= 0
        for party in self.passive:
            held &= self._known(party, ids.size)
        positions = np.flatnonzero(held)
        decision = np.array([wire.GO if positions.size else wire.SKIP], dtype=np.int64)
        sends += [self.service.Isend([decision, MPI.BYTE], dest=p, tag=wire.TAG_DECISION)
                  for p in self.passive]
        z = np.full(ids.size, np.nan)
        if positions.size:
            block = self.model.request_rows(rows)
            z[positions] = self.aggregator.inner_product(self.model.w, block, positions, root=wire.LEADER)
        MPI.Request.Waitall(sends)
        return BatchScores(z, held)

    def _known(self, party: int, n: int) -> np.ndarray:
        """Party ``party``'s answer: which ids it holds; PartyUnavailable past the peer timeout."""
        status = MPI.Status()
        request = self.service.Irecv([self._answer, MPI.BYTE], source=party, tag=wire.TAG_KNOWN)
        deadline, backoff = time.monotonic() + self.peer_timeout, Backoff(cap=1e-3)
        try:
            while not request.Test(status):
                if time.monotonic() > deadline:
                    request.Cancel()
                    request.Wait()
                    raise PartyUnavailable(party, self.peer_timeout)
                backoff.sleep()
        except MPI.Exception as error:
            if error.Get_error_class() != MPI.ERR_TRUNCATE:
                raise
            raise ProtocolViolation(party, "serving answer", "longer than the request") from None
        return wire.decode_known(party, self._answer, status.Get_count(MPI.BYTE), n)

    def stop(self) -> None:
        """Tell every passive party the service ends (each then finalizes and exits)."""
        message = wire.stop_message()
        MPI.Request.Waitall([self.service.Isend([message, MPI.BYTE], dest=p, tag=wire.TAG_REQUEST)
                             for p in self.passive])


def serve_passive(service: MPI.Comm, aggregator, model: PartyModel, *, max_batch: int) -> int:
    """A passive party's loop: answer the leader's requests until ``STOP``; returns how many it took."""
    inbox = wire.RequestInbox(service, max_batch)
    decision = np.empty(1, dtype=np.int64)
    served = 0
    while True:
        backoff = Backoff(cap=1e-3)  # idle between requests: no spinning core
        kind, ids = inbox.receive(backoff.sleep)
        if kind == wire.STOP:
            return served
        rows = model.lookup(ids)
        known = (rows >= 0).astype(np.uint8)
        service.Send([known, MPI.BYTE], dest=wire.LEADER, tag=wire.TAG_KNOWN)
        status = MPI.Status()
        service.Recv([decision, MPI.BYTE], source=wire.LEADER, tag=wire.TAG_DECISION, status=status)
        if wire.decode_decision(decision, status.Get_count(MPI.BYTE)):
            aggregator.inner_product(model.w, model.request_rows(rows), None, root=wire.LEADER)
        served += 1
