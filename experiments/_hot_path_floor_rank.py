"""One rank of ``python -m experiments hot_path_floor`` (started by mpiexec): the B = 1 exchange of
``vfl train -n 4 -m 4 --algorithm sgd -B 1`` in one compiled event loop per rank, MPI called from numba
code through ctypes: no Python and no thread hand-off per message (issue 30, item 1: how fast the
structural change the issue proposes could be on this machine, before building it into the runtime).

Per update of dominator r, as in the runtime (docs/runtime.md): r sends ``REQUEST(r, rid, i)`` to every
other party; every party adds ``enc(w_l·x_il) + δ`` to its accumulator of tree 1 of r's pair
(``protocols/trees.py``, the job's own pairs) and ``δ`` to tree 2's, and forwards each to its parent once
its children's sums are in; r decodes ``z = ξ1 − ξ2`` (fixed point in Z_2^64; the masks are the runtime's
own keystream, :class:`protocols.masking.Keystream`, drawn before the loop), takes ϑ = −y σ(−y z), sends
``THETA(r, rid, i, ϑ)`` to every other party and steps its own block; each party steps on arrival. One
request is open per dominator (``--inflight 1``). Every message is checked on arrival (length, kind, root,
request id, row range, a sender that may send it); a bad one ends the rank naming its sender. The overflow
count travels masked in word 3, as in ``protocols/aggregation.py``. What this floor leaves out: liveness,
sealing, segments and evaluation.

argv: ``dataset updates_per_dominator gamma out.json spin|yield [check|forge]``. ``yield``: wait by probing
and yielding the core (:func:`run`); ``check``: γ = 0 and every rank knows every block (seeded), so each root
compares z with the plain Σ_l w_l·x_il (the masks must cancel exactly); ``forge``: the last rank first
sends party 0 a request for a row past the end, which must end the job naming it.
"""

from __future__ import annotations

import json
import re
import sys
import time

import llvmlite.binding as llvm
import numpy as np
import scipy.sparse as sp
from mpi4py import MPI
from numba import njit, types

from protocols.masking import Keystream
from protocols.trees import build_all_tree_pairs
from vertical.datasets import load
from vertical.partition import block_of, contiguous_blocks

REQUEST, TREE1, TREE2, THETA = 1, 2, 3, 4
WORDS = 5  # the longest message: THETA [kind, root, rid, row, ϑ bits]
FRACTION = 2.0**32
#: what the loop returns besides 0 (the caller turns it into one line naming the sender)
BAD_LENGTH, BAD_KIND, BAD_ROOT, BAD_RID, BAD_ROW, BAD_SENDER, BAD_Z, OVERFLOW = 1, 2, 3, 4, 5, 6, 7, 8
WHY = {BAD_LENGTH: "a message of the wrong length", BAD_KIND: "an unknown kind",
       BAD_ROOT: "a root out of range", BAD_RID: "a request id out of order", BAD_ROW: "a row out of range",
       BAD_SENDER: "a message it may not send", BAD_Z: "a sum that is not Σ w·x (check mode)",
       OVERFLOW: "scores out of the fixed point's range: the model diverged"}


def _load_mpi() -> None:
    """Make the MPI library mpi4py loaded visible to numba's linker, so that compiled code calls MPI_Send,
    MPI_Recv and MPI_Get_count by name (and numba can cache it, which ctypes pointers prevent)."""
    with open("/proc/self/maps") as fh:
        path = sorted(set(re.findall(r"\S*/libmpi\S*\.so[.\d]*", fh.read())))[0]
    llvm.load_library_permanently(path)


_load_mpi()
_I32, _PTR = types.int32, types.uintp  # MPICH's handles are ints; pointers pass as 64-bit integers
MPI_SEND = types.ExternalFunction("MPI_Send", _I32(_PTR, _I32, _I32, _I32, _I32, _I32))
MPI_RECV = types.ExternalFunction("MPI_Recv", _I32(_PTR, _I32, _I32, _I32, _I32, _I32, _PTR))
MPI_GET_COUNT = types.ExternalFunction("MPI_Get_count", _I32(_PTR, _I32, _PTR))
MPI_IPROBE = types.ExternalFunction("MPI_Iprobe", _I32(_I32, _I32, _I32, _PTR, _PTR))
SCHED_YIELD = types.ExternalFunction("sched_yield", _I32())  # the C library's, loaded in every process


@njit(nogil=True, cache=True)
def _send(out, words, dest, u64, comm):
    MPI_SEND(out.ctypes.data, words, u64, dest, 0, comm)


@njit(nogil=True, cache=True)
def _dot(indptr, indices, data, w, row):
    s = 0.0
    for k in range(indptr[row], indptr[row + 1]):
        s += data[k] * w[indices[k]]
    return s


@njit(nogil=True, cache=True)
def _step(indptr, indices, data, w, row, theta, gamma):
    for k in range(indptr[row], indptr[row + 1]):
        w[indices[k]] -= gamma * theta * data[k]


@njit(nogil=True, cache=True)
def _full_dot(full, w_all, i):
    """Σ_l w_l·x_il in clear, from the whole matrix (check mode only)."""
    indptr, indices, data = full
    return _dot(indptr, indices, data, w_all, i)


@njit(nogil=True, cache=True)
def _broadcast(out, words, me, q, u64, comm):
    for d in range(q):
        if d != me:
            _send(out, words, d, u64, comm)


@njit(nogil=True, cache=True)
def run(me, q, n, u64, comm, parents, block, w, y, rows, masks, gamma, full, w_all, check, yielding, info):
    """The event loop of rank ``me`` until every dominator's ``rows.size`` updates are done here; returns
    0, or an error code (:data:`WHY`) with the sender in ``info[0]``. ``parents[t, r, p]``: the parent of
    party p in tree t of root r's pair (−1 at r); ``block``: this rank's columns (CSR arrays).
    ``yielding``: wait for a message by ``MPI_Iprobe`` and ``sched_yield`` between probes, instead of in
    MPICH's ``MPI_Recv``, which spins (with more ranks than cores, a spinning rank holds a core that the
    rank it waits for needs)."""
    indptr, indices, data = block
    N = rows.size
    if N == 0:
        return 0
    children = np.zeros((2, q), np.int64)
    for t in range(2):
        for r in range(q):
            for p in range(q):
                if parents[t, r, p] == me:
                    children[t, r] += 1
    acc = np.zeros((2, q), np.uint64)
    flags = np.zeros((2, q), np.uint64)  # the masked overflow counts, summed up the trees as the values
    max_abs = 2.0**62 / (q * FRACTION)  # protocols/masking.py: one bit of headroom for a q-party sum
    got = np.zeros((2, q), np.int64)
    fwd = np.zeros((2, q), np.bool_)
    started = np.zeros(q, np.bool_)
    rid = np.zeros(q, np.int64)  # per root: its open (or next) request id, here
    row_of = np.zeros(q, np.int64)
    buf = np.zeros(8, np.uint64)
    out = np.zeros(WORDS, np.uint64)
    status = np.zeros(5, np.int32)
    cnt = np.zeros(1, np.int32)
    flag = np.zeros(1, np.int32)
    mi, own, thetas = 0, 0, 0
    out[0], out[1], out[2], out[3] = REQUEST, me, 0, rows[0]
    _broadcast(out, 4, me, q, u64, comm)
    row_of[me] = rows[0]
    start = me  # the request to start next: this rank's own, or one whose REQUEST just arrived
    while own < N or thetas < (q - 1) * N:
        if start >= 0:
            r, start = start, -1
            delta, epsilon = masks[mi], masks[mi + 1]
            mi += 2
            mine = _dot(indptr, indices, data, w, row_of[r])
            fits = abs(mine) <= max_abs  # NaN fails too: it contributes 0 and counts, masked like a value
            acc[0, r] += np.uint64(np.int64(np.rint(mine * FRACTION) if fits else 0.0)) + delta
            acc[1, r] += delta
            flags[0, r] += np.uint64(0 if fits else 1) + epsilon
            flags[1, r] += epsilon
            started[r] = True
        else:
            if yielding:
                while True:
                    MPI_IPROBE(-2, -1, comm, flag.ctypes.data, status.ctypes.data)
                    if flag[0]:
                        break
                    SCHED_YIELD()
            MPI_RECV(buf.ctypes.data, 8, u64, -2, -1, comm, status.ctypes.data)
            MPI_GET_COUNT(status.ctypes.data, u64, cnt.ctypes.data)
            src, words, kind = status[2], cnt[0], buf[0]
            info[0] = src
            if words < 4 or words > WORDS:
                return BAD_LENGTH
            if buf[1] >= q:
                return BAD_ROOT
            r = np.int64(buf[1])
            if kind in (REQUEST, THETA):
                if src != r or r == me or words != (4 if kind == REQUEST else 5):
                    return BAD_SENDER
                if buf[3] >= n:
                    return BAD_ROW
                if kind == REQUEST:
                    if np.int64(buf[2]) != rid[r] or started[r]:
                        return BAD_RID
                    row_of[r] = np.int64(buf[3])
                    start = r
                    continue
                if np.int64(buf[2]) != rid[r] - 1 or np.int64(buf[3]) != row_of[r]:
                    return BAD_RID
                _step(indptr, indices, data, w, row_of[r], buf[4:5].view(np.float64)[0], gamma)
                thetas += 1
                continue
            if kind != TREE1 and kind != TREE2:
                return BAD_KIND
            t = np.int64(kind) - TREE1
            if words != 5:
                return BAD_LENGTH
            if np.int64(buf[2]) != rid[r]:
                return BAD_RID
            if parents[t, r, src] != me or got[t, r] >= children[t, r]:
                return BAD_SENDER
            acc[t, r] += buf[4]
            flags[t, r] += buf[3]
            got[t, r] += 1
        for r in range(q):  # forward what is complete; the root completes its request
            if not started[r]:
                continue
            for t in range(2):
                if not fwd[t, r] and got[t, r] == children[t, r] and parents[t, r, me] >= 0:
                    out[0], out[1], out[2], out[3], out[4] = TREE1 + t, r, rid[r], flags[t, r], acc[t, r]
                    _send(out, 5, parents[t, r, me], u64, comm)
                    fwd[t, r] = True
            done = fwd[0, r] and fwd[1, r] if r != me else \
                got[0, r] == children[0, r] and got[1, r] == children[1, r]
            if not done:
                continue
            if r == me:
                i = row_of[r]
                if flags[0, r] - flags[1, r] != 0:
                    info[0] = me
                    return OVERFLOW
                z = np.float64(np.int64(acc[0, r] - acc[1, r])) / FRACTION
                if check and abs(z - _full_dot(full, w_all, i)) > 1e-6 * (1.0 + abs(z)):
                    info[0] = me
                    return BAD_Z
                theta = -y[i] / (1.0 + np.exp(y[i] * z))
                out[0], out[1], out[2], out[3] = THETA, me, rid[r], i
                out[4:5].view(np.float64)[0] = theta
                _broadcast(out, 5, me, q, u64, comm)
                _step(indptr, indices, data, w, i, theta, gamma)
                own += 1
            acc[0, r] = acc[1, r] = flags[0, r] = flags[1, r] = 0
            got[0, r] = got[1, r] = 0
            fwd[0, r] = fwd[1, r] = False
            started[r] = False
            rid[r] += 1
            if r == me and own < N:
                out[0], out[1], out[2], out[3] = REQUEST, me, rid[r], rows[own]
                _broadcast(out, 4, me, q, u64, comm)
                row_of[me] = rows[own]
                start = me
    info[0] = -1
    return 0


def compile_once() -> None:
    """Compile :func:`run` for the types :func:`main` passes, into numba's cache, in this one process (the
    ranks then load it instead of each compiling it on the same cores)."""
    i64, f64 = np.zeros(1, np.int64), np.zeros(1)
    run(0, 1, 1, 0, 0, np.zeros((2, 1, 1), np.int64), (i64, i64, f64), f64, f64, i64[:0],
        np.zeros(1, np.uint64), 0.0, (i64, i64, f64), f64, False, False, np.zeros(1, np.int64))


def main(argv: list[str]) -> None:
    dataset, per_dominator, gamma, out = argv[0], int(argv[1]), float(argv[2]), argv[3]
    yielding = argv[4] == "yield"
    check, forge = argv[5:6] == ["check"], argv[5:6] == ["forge"]
    comm = MPI.COMM_WORLD
    me, q = comm.Get_rank(), comm.Get_size()
    ds = load(dataset, seed=0)
    X = sp.csr_matrix(ds.X_train)
    X.sort_indices()
    n, d = X.shape
    cols = contiguous_blocks(d, q)[me]
    mine = block_of(X, cols).tocsr()
    block = (mine.indptr.astype(np.int64), mine.indices.astype(np.int64), mine.data.astype(np.float64))
    rng = np.random.default_rng(7)
    w_all = rng.normal(size=d) * 0.01 if check else np.zeros(d)
    w = w_all[cols].copy()
    full = (X.indptr.astype(np.int64), X.indices.astype(np.int64), X.data.astype(np.float64)) if check else \
        (np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0))
    pairs = build_all_tree_pairs(q, 0)
    parents = np.array([[pairs[r].tree(t).parent for r in range(q)] for t in range(2)], dtype=np.int64)
    rows = np.random.default_rng([0, me]).integers(0, n, per_dominator).astype(np.int64)
    keystream = Keystream()
    masks = keystream.words(2 * q * per_dominator).copy()
    u64, world = MPI._handleof(MPI.UINT64_T), MPI._handleof(comm)
    info = np.zeros(1, np.int64)
    y = ds.y_train.astype(np.float64)
    run(me, q, n, u64, world, parents, block, w, y, rows[:1], masks, 0.0, full, w_all, check, yielding, info)
    comm.Barrier()
    rows = np.random.default_rng([1, me]).integers(0, n, per_dominator).astype(np.int64)
    masks = keystream.words(2 * q * per_dominator).copy()
    w = w_all[cols].copy()
    if forge and me == q - 1:
        comm.Send(np.array([REQUEST, me, 0, n], np.uint64), dest=0, tag=0)
    comm.Barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    code = run(me, q, n, u64, world, parents, block, w, y, rows, masks, 0.0 if check else gamma, full, w_all,
               check, yielding, info)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if code:
        line = f"[party {me}] " + (WHY[code] if code == OVERFLOW else f"party {info[0]} sent {WHY[code]}")
        with open(f"{out}.error-{me}", "w") as fh:  # a line printed just before Abort may be lost
            fh.write(line + "\n")
        print(line, file=sys.stderr, flush=True)
        comm.Abort(3)
    walls = comm.gather(wall, root=0)
    cpus = comm.gather(cpu, root=0)
    blocks = comm.gather(w, root=0)
    if me == 0:
        w_final = np.zeros(d)
        for r in range(q):
            w_final[contiguous_blocks(d, q)[r]] = blocks[r]
        Xt = ds.X_test
        scores = Xt @ w_final
        result = {"q": q, "updates": q * per_dominator, "train_time": max(walls), "cpu_s": sum(cpus),
                  "ms_per_update": 1e3 * max(walls) / (q * per_dominator), "checked": check,
                  "test_accuracy": float(np.mean(np.where(scores >= 0, 1.0, -1.0) == ds.y_test))}
        with open(out, "w") as fh:
            json.dump(result, fh)


if __name__ == "__main__":
    main(sys.argv[1:])
