"""The compiled B = 1 pump (``--engine compiled``; docs/runtime.md, "The compiled loop"): one numba loop
that the communication thread calls instead of ``recv_any`` + ``_process``.

It serves the two tags of the hot path in the runtime's own wire formats, so a job's parties speak the
same protocol as the Python path: ``AGGREGATION_TAG`` (``protocols/aggregation.py``: the header
``[kind, root, rid, aux]`` with the masked overflow word in ``aux``, one index or one partial sum) and
``TAG_THETA`` (``protocols.dispatch.pack``: ``[seq, 1, row, ϑ]`` as float64). It runs the dominator's
steps (ϑ from the problem, the broadcast, the SGD rule's own numba kernel) and applies every (ϑ, i) it
receives with the same kernel and writer slot as the Python inline path. Every check of the Python
receivers is made here too, before a row reaches a kernel. It waits by ``MPI_Iprobe`` and
``sched_yield``, then by ``MPI_Iprobe`` and ``nanosleep`` once a wait is long: with more ranks than cores
a spinning ``MPI_Recv`` holds a core the peer needs, and a rank yielding forever holds its share of the
cores against every other job.

It returns to Python (:mod:`parties.compiled_pump`) with one of the ``R_*`` codes: any other tag (the
message stays in ``buf``), masks running low, this rank's segment finished, an invalid message (why and
its sender in ``info``), a diverged step. MPI is called by name (``llvmlite`` loads the library mpi4py
loaded; ``numba.types.ExternalFunction``), so the kernels cache like the others.
"""

from __future__ import annotations

import re

import llvmlite.binding as llvm
import numpy as np
from numba import njit, types

from vertical import kernels

# --- what the pump returns (info[0] the sender, [1] the tag, [2] the bytes, [3] why, [4], [5] details)
R_MESSAGE, R_SEGMENT, R_MASKS, R_INVALID, R_DIVERGED, R_IDLE = 1, 2, 3, 4, 5, 6
# --- why a message is invalid (parties/compiled_pump.py words each as the Python receivers do)
(W_WORDS, W_LONG, W_KIND, W_ROOT, W_REQ_SENDER, W_AUX, W_REQ_RID, W_ROW, W_SUM_ROOT, W_SUM_RID, W_SUM_DUP,
 W_NOT_CHILD, W_SEQ, W_BATCH, W_THETA, W_UNREQUESTED, W_THETA_ROWS, W_SENDER, W_FLAGS,
 W_THETA_ROW, W_REQ_AHEAD, W_EARLY, W_REQ_WINDOW) = range(1, 24)
# --- slots of the int64 state vector ``s``
(ME, Q, NROWS, MI, SENT, NSTEPS, ISSUED, DONE, ACTIVE, LAZY, REG, GAP, PROBLEM, KICK, CAP, BYTE, COMM,
 ONCE, ANY_SRC, ANY_TAG, AGG_TAG, THETA_TAG, START_TAG, OVERFLOWED, INFLIGHT) = range(25)
S_SLOTS = 25
# --- columns of the per-root table ``t`` (int64, one row per party): the next request id (of a
# REQUEST to come, or to issue here), the oldest one not finished here, the root's next one to step
(NEXT, BELOW, STEPPED, PARENT0, PARENT1, CHILD0, CHILD1, ROOT_OK, WRITER) = range(9)
T_COLUMNS = 9
# --- fields of a request's slot in ``u`` (int64, per root and slot ``rid mod P``)
(SRID, SROW, STARTED, GOT0, GOT1, FWD0, FWD1, DONE_HERE, COMPLETE, FROW) = range(10)
U_FIELDS = 10
# --- slots of the float64 vector ``f``
GAMMA, LAM, LOG_A, DEADLINE = range(4)
F_SLOTS = 4
#: the problems the pump computes ϑ for (``vertical/problems.py``'s losses)
PROBLEMS = {"LogisticLoss": 0, "SquaredLoss": 1, "RobustLoss": 2}
REQUEST, MASKED = 1, 2
SCALE = 2.0**32  # FixedPointRing's default 32 fraction bits (protocols/masking.py)


def _load_mpi() -> None:
    """Make the MPI library that mpi4py loaded callable by name from compiled code."""
    from mpi4py import MPI  # noqa: F401  (loads the library)

    with open("/proc/self/maps") as fh:
        path = sorted(set(re.findall(r"\S*/libmpi\S*\.so[.\d]*", fh.read())))[0]
    llvm.load_library_permanently(path)


_load_mpi()
_I32, _PTR = types.int32, types.uintp
MPI_SEND = types.ExternalFunction("MPI_Send", _I32(_PTR, _I32, _I32, _I32, _I32, _I32))
MPI_RECV = types.ExternalFunction("MPI_Recv", _I32(_PTR, _I32, _I32, _I32, _I32, _I32, _PTR))
MPI_GET_COUNT = types.ExternalFunction("MPI_Get_count", _I32(_PTR, _I32, _PTR))
MPI_IPROBE = types.ExternalFunction("MPI_Iprobe", _I32(_I32, _I32, _I32, _PTR, _PTR))
SCHED_YIELD = types.ExternalFunction("sched_yield", _I32())
NANOSLEEP = types.ExternalFunction("nanosleep", _I32(_PTR, _PTR))
#: failed probes a wait yields the core between before it sleeps between them instead
YIELDS_BEFORE_SLEEP = 64
#: how long each of those sleeps asks for (the kernel's timer slack adds about 50 µs)
SLEEP_NS = 50_000
CLOCK_GETTIME = types.ExternalFunction("clock_gettime", _I32(_I32, _PTR))
CLOCK_MONOTONIC = 1  # Linux: what Python's time.monotonic reads


@njit(nogil=True, cache=True)
def monotonic(ts):
    """``time.monotonic()`` from compiled code (``ts``: two int64 words of scratch)."""
    CLOCK_GETTIME(CLOCK_MONOTONIC, ts.ctypes.data)
    return ts[0] + ts[1] * 1e-9


@njit(nogil=True, cache=True)
def _send(s, out, words, dest, tag):
    MPI_SEND(out.ctypes.data, np.int32(8 * words), np.int32(s[BYTE]), np.int32(dest), np.int32(tag),
             np.int32(s[COMM]))


@njit(nogil=True, cache=True)
def _invalid(info, why, a, b):
    info[3], info[4], info[5] = why, a, b
    return R_INVALID


@njit(nogil=True, cache=True)
def _dot(st, block, row):
    """This party's ŵ·x_row by the rule's own kernel (lazy: caught up to the clock, a pure read)."""
    s, f, rows, out = st[0], st[4], st[12], st[13]
    indptr, indices, data, w, mu, last, counters = block
    rows[0] = row
    if s[LAZY]:
        kernels.lazy_row_dots(indptr, indices, data, w, rows, out, mu, False, f[GAMMA], f[LAM], s[REG], last,
                              counters, f[LOG_A], s[GAP])
    else:
        kernels.row_dots(indptr, indices, data, w, rows, out)
    return out[0]


@njit(nogil=True, cache=True)
def _step(st, block, row, theta, writer):
    """One SGD step of (ϑ, row) in ``writer``'s slot by the rule's kernel (``SGDRule.apply``)."""
    s, f, rows, thetas = st[0], st[4], st[12], st[13]
    indptr, indices, data, w, mu, last, counters = block
    rows[0] = row
    thetas[0] = theta
    if s[LAZY]:
        kernels.lazy_apply(indptr, indices, data, w, rows, thetas, kernels.MODE_SGD, mu, mu, f[GAMMA], f[LAM],
                           s[REG], 1, last, counters, writer, f[LOG_A], s[GAP])
    else:
        kernels.sgd_apply(indptr, indices, data, w, rows, thetas, f[GAMMA], f[LAM], s[REG], 1)


@njit(nogil=True, cache=True)
def _theta(problem, z, y):
    """ϑ = ∂L/∂z (``vertical/problems.py``): logistic, squared, robust."""
    if problem == 0:
        return -y / (1.0 + np.exp(y * z))
    if problem == 1:
        return 2.0 * (z - y)
    u = z - y
    return 2.0 * u / (u * u + 2.0)


@njit(nogil=True, cache=True)
def _slot(st, r, rid):
    """The slot of request (r, rid) (``rid mod P``), opened for it if it holds an older one (the caller
    has checked that ``rid`` is inside the window). A finished request's row (``FROW``) and, at the
    root, a complete one's z waiting for its turn (``COMPLETE``, ``zs``) stay: its (ϑ, i) is checked
    against the row, and a sum for request rid + P (a hostile child's, early) must not lose its step."""
    s, acc, u, starts = st[0], st[2], st[16], st[17]
    k = rid % s[INFLIGHT]
    if u[r, k, SRID] != rid:
        u[r, k, SRID] = rid
        for c in range(SROW, COMPLETE):
            u[r, k, c] = 0
        for a in range(4):
            acc[a, r, k] = 0
        starts[r, k] = 0.0
    return k


@njit(nogil=True, cache=True)
def _start(st, block, r, k):
    """Contribute this party's masked ŵ·x to request (r, slot k): ``o + δ`` and ``count + ε`` up
    tree 1, ``δ`` and ``ε`` up tree 2 (``AggregationNode.start``)."""
    s, acc, ts, masks, u, starts = st[0], st[2], st[5], st[10], st[16], st[17]
    delta, epsilon = masks[s[MI]], masks[s[MI] + 1]
    s[MI] += 2
    scaled = _dot(st, block, u[r, k, SROW]) * SCALE
    bound = 2.0**62 / s[Q]
    fits = -bound <= scaled <= bound  # NaN fails too: it contributes 0 and counts
    acc[0, r, k] += np.uint64(np.int64(np.rint(scaled)) if fits else 0) + delta
    acc[1, r, k] += delta
    acc[2, r, k] += np.uint64(0 if fits else 1) + epsilon
    acc[3, r, k] += epsilon
    u[r, k, STARTED] = 1
    starts[r, k] = monotonic(ts)


@njit(nogil=True, cache=True)
def _finish(st, r, k):
    """Request (r, slot k) is done here; the oldest unfinished one moves on past every finished one."""
    s, t, u, starts = st[0], st[1], st[16], st[17]
    u[r, k, DONE_HERE] = 1
    u[r, k, FROW] = u[r, k, SROW]
    starts[r, k] = 0.0
    while True:
        b = t[r, BELOW] % s[INFLIGHT]
        if u[r, b, SRID] != t[r, BELOW] or not u[r, b, DONE_HERE]:
            return
        t[r, BELOW] += 1


@njit(nogil=True, cache=True)
def _issue(st, block):
    """This dominator's next REQUEST to every other party (``AggregationNode.announce``), and its own
    start; whether every child's sum was already in (only a hostile child can have sent them)."""
    s, t, out, seg_rows, u = st[0], st[1], st[7], st[11], st[16]
    me = s[ME]
    rid = t[me, NEXT]
    t[me, NEXT] += 1
    k = _slot(st, me, rid)
    row = seg_rows[s[ISSUED]]
    s[ISSUED] += 1
    u[me, k, SROW] = row
    out[0], out[1], out[2], out[3], out[4] = REQUEST, me, rid, 0, row
    for d in range(s[Q]):
        if d != me:
            _send(s, out, 5, d, s[AGG_TAG])
    _start(st, block, me, k)
    return k


@njit(nogil=True, cache=True)
def _may_issue(st):
    """Another step of the segment: steps left, and within the time budget (checked every 64 steps,
    as ``DominatedLoop._may_start``)."""
    s, f, ts = st[0], st[4], st[5]
    if s[ISSUED] >= s[NSTEPS]:
        return False
    return s[ISSUED] % 64 != 0 or f[DEADLINE] <= 0.0 or monotonic(ts) <= f[DEADLINE]


@njit(nogil=True, cache=True)
def _complete(st, k):
    """The root's request in slot k has every sum: its z (kept until its turn to step), or an error."""
    s, t, acc, info, u, zs = st[0], st[1], st[2], st[8], st[16], st[18]
    me = s[ME]
    if not u[me, k, STARTED] or u[me, k, COMPLETE]:
        return 0
    if u[me, k, GOT0] != t[me, CHILD0] or u[me, k, GOT1] != t[me, CHILD1]:
        return 0
    info[5] = u[me, k, SRID]
    flags = np.int64(acc[2, me, k] - acc[3, me, k])  # the masked overflow counts: only the root learns them
    if flags != 0:
        if flags < 0 or flags > s[Q]:
            info[0] = me
            return _invalid(info, W_FLAGS, flags, u[me, k, SRID])
        s[OVERFLOWED] = flags
        return R_DIVERGED
    zs[k] = np.float64(np.int64(acc[0, me, k] - acc[1, me, k])) / SCALE
    u[me, k, COMPLETE] = 1
    _finish(st, me, k)
    return 0


@njit(nogil=True, cache=True)
def _own_step(st, block, k):
    """The step of slot k's request, in request order: ϑ, its (ϑ, i) to every other party, the own step."""
    s, out, y, u, zs = st[0], st[7], st[9], st[16], st[18]
    me = s[ME]
    row = u[me, k, FROW]
    theta = _theta(s[PROBLEM], zs[k], y[row])
    if not np.isfinite(theta):
        return R_DIVERGED
    fo = out.view(np.float64)
    fo[0], fo[1], fo[2], fo[3] = s[SENT], 1.0, row, theta
    for d in range(s[Q]):
        if d != me:
            _send(s, out, 4, d, s[THETA_TAG])
    s[SENT] += 1
    _step(st, block, row, theta, 0)
    s[DONE] += 1
    u[me, k, COMPLETE] = 0
    return 0


@njit(nogil=True, cache=True)
def _drive(st, block):
    """The dominator's side: each complete request's step in request order, then new requests up to
    ``-P`` out (``DominatedLoop._drain``); ``R_SEGMENT`` once nothing is out and nothing may start."""
    s, t, u = st[0], st[1], st[16]
    me, p = s[ME], s[INFLIGHT]
    while True:
        while t[me, STEPPED] < t[me, NEXT] and u[me, t[me, STEPPED] % p, COMPLETE]:
            code = _own_step(st, block, t[me, STEPPED] % p)
            if code:
                return code
            t[me, STEPPED] += 1
        if t[me, NEXT] - t[me, STEPPED] < p and _may_issue(st):
            code = _complete(st, _issue(st, block))
            if code:
                return code
            continue
        if t[me, STEPPED] == t[me, NEXT] and s[ACTIVE]:
            s[ACTIVE] = 0
            return R_SEGMENT
        return 0


@njit(nogil=True, cache=True)
def _forward(st, r, k):
    """Send request (r, slot k)'s tree sums that are complete here to their parents."""
    s, t, acc, out, u = st[0], st[1], st[2], st[7], st[16]
    for c in range(2):
        if not u[r, k, FWD0 + c] and u[r, k, GOT0 + c] == t[r, CHILD0 + c] and t[r, PARENT0 + c] >= 0:
            out[0], out[1], out[2] = MASKED + c, r, u[r, k, SRID]
            out[3], out[4] = acc[2 + c, r, k], acc[c, r, k]
            _send(s, out, 5, t[r, PARENT0 + c], s[AGG_TAG])
            u[r, k, FWD0 + c] = 1


@njit(nogil=True, cache=True)
def _advance(st, block, r, k):
    """Request (r, slot k) after a change: forward what is complete here; at the root, a complete
    request waits for its turn and the dominator's side moves on (``AggregationNode._advance``)."""
    s, u = st[0], st[16]
    if not u[r, k, STARTED] or u[r, k, DONE_HERE]:
        return 0
    if r != s[ME]:
        _forward(st, r, k)
        if u[r, k, FWD0] and u[r, k, FWD1]:
            _finish(st, r, k)
        return 0
    code = _complete(st, k)
    if code or not u[r, k, COMPLETE]:
        return code
    return _drive(st, block)


@njit(nogil=True, cache=True)
def _on_request(st, block, src, r, rid, aux, index):
    """A REQUEST (``AggregationNode._on_request`` and the schedule's checks), then this party's start."""
    s, t, info, received, u = st[0], st[1], st[8], st[14], st[16]
    if src != r:
        return _invalid(info, W_REQ_SENDER, r, 0)
    if aux != 0:
        return _invalid(info, W_AUX, aux, 0)
    if rid != t[r, NEXT]:
        return _invalid(info, W_REQ_RID, rid, t[r, NEXT])
    if rid >= t[r, BELOW] + s[INFLIGHT]:
        return _invalid(info, W_REQ_WINDOW, rid, t[r, BELOW])
    if rid >= received[r] + s[INFLIGHT]:  # the schedule: at most -P requests ahead of their (ϑ, i)
        return _invalid(info, W_REQ_AHEAD, rid, received[r])
    if index < 0 or index >= s[NROWS]:
        return _invalid(info, W_ROW, index, s[NROWS])
    t[r, NEXT] += 1
    k = _slot(st, r, rid)
    u[r, k, SROW] = index
    _start(st, block, r, k)
    return _advance(st, block, r, k)


@njit(nogil=True, cache=True)
def _on_tree_sum(st, block, src, kind, r, rid, aux, value):
    """A child's partial sum of tree ``kind - 1`` (``AggregationNode._on_tree_sum``), for a request in
    the window of ``-P`` from the oldest unfinished one: added, and forwarded once complete. The tree
    pairs are fixed, so a non-child is refused at once."""
    s, t, acc, info, u = st[0], st[1], st[2], st[8], st[16]
    c = kind - MASKED
    bit = np.int64(1) << src
    if src == r:
        return _invalid(info, W_SUM_ROOT, r, rid)
    k = rid % s[INFLIGHT]
    if rid < t[r, BELOW] or rid >= t[r, BELOW] + s[INFLIGHT] or (u[r, k, SRID] == rid and u[r, k, DONE_HERE]):
        return _invalid(info, W_SUM_RID, rid, t[r, BELOW])
    k = _slot(st, r, rid)
    if u[r, k, GOT0 + c] & bit:
        return _invalid(info, W_SUM_DUP, c + 1, rid)
    if not t[r, CHILD0 + c] & bit:
        return _invalid(info, W_NOT_CHILD, c + 1, rid)
    u[r, k, GOT0 + c] |= bit
    acc[c, r, k] += value
    acc[2 + c, r, k] += aux
    return _advance(st, block, r, k)


@njit(nogil=True, cache=True)
def _on_aggregation(st, block, src, nbytes):
    """An ``AGGREGATION_TAG`` message: header and length (``AggregationNode.receive``), then its kind."""
    s, t, buf, info = st[0], st[1], st[6], st[8]
    if nbytes != 40:  # a 4-word header and this job's one index or one value
        return _invalid(info, W_WORDS, nbytes // 8 - 4, 1)
    kind, root = buf[0], buf[1]
    if kind < REQUEST or kind > MASKED + 1:
        return _invalid(info, W_KIND, np.int64(kind), 0)
    if root >= s[Q] or not t[np.int64(root), ROOT_OK]:
        return _invalid(info, W_ROOT, np.int64(root), 0)
    r, rid = np.int64(root), np.int64(buf[2])
    if kind == REQUEST:
        return _on_request(st, block, src, r, rid, np.int64(buf[3]), np.int64(buf[4]))
    return _on_tree_sum(st, block, src, np.int64(kind), r, rid, buf[3], buf[4])


@njit(nogil=True, cache=True)
def _on_theta(st, block, src, nbytes):
    """A (ϑ, i) message (``Inbox.unpack``, then the schedule: the broadcast of the request of the same
    number, finished here, for its row), applied at once in its dominator's writer slot."""
    s, t, buf, info, received, applied, u = st[0], st[1], st[6], st[8], st[14], st[15], st[16]
    if src == s[ME] or not t[src, ROOT_OK]:
        return _invalid(info, W_SENDER, 0, 0)
    if nbytes < 32 or nbytes > 32:
        return _invalid(info, W_WORDS, nbytes // 8, 4)
    fb = buf.view(np.float64)
    seq, b, row, theta = fb[0], fb[1], fb[2], fb[3]
    if b != 1.0:
        return _invalid(info, W_BATCH, 0, 0)
    if not (0.0 <= row < s[NROWS] and row == np.floor(row)):
        return _invalid(info, W_THETA_ROW, 0, s[NROWS])
    if not np.isfinite(theta):
        return _invalid(info, W_THETA, 0, 0)
    if seq != received[src]:
        return _invalid(info, W_SEQ, 0, received[src])
    number = np.int64(seq)
    if number >= t[src, NEXT]:
        return _invalid(info, W_UNREQUESTED, number, t[src, NEXT])
    k = number % s[INFLIGHT]
    if number >= t[src, BELOW] and not (u[src, k, SRID] == number and u[src, k, DONE_HERE]):
        return _invalid(info, W_EARLY, number, 0)
    if np.int64(row) != u[src, k, FROW]:
        return _invalid(info, W_THETA_ROWS, np.int64(row), u[src, k, FROW])
    received[src] += 1
    _step(st, block, np.int64(row), theta, t[src, WRITER])
    applied[src] += 1
    return 0


@njit(nogil=True, cache=True)
def _wait(s, info):
    """Wait for the next message by probing and yielding the core, then, once the wait is long
    (``YIELDS_BEFORE_SLEEP`` probes), probing and sleeping ``SLEEP_NS``: a rank that yields forever still
    takes its fair share of the cores from every other job. Its sender, tag and size in ``info``.
    Returns 0, or ``R_IDLE`` (``ONCE``: nothing was there)."""
    status = np.zeros(8, np.int32)
    flag = np.zeros(1, np.int32)
    count = np.zeros(1, np.int32)
    failed = 0
    while True:
        MPI_IPROBE(np.int32(s[ANY_SRC]), np.int32(s[ANY_TAG]), np.int32(s[COMM]), flag.ctypes.data,
                   status.ctypes.data)
        if flag[0]:
            break
        if s[ONCE]:
            return R_IDLE
        failed += 1
        if failed < YIELDS_BEFORE_SLEEP:
            SCHED_YIELD()
        else:  # a long wait: the peer is not running; sleeping frees the core for it and for other jobs
            nap = np.zeros(4, np.int64)  # two struct timespec (seconds, nanoseconds): asked, left
            nap[1] = SLEEP_NS
            NANOSLEEP(nap.ctypes.data, nap[2:].ctypes.data)
    MPI_GET_COUNT(status.ctypes.data, np.int32(s[BYTE]), count.ctypes.data)
    info[0], info[1], info[2] = status[2], status[3], count[0]
    return 0


@njit(nogil=True, cache=True)
def pump(st, block):
    """Serve the hot path until something is Python's (an ``R_*`` code; docs at the top)."""
    s, times, ts, buf, info, masks = st[0], st[3], st[5], st[6], st[8], st[10]
    status = np.zeros(8, np.int32)
    reserve = 2 * s[INFLIGHT] + 4  # one message starts at most -P requests here, two words each
    if s[MI] + reserve > masks.size:
        return R_MASKS
    if s[KICK]:  # the main thread started a segment: its first requests
        s[KICK] = 0
        code = _drive(st, block)
        if code:
            return code
    while True:
        if s[MI] + reserve > masks.size:
            return R_MASKS
        code = _wait(s, info)
        if code:
            return code
        src, tag, nbytes = info[0], info[1], info[2]
        if nbytes > 8 * s[CAP]:  # taken by Python, which refuses it naming the sender
            return R_MESSAGE
        MPI_RECV(buf.ctypes.data, np.int32(nbytes), np.int32(s[BYTE]), np.int32(src), np.int32(tag),
                 np.int32(s[COMM]), status.ctypes.data)
        if tag != s[AGG_TAG] and tag != s[THETA_TAG]:
            return R_MESSAGE
        if nbytes <= 0 or nbytes % 8:
            return _invalid(info, W_WORDS, -1, 0)
        now = monotonic(ts)
        times[0, src] = now
        times[1, src] = now
        if tag == s[AGG_TAG]:
            code = _on_aggregation(st, block, src, nbytes)
        else:
            code = _on_theta(st, block, src, nbytes)
        if code:
            return code
