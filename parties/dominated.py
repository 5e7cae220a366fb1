"""The dominated loop of an active party (Alg. 2/4/6): requests, ϑ, the (ϑ, i) dispatch, its own step.

A mixin of :class:`~parties.data_plane.DataPlane` (the plane's state, threads and transport are its),
kept apart so that what the main thread of a label holder does during a segment reads in one place.
What a party computes with is its part (``self.part``, :mod:`parties.party_model`): a linear
block (``w·x``, k = 1) or a network (k values a row), so the same loop drives both.
"""

from __future__ import annotations

import collections
import functools
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from parties.label_plane import HE_AHEAD
from parties.lifecycle import stop_job
from parties.messages import TAG_DONE, TAG_HE_BATCH, TAG_THETA, TAG_THETA_REQUEST
from parties.party_model import Diverged
from protocols.aggregation import Completed
from protocols.dispatch import pack, piggyback

#: Longest a thread waiting on a peer sleeps before it looks at its deadline again (seconds).
TICK = 0.05

#: where a waiting dominator's scores arrive
Slot = queue.SimpleQueue


class _Segment:
    """One :meth:`DominatedLoop.dominate` call: its rows, the requests out (oldest first), the step it
    is at, and (``--piggyback``) the last step's held (ϑ, i) message."""

    __slots__ = ("deadline", "done", "finished", "held", "issued", "issuing", "n_steps", "others", "pending",
                 "rows", "scores")

    def __init__(self, rows: np.ndarray, n_steps: int, deadline: float | None, others: list[int]) -> None:
        self.rows, self.n_steps, self.deadline, self.others = rows, n_steps, deadline, others
        #: (rows, rid, slot) of each request out, in request order; slot is None on the inline path
        self.pending: collections.deque[tuple[np.ndarray, int, Slot | None]] = collections.deque()
        self.scores: dict[int, np.ndarray] = {}  # inline: results that came before an older one's
        self.issued = self.done = 0
        self.held: np.ndarray | None = None
        self.finished = threading.Event()
        #: inline: requests are being issued; a result that arrives meanwhile (every child's sum can come
        #: before this party's own start completes a request at once) waits in ``scores``
        self.issuing = False


class DominatedLoop:
    """The active party's side of a segment; mixed into :class:`~parties.data_plane.DataPlane`."""

    def aggregate(self, rows: np.ndarray) -> np.ndarray:
        """ŵ·x_i for ``rows`` by Algorithm 1 rooted at this party (blocks only on this result)."""
        return self.request(rows).get()

    def request(self, rows: np.ndarray, theta: np.ndarray | None = None) -> Slot:
        """Start Algorithm 1 for ``rows`` rooted here; the scores arrive in the returned slot.

        ``theta``, a held (ϑ, i) message (``--piggyback``), rides along with the announcements.
        """
        slot = self._request(rows, theta)[1]
        assert slot is not None
        return slot

    def _request(self, rows: np.ndarray, theta: np.ndarray | None = None,
                 on_result: Callable[[int, np.ndarray], None] | None = None) -> tuple[int, Slot | None]:
        """:meth:`request`, returning the request id too; with ``on_result`` no slot (None): the
        communication thread calls ``on_result(rid, scores)`` instead (the inline path)."""
        slot: Slot | None = None if on_result is not None else queue.SimpleQueue()
        with self.node_lock:
            rid, announcements = self.node.announce(rows)
            self.results[rid] = slot.put if slot is not None else functools.partial(on_result, rid)
        if theta is None:
            self._send_all(announcements)
        else:
            for message in announcements:
                self.transport.send(message.dest, piggyback(theta, message.buffer), TAG_THETA_REQUEST)
            announced = {message.dest for message in announcements}
            self._broadcast_theta(theta, [r for r in range(self.q) if r != self.rank and r not in announced])
        started = time.perf_counter()
        values = self.part.contribute(rows)
        with self.node_lock:
            step = self.node.start(self.rank, rid, values)
            self._started[(self.rank, rid)] = time.monotonic()
        self._straggle(started)
        self._send_all(step.outgoing)
        if isinstance(step.event, Completed):  # every child's sum came before this start (a descheduled root)
            self.results.pop(rid)(step.event.result())
        return rid, slot

    def dominate(self, n_steps: int, deadline: float | None = None) -> int:
        """Run ``n_steps`` dominated updates (Alg. 2/4/6) of ``batch_size`` rows each; returns how many
        were done.

        Up to ``inflight`` aggregation requests are outstanding, each reading ŵ when it is served, so
        link latency overlaps instead of adding up; the (ϑ, i) broadcasts still go out in request order,
        numbered, and every party applies each exactly once. What it costs: a step's ŵ may miss the
        updates of this dominator's ``inflight − 1`` previous steps, so the bounded delay τ of the
        analysis grows by ``inflight − 1`` per dominator. The synchronous modes keep one step in flight
        and wait for every collaborator's acknowledgement; ``sync-global`` also makes all dominators
        take each step together. With ``piggyback`` each step's (ϑ, i) waits for the next request and
        rides inside it (docs/runtime.md); when no request follows it goes alone at once.

        On the inline path (:attr:`inline`, docs/runtime.md "The B = 1 hot path") this thread only
        starts the segment: the communication thread takes each result as it arrives and runs the next
        step itself, so no result crosses between threads.
        """
        party = self.party
        assert party.active, "only a label holder dominates"
        rows = (self.sampler.integers(0, party.block.n_rows, size=(n_steps, self.batch_size))
                if self._batches is None else self._batches.take(n_steps))
        if self.pump is not None:  # --engine compiled: the communication thread's pump runs the segment
            return self.pump.dominate(rows, deadline)
        seg = _Segment(rows, n_steps, deadline, [r for r in range(self.q) if r != self.rank])
        if self.inline:
            with self.inline_lock:
                self._drain(seg)
            seg.finished.wait()
            return seg.done
        while not self._proceed(seg):
            step_rows, _, slot = seg.pending.popleft()
            self._step(seg, step_rows, slot.get())
        return seg.done

    def _proceed(self, seg: _Segment) -> bool:
        """Start what the segment may start now (a held ϑ rides on the first request, or goes alone if
        none can start); whether the segment is over (nothing out, nothing more to start)."""
        seg.issuing = True
        try:
            while (seg.issued < seg.n_steps and len(seg.pending) < self.inflight
                   and self._may_start(seg.issued, seg.deadline)):
                step_rows = seg.rows[seg.issued]
                on_result = functools.partial(self._on_scores, seg) if self.inline else None
                rid, slot = self._request(step_rows, seg.held, on_result)
                seg.pending.append((step_rows, rid, slot))
                seg.held = None
                seg.issued += 1
        finally:
            seg.issuing = False
        if seg.held is not None:  # no request to ride on: it goes alone, now
            self._broadcast_theta(seg.held, seg.others)
            seg.held = None
        return not seg.pending

    def _on_scores(self, seg: _Segment, rid: int, scores: np.ndarray) -> None:
        """Inline path, in the communication thread: request ``rid``'s scores, then :meth:`_drain`;
        while requests are being issued (this call came from inside one) they only wait in line."""
        with self.inline_lock:
            seg.scores[rid] = scores
            if not seg.issuing:
                self._drain(seg)

    def _drain(self, seg: _Segment) -> None:
        """Inline path: each step whose scores are in, in request order, and after each the requests
        that may start (a held ϑ rides on the next one); the end of the segment wakes :meth:`dominate`.
        A request can complete while it is issued, when every child's partial sum came before this
        party's own start: its scores are then in line before the request is, and are taken here."""
        while True:
            if seg.pending and seg.pending[0][1] in seg.scores:
                step_rows, done_rid, _ = seg.pending.popleft()
                self._step(seg, step_rows, seg.scores.pop(done_rid))
            if self._proceed(seg):
                seg.finished.set()
                return
            if not seg.pending or seg.pending[0][1] not in seg.scores:
                return

    def _step(self, seg: _Segment, step_rows: np.ndarray, scores: np.ndarray) -> None:
        """One dominated update from its scores: ϑ, its dispatch (or held for the next request), this
        party's own step; in the synchronous modes, every acknowledgement."""
        others = seg.others
        try:
            thetas = self.part.theta(scores, step_rows)  # B·k values, each row's k together
        except Diverged as err:
            stop_job(self.data, self.rank, "diverged", str(err))
            raise
        if self._noise_std:  # --epsilon: ϑ̃, for every party (label_plane.LabelPlane.setup_noise)
            thetas = self.label.perturb(thetas)
        if self.dispatch:
            if self.synchronous and others:
                self.max_unacked = max(self.max_unacked, self.sent - int(self.acked[others].min()))
            seg.held = self._dispatch(step_rows, thetas, others)
        started = time.perf_counter()
        self.part.step(step_rows, thetas, writer=0)
        self._straggle(started)
        if self.synchronous and self.dispatch:
            self._await_acks(others)
        seg.done += 1

    def _await_acks(self, others: list[int]) -> None:
        """Sync modes: every other party has acknowledged every (ϑ, i) sent so far. A party's worker may
        be behind another dominator's stream first: level 1."""
        since = time.monotonic()
        with self.acked_cond:
            while (late := [p for p in others if self.acked[p] < self.sent]):
                self.liveness.check(late, since, f"its acknowledgement of (ϑ, i) #{self.sent - 1}", level=1)
                self.acked_cond.wait(TICK)

    def _dispatch(self, rows: np.ndarray, thetas: np.ndarray, others: list[int]) -> np.ndarray | None:
        """Step ``sent``'s (ϑ, i) to every other party (passive ones get it encrypted under ``--label-privacy
        he``), or, with ``piggyback``, held back for the next request: returned."""
        buf = pack(self.sent, rows, thetas)
        if self._he_passive and not self.synchronous:  # a passive party's backlog stays bounded
            self.label.await_answers(self.sent - HE_AHEAD)
        sealed = (self.label.encrypt_batch(self.sent, rows, self.party.rule.summed_values(rows, thetas))
                  if self._he_passive else None)
        self.sent += 1
        if self.piggyback:
            return buf
        for dest in others:
            if sealed is not None and dest not in self.active_ranks:
                self.transport.send(dest, sealed, TAG_HE_BATCH)
            else:
                self.transport.send(dest, buf, TAG_THETA)
        return None

    def _broadcast_theta(self, message: np.ndarray, dests: list[int]) -> None:
        for dest in dests:
            self.transport.send(dest, message, TAG_THETA)

    def _may_start(self, step: int, deadline: float | None) -> bool:
        """Whether to start another step: within the time budget, and under ``sync-global`` only when
        every dominator starts it too (one agreement per step: they stop together)."""
        go = deadline is None or step % 64 != 0 or time.perf_counter() <= deadline
        return self.control.agree(go) if self._lockstep else go

    def finish_segment(self) -> None:
        """Tell every other party that this dominator is done with the segment, and how many (ϑ, i)
        it has broadcast so far (they wait for exactly that many before the barrier)."""
        buf = np.array([self.segment + 1, self.sent], dtype=np.int64)
        for dest in range(self.q):
            if dest != self.rank:
                self.transport.send(dest, buf, TAG_DONE)
