"""The Python side of the compiled B = 1 pump (``--engine compiled``; ``parties/compiled_loop.py``).

The communication thread calls :func:`~parties.compiled_loop.pump` in a loop and does here what the
pump hands back: every message of another tag (DONE, heartbeats, STOP) goes through the Python
path's own checks and handlers (``check_envelope``, ``DataPlane._process``); the masks are refilled
from a :class:`~protocols.masking.Keystream`; the end of this rank's segment wakes the main thread; an
invalid message becomes the ``ProtocolViolation`` naming its sender, worded as the Python receivers
word it. The pump's state lives in numpy arrays shared with the plane (the applied and received counts
the drain and ``DONE`` checks read, ``last_heard``, the liveness clock), so the heartbeat thread's
checks read them as they are.
"""

from __future__ import annotations

import threading
import time

import numpy as np
from mpi4py import MPI

from parties import compiled_loop as cl
from parties.lifecycle import stop_job
from parties.messages import (
    MESSAGE_KINDS,
    TAG_HEARTBEAT,
    TAG_STOP,
    TAG_THETA,
    TAG_THETA_REQUEST,
    check_envelope,
)
from parties.party_model import Diverged
from protocols.errors import ProtocolViolation
from protocols.masking import AggregationOverflowError, Keystream
from protocols.transport import AGGREGATION_TAG

#: the self-message by which the main thread starts a segment (never sent between parties)
TAG_PUMP_START = 0x9B57
#: mask words drawn at a time (two per request a party contributes to)
MASK_WORDS = 1 << 14

_AGG = "aggregation message"
_THETA = "(ϑ, i) message"


class CompiledPump:
    """One party's pump: its state arrays (built from the plane's), the loop the communication thread
    runs (:meth:`serve`), the segment start of the main thread (:meth:`dominate`), and the partial-sum
    deadlines of the heartbeat thread (:meth:`check_partial_sums`)."""

    def __init__(self, plane) -> None:
        self.plane = plane
        party, rule = plane.party, plane.party.rule
        q, me = plane.q, plane.rank
        s = np.zeros(cl.S_SLOTS, np.int64)
        s[[cl.ME, cl.Q, cl.NROWS, cl.MI]] = me, q, party.block.n_rows, MASK_WORDS
        s[[cl.LAZY, cl.REG, cl.GAP, cl.PROBLEM]] = rule.lazy, rule.reg, rule.exact_gap, problem_code(party)
        s[[cl.CAP, cl.BYTE, cl.COMM]] = plane.max_words, handle(MPI.BYTE), handle(plane.data)
        s[[cl.ANY_SRC, cl.ANY_TAG]] = MPI.ANY_SOURCE, MPI.ANY_TAG
        s[[cl.AGG_TAG, cl.THETA_TAG, cl.START_TAG]] = AGGREGATION_TAG, TAG_THETA, TAG_PUMP_START
        s[cl.INFLIGHT] = p = plane.inflight
        t = np.zeros((q, cl.T_COLUMNS), np.int64)
        for r, role in enumerate(plane.node._roles):
            t[r, [cl.PARENT0, cl.PARENT1]] = role.parents
            t[r, [cl.CHILD0, cl.CHILD1]] = role.children
        t[:, cl.ROOT_OK] = [r in plane.active_ranks for r in range(q)]
        t[:, cl.WRITER] = plane._writer_of
        #: per root and slot (request id mod -P): the request it holds and its progress here
        self.u = np.zeros((q, p, cl.U_FIELDS), np.int64)
        self.u[:, :, [cl.SRID, cl.FROW]] = -1
        #: per root and slot: when this party started the request (0: not open here)
        self.starts = np.zeros((q, p))
        #: per party: when it last delivered (the liveness clock, the plane's last_heard), and the start
        #: of its open request here (0: none)
        self.times = np.zeros((2, q))
        self.times[0], self.times[1] = plane.liveness.heard, plane.last_heard
        plane.liveness.heard, plane.last_heard = self.times[0], self.times[1]
        y = _writable(np.ascontiguousarray(party.y, np.float64)) if party.active else np.zeros(1)
        self.keystream = Keystream()
        self.s, self.t, self.f = s, t, np.zeros(cl.F_SLOTS)
        self.state = [s, t, np.zeros((4, q, p), np.uint64), self.times, self.f, np.zeros(2, np.int64),
                      np.zeros(plane.max_words, np.uint64), np.zeros(8, np.uint64), np.zeros(8, np.int64), y,
                      np.zeros(MASK_WORDS, np.uint64), np.zeros(1, np.int64), np.zeros(1, np.int64),
                      np.zeros(1), plane.inbox.received, plane.applied, self.u, self.starts, np.zeros(p)]
        b = party.block
        self.block = (b.indptr, b.indices, b.data, party.w, rule.mu, rule.last, rule.counters)
        self._rule()
        plane.part.on_new_step = self._rule  # --gamma-decay reaches every party's pump, passive ones too
        self._next: tuple | None = None  # (rows, deadline, segment) the main thread hands over
        self._segment = None

    def _rule(self) -> None:
        """γ and its logarithm now (``--gamma-decay`` changes them between segments)."""
        rule = self.plane.party.rule
        self.f[[cl.GAMMA, cl.LAM, cl.LOG_A]] = rule.gamma, rule.lam, rule._log_a

    def warm_up(self) -> None:
        """Compile the pump now (a probe of ``COMM_SELF``, where nothing comes), not in training time."""
        state = list(self.state)
        state[0] = self.s.copy()
        state[0][[cl.COMM, cl.ONCE, cl.MI]] = handle(MPI.COMM_SELF), 1, 0
        code = cl.pump(tuple(state), self.block)
        assert code == cl.R_IDLE, code

    # ------------------------------------------------------------------------------ the main thread

    def dominate(self, rows: np.ndarray, deadline: float | None) -> int:
        """Run this dominator's segment over ``rows`` (one row a step); returns the steps done."""
        s = self.s
        s[cl.NSTEPS], s[cl.ISSUED], s[cl.DONE] = rows.size, 0, 0
        budget = 0.0 if deadline is None else time.monotonic() + max(deadline - time.perf_counter(), 1e-9)
        finished = threading.Event()
        self._next = (np.ascontiguousarray(rows, np.int64).ravel(), budget, finished)
        self.plane.transport.send(self.plane.rank, np.zeros(1, np.uint64), TAG_PUMP_START)
        finished.wait()
        return int(s[cl.DONE])

    # ------------------------------------------------------------------------ the communication thread

    def serve(self) -> None:
        """The communication thread's loop: the pump, and what it hands back, until every STOP is in."""
        while True:
            code = cl.pump(tuple(self.state), self.block)
            if code == cl.R_MESSAGE:
                if self._message():
                    return
            elif code == cl.R_SEGMENT:
                self.plane.sent = int(self.s[cl.SENT])
                self._segment.set()
            elif code == cl.R_MASKS:
                self.state[10][:] = self.keystream.words(MASK_WORDS)
                self.s[cl.MI] = 0
            elif code == cl.R_INVALID:
                raise self.violation()
            else:
                self._diverged()

    def _message(self) -> bool:
        """A message of another tag, in the pump's buffer: the Python path's checks and handler; whether
        every party's STOP is in."""
        plane = self.plane
        source, tag, nbytes = (int(v) for v in self.state[8][:3])
        if nbytes > 8 * self.s[cl.CAP]:
            raise ProtocolViolation(source, MESSAGE_KINDS.get(tag, "message"), f"longer than the "
                                    f"{8 * self.s[cl.CAP]} bytes expected")
        if tag == TAG_PUMP_START and source == plane.rank:
            self._start()
            return False
        check_envelope(source, tag, nbytes, rank=plane.rank, active_ranks=plane.active_ranks,
                       synchronous=False)
        if tag != TAG_HEARTBEAT:
            plane.liveness.delivered(source)
        plane.last_heard[source] = time.monotonic()
        if tag == TAG_THETA_REQUEST:
            raise ProtocolViolation(source, MESSAGE_KINDS[tag], "this job does not piggyback")
        message = self.state[6][:nbytes // 8].copy()
        if tag == TAG_STOP:
            return plane._on_stop(source)
        plane._process(source, tag, message)
        return False

    def _start(self) -> None:
        """The main thread's segment: its rows into the pump's state, the first request on the next call."""
        rows, budget, finished = self._next
        self._rule()
        self.f[cl.DEADLINE] = budget
        self.state[11] = rows
        self._segment = finished
        self.s[cl.ACTIVE], self.s[cl.KICK] = 1, 1

    def _diverged(self) -> None:
        plane, flags = self.plane, int(self.s[cl.OVERFLOWED])
        rid = int(self.state[8][5])
        if flags:
            raise AggregationOverflowError(
                f"request ({plane.rank}, {rid}): {flags} contributed value(s) were NaN/inf or too large for "
                f"the fixed-point encoding; the sum would be wrong. Scale the values down or use fewer "
                f"fraction bits.")
        why = "ϑ is not finite: the run diverged (lower --gamma)"
        stop_job(plane.data, plane.rank, "diverged", why)
        raise Diverged(why)

    def violation(self) -> ProtocolViolation:
        """The pump's invalid message as the Python receivers word it, naming its sender."""
        info, plane = self.state[8].tolist(), self.plane
        source, tag, nbytes, why, a, b = info[:6]
        if why == cl.W_FLAGS:
            return ProtocolViolation(source, _AGG, f"the overflow flags of request ({plane.rank}, {b}) sum "
                                     f"to {a}, more than the {plane.q} entries; a party sent corrupt flags")
        check_envelope(source, tag, nbytes, rank=plane.rank, active_ranks=plane.active_ranks,
                       synchronous=False)
        seq = int(self.state[14][source])  # the (ϑ, i) number expected from it
        what, detail = explain(why, a, b, source, plane.rank, self.s[cl.NROWS], seq, int(self.s[cl.INFLIGHT]))
        return ProtocolViolation(source, what, detail)

    # ------------------------------------------------------------------------------ the heartbeat thread

    def check_partial_sums(self) -> None:
        """Every request started here: a child that has delivered nothing for its limit since this party
        started the request ends the job naming it (``DataPlane._check_partial_sums``)."""
        u, plane = self.u, self.plane
        for r in range(plane.q):
            for k in range(u.shape[1]):
                since = float(self.starts[r, k])
                if not since or not u[r, k, cl.STARTED] or u[r, k, cl.DONE_HERE]:
                    continue
                awaited = self._awaited(r, k)
                if awaited:
                    rid = int(u[r, k, cl.SRID])
                    plane.liveness.check(awaited, since, f"its partial sum of request ({r}, {rid})")

    def _awaited(self, r: int, k: int) -> dict[int, int]:
        """The children whose sums request (r, slot k) still waits for, each at its subtree's height."""
        t, u, awaited = self.t, self.u, {}
        for c in (0, 1):
            if u[r, k, cl.FWD0 + c]:
                continue
            missing = int(t[r, cl.CHILD0 + c]) & ~int(u[r, k, cl.GOT0 + c])
            heights = self.plane.node._heights[r][c]
            for child in (p for p in range(self.plane.q) if missing >> p & 1):
                awaited[child] = min(awaited.get(child, heights[child]), heights[child])
        return awaited


def handle(obj) -> int:
    """An MPI handle as the C int MPICH's calls take (mpi4py gives it unsigned)."""
    h = MPI._handleof(obj) & 0xFFFFFFFF  # a C int, sign-extended to 64 bits
    return h - (1 << 32) if h >= 1 << 31 else h


def problem_code(party) -> int:
    """The pump's code of the party's loss (``vertical/problems.py``); only a label holder needs one."""
    if not party.active:
        return 0
    return cl.PROBLEMS[type(party.problem.loss).__name__]


def explain(why: int, a: int, b: int, source: int, rank: int, n_rows: int, seq: int,
            p: int) -> tuple[str, str]:
    """(what, detail) of an invalid message, in the Python receivers' words."""
    words = {
        cl.W_WORDS: (_AGG, f"{a} values where every message of this job has {b}") if b == 1 else
        (_THETA, f"{a} words for B = 1 is {'truncated' if a < b else 'over-long'} (expected exactly {b})"),
        cl.W_KIND: (_AGG, f"unknown message kind {a}"),
        cl.W_ROOT: (_AGG, f"root {a} is not a dominator"),
        cl.W_REQ_SENDER: ("REQUEST", f"REQUEST for root {a} came from party {source}"),
        cl.W_AUX: ("REQUEST", f"header word 3 is {a}, not 0"),
        cl.W_REQ_RID: ("REQUEST", f"request id {a} where {b} was expected (a duplicate, replay or one too "
                                  f"far ahead)"),
        cl.W_REQ_AHEAD: ("REQUEST", f"request id {a} before its (ϑ, i) #{b} arrived: no more than --inflight "
                                    f"({p}) may run ahead of its broadcasts"),
        cl.W_REQ_WINDOW: ("REQUEST", f"request id {a} is more than {p} ahead of the oldest open one ({b}): "
                                     f"more requests open at once than the job allows"),
        cl.W_ROW: ("REQUEST", f"sample indices {a}..{a} are not in 0..{n_rows - 1}"),
        cl.W_THETA_ROW: (_THETA, f"a row is not an integer in 0..{n_rows - 1}"),
        cl.W_SUM_ROOT: (_AGG, f"the root of request ({a}, {b}) has no parent to send a tree sum to"),
        cl.W_SUM_RID: (_AGG, f"request id {a} where {b} is open at party {rank} (a duplicate, a late "
                             f"contribution or one too far ahead)"),
        cl.W_SUM_DUP: (_AGG, f"party {rank} got a second tree-{a} sum for request {b} from {source}"),
        cl.W_NOT_CHILD: (_AGG, f"party {source} is not a tree-{a} child of {rank} for request {b}"),
        cl.W_SEQ: (_THETA, f"a sequence number out of order (#{seq} was expected)"),
        cl.W_BATCH: (_THETA, "batch size B is not 1"),
        cl.W_THETA: (_THETA, "ϑ is not finite"),
        cl.W_EARLY: (_THETA, f"#{a} came before its request was aggregated (party contributions to "
                             f"({source}, {a}) are still due)"),
        cl.W_UNREQUESTED: (_THETA, f"#{a} is for a step it never requested, or one not yet aggregated "
                                   f"here (its next request is #{b})"),
        cl.W_THETA_ROWS: (_THETA, f"#{seq} is for rows [{a}] where its request aggregated rows [{b}]"),
        cl.W_SENDER: (_THETA, f"party {source} may not send it to party {rank}"),
    }
    return words.get(why, ("message", f"invalid (code {why})"))


def _writable(array: np.ndarray) -> np.ndarray:
    """``array``, copied if it is read-only (labels read from a read-only buffer): numba compiles one pump
    per read-only flag, and a first job with read-only labels compiled its own in every rank at once
    (30 s of a 0.02 s job on 2 cores), past the cache the launcher warms. A memory-mapped block is not
    copied (it may be the size of the data): the first compiled job on a party folder still compiles
    its own pump, once per checkout (compiling both in :func:`compile_once` took 51 s instead of 27)."""
    return array if array.flags.writeable else array.copy()


def compile_once() -> None:
    """Compile the pump into numba's cache in this one process, for the types a party passes (a test
    session or a benchmark calls it first, so that the ranks load it instead of each compiling it)."""
    from vertical.algorithms.vfb2 import Block, get_rule
    from vertical.problems import get_problem

    block, problem = Block.from_matrix(np.eye(2)), get_problem("logistic", lam=0.1)
    rule = get_rule("sgd")(block, problem.regularizer, problem.lam, 0.1)
    s = np.zeros(cl.S_SLOTS, np.int64)
    s[[cl.COMM, cl.BYTE, cl.ONCE, cl.ANY_SRC, cl.ANY_TAG, cl.INFLIGHT]] = (
        handle(MPI.COMM_SELF), handle(MPI.BYTE), 1, MPI.ANY_SOURCE, MPI.ANY_TAG, 1)
    i64, u64 = np.zeros(1, np.int64), np.zeros(8, np.uint64)
    state = (s, np.zeros((1, cl.T_COLUMNS), np.int64), np.zeros((4, 1, 1), np.uint64), np.zeros((2, 1)),
             np.zeros(cl.F_SLOTS), np.zeros(2, np.int64), u64.copy(), u64.copy(), np.zeros(8, np.int64),
             np.zeros(1), np.zeros(16, np.uint64), i64.copy(), i64.copy(), np.zeros(1), i64.copy(),
             i64.copy(), np.zeros((1, 1, cl.U_FIELDS), np.int64), np.zeros((1, 1)), np.zeros(1))
    code = cl.pump(state, (block.indptr, block.indices, block.data, np.zeros(2), rule.mu, rule.last,
                           rule.counters))
    assert code == cl.R_IDLE, code
