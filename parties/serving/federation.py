"""The federation behind the endpoint: the leader's :class:`Federation` and the passive parties' loop.

One scoring round for a batch of n ids (every party takes part, in this order):

1. the leader sends the ids to every passive party (:mod:`parties.serving.wire`); each acknowledges
   at once, straight to the leader (the acknowledgement is what names a party that falls silent: the
   leader's event loop gives each round ``--peer-timeout`` seconds, :meth:`Federation.unacknowledged`);
2. every party contributes ``(k+1)·n`` values to one secure sum at the leader (the masked trees of
   :class:`protocols.secure_aggregation.SecureAggregator`, as in training and ``vfl predict``): its
   ``w_l·x_i`` (k = 1), or for a network run its embedding ``h_l(x_i)`` (k values), for the ids it
   holds (0 for the others), then 1 for each id it holds (0 otherwise);
3. the leader gets ``z_i = w·x_i`` (a network run: ``z_i = Σ_l h_l(x_i)``, to which it applies its
   top, as ``vfl predict`` does) and, per id, *how many* parties hold it: an id held by fewer than q
   parties gets a per-id "unknown" answer, never a score made without some party's features.

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
    """The scores of one batch: ``z[i]`` where ``held[i]`` (every party holds that id), NaN elsewhere;
    a network of more than two classes has ``probabilities[i]`` (one per class) instead, ``z`` NaN."""

    z: np.ndarray
    held: np.ndarray
    probabilities: np.ndarray | None = None

    def take(self, start: int, stop: int) -> BatchScores:
        """The scores of the rows ``start:stop`` (one request of a micro-batch)."""
        proba = None if self.probabilities is None else self.probabilities[start:stop]
        return BatchScores(self.z[start:stop], self.held[start:stop], proba)


def contribution(model: PartyModel, ids: np.ndarray) -> np.ndarray:
    """This party's ``(k+1)·n`` values of a round: its k values of each id i it holds (``w_l·x_i``, or
    the embedding ``h_l(x_i)``; 0 for an id it does not hold), each row's k together, then 1/0 held."""
    rows = model.lookup(ids)
    held = rows >= 0
    n, k = ids.size, model.k
    values = np.zeros(model.round_values(n))
    if held.any():
        embedded = np.zeros((n, k))
        embedded[held] = model.embed(rows[held])
        values[:n * k] = embedded.ravel()
    values[n * k:] = held
    return values


def batch_scores(model: PartyModel, total: np.ndarray, n: int, parties: int) -> BatchScores:
    """The leader's answer from the secure sum ``total`` of a round of n ids: the scores of the ids
    every party holds; a network run's top applied to their ``z`` as ``vfl predict`` applies it."""
    k = model.k
    held = np.rint(total[n * k:]) == parties
    if model.network is None:
        return BatchScores(np.where(held, total[:n], np.nan), held)
    from parties.predict import network_outputs

    z = np.full(n, np.nan)
    if not held.any():
        return BatchScores(z, held)
    outputs = network_outputs(model.network.top.predict_proba(total[:n * k].reshape(n, k)[held]))
    if outputs.ndim == 1:
        z[held] = outputs
        return BatchScores(z, held)
    proba = np.full((n, outputs.shape[1]), np.nan)
    proba[held] = outputs
    return BatchScores(z, held, proba)


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
        return batch_scores(self.model, total, ids.size, self.parties)

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
