"""Secure aggregation of w·x across parties (Algorithm 1 of VFB²): the public library calls.

Each party ``l`` holds a block ``w_l`` of a linear model and the matching feature block ``X_l`` of every
sample. ``secure_inner_product`` gives one party, the *root*, the scores ``z_i = Σ_l w_l·x_i^(l)`` for a
batch of sample indices, while every message on the wire is masked: masked values travel up one tree and
masks up another (:mod:`protocols.trees`), so no party sees another party's partial product
``w_l·x_i^(l)``. The root learns the scores, hence the sum of the other parties' products: that is the
output, not a leak the trees could prevent (read ``docs/secure-aggregation.md`` for the security model and
its caveats).

Both calls are **collective**: every rank of the communicator calls them, in the same order, with the same
``root``, ``seed`` and ``masking``. The result is returned at the root, ``None`` elsewhere.

Example (save as ``demo.py``; run ``mpiexec -n 4 python -m mpi4py demo.py``)::

    import numpy as np
    from mpi4py import MPI
    from protocols.secure_aggregation import secure_inner_product

    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(comm.rank)            # every party's private block
    X_local, w_local = rng.normal(size=(1000, 5)), rng.normal(size=5)
    indices = np.arange(8) if comm.rank == 0 else None  # only the root needs to know them
    z = secure_inner_product(comm, w_local, X_local, indices, root=0)
    if comm.rank == 0:
        print(z)                                       # 8 scores, = X @ w over all parties' blocks

Decisions:

* The functional calls keep one :class:`SecureAggregator` per ``(communicator, seed, masking)``, cached on
  the communicator with MPI attribute caching; it runs on a duplicate of the communicator, so its messages
  never match the caller's receives. For explicit lifetime use :meth:`SecureAggregator.over_mpi`.
* In ``secure_inner_product`` only the root needs the indices: it announces them with a ``REQUEST``
  message, as the VFB² runtime does; other ranks may pass ``None`` (or the same indices, which is checked).
* Errors every rank detects identically (q = 2 without opt-in, a bad root) are raised everywhere before
  any message is sent. Complex input is refused (``TypeError``), never silently made real.
* Whatever another party sends is validated where it is received (transport frame, header, lengths,
  indices); a bad message raises :class:`~protocols.errors.ProtocolViolation` naming the sender.
* A party's value that cannot be encoded does not stop the protocol; the root raises
  :class:`~protocols.masking.AggregationOverflowError` instead of returning a wrong sum.
* With a :class:`~protocols.liveness.Liveness` (the VFB² runtime passes its own) every wait has a deadline:
  a party waits for a child's partial sum at the level of the child's subtree height, for the root's
  ``REQUEST`` and for its receivers to take what it sent at the level of a barrier-time exchange, and a
  peer silent past the limit raises :class:`~protocols.liveness.PeerTimeout` naming it. Without one
  (the functional calls) the calls wait as long as it takes.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import scipy.sparse as sp
from mpi4py import MPI
from numpy.typing import ArrayLike, NDArray

from protocols.aggregation import (
    DEFAULT_MAX_BATCH,
    HEADER_WORDS,
    AggregationNode,
    Completed,
    ProtocolError,
    Requested,
    Step,
)
from protocols.channels import OVERHEAD_WORDS, SecureChannels
from protocols.errors import ProtocolViolation
from protocols.liveness import Liveness
from protocols.masking import (
    AggregationOverflowError,
    FixedPointRing,
    MaskingScheme,
    RealValued,
    as_real_vector,
)
from protocols.transport import MpiTransport, Transport
from protocols.trees import TreePair, build_all_tree_pairs

__all__ = [
    "AggregationOverflowError",
    "FixedPointRing",
    "RealValued",
    "SecureAggregator",
    "local_scores",
    "secure_inner_product",
    "secure_sum",
]


class SecureAggregator:
    """One party's endpoint for repeated secure aggregations over ``transport`` (collective calls).

    ``seed`` selects the tree pairs (the same at every party); ``tree_pairs`` overrides them (one
    validated pair per root). ``masking`` defaults to :class:`~protocols.masking.FixedPointRing` with 32
    fraction bits. q = 2 is refused unless ``allow_leaky_q2`` (see :mod:`protocols.trees`). ``max_batch``
    bounds how many values one request may carry: messages from other parties claiming more are
    rejected (:class:`~protocols.errors.ProtocolViolation`), and :meth:`over_mpi` sizes its transport's
    largest accepted message from it.
    """

    def __init__(self, transport: Transport, *, seed: int = 0, masking: MaskingScheme | None = None,
                 tree_pairs: tuple[TreePair, ...] | None = None, allow_leaky_q2: bool = False,
                 max_batch: int = DEFAULT_MAX_BATCH, liveness: Liveness | None = None) -> None:
        size = transport.size
        if size < 2:
            raise ValueError(f"secure aggregation needs at least 2 parties, the communicator has {size}")
        pairs = tree_pairs if tree_pairs is not None else build_all_tree_pairs(
            size, seed, allow_leaky_q2=allow_leaky_q2)
        self.transport = transport
        self.node = AggregationNode(transport.rank, size, pairs, masking=masking,
                                    allow_leaky_q2=allow_leaky_q2, max_batch=max_batch)
        self._announced: dict[tuple[int, int], Requested] = {}
        self._owned_comm: MPI.Comm | None = None
        self.liveness = liveness

    @classmethod
    def over_mpi(cls, comm: MPI.Comm, *, channels: SecureChannels | None = None,
                 liveness: Liveness | None = None, **options: Any) -> SecureAggregator:
        """An aggregator on a duplicate of ``comm`` (collective); :meth:`close` frees the duplicate.

        With ``channels`` every message travels sealed (authenticated encryption between parties); with
        ``liveness`` every wait has a deadline (module docstring).
        """
        own = comm.Dup() if liveness is None else liveness.dup(comm, "the set-up of the full passes")
        max_batch = options.get("max_batch", DEFAULT_MAX_BATCH)
        extra = 0 if channels is None else OVERHEAD_WORDS
        transport = MpiTransport(own, max_message_words=HEADER_WORDS + max_batch + extra, channels=channels,
                                 liveness=liveness)
        aggregator = cls(transport, liveness=liveness, **options)
        aggregator._owned_comm = own
        return aggregator

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def size(self) -> int:
        return self.transport.size

    def sum(self, values: ArrayLike, *, root: int = 0, tree_pair: TreePair | None = None
            ) -> NDArray[np.float64] | None:
        """Σ over parties of each party's ``values`` (1-D, the same length everywhere), at ``root``.

        With ``tree_pair``, that (validated) pair is used and ``root`` is its root.
        """
        if tree_pair is not None:
            root = tree_pair.root
        self._check_root(root)
        local = as_real_vector(values)
        rid = self.node.claim_request_id(root)
        return self._drive(root, rid, self.node.start(root, rid, local, tree_pair=tree_pair))

    def inner_product(self, w_local: ArrayLike, X_local: np.ndarray | sp.csr_array | sp.csr_matrix,
                      indices: ArrayLike | None = None, *, root: int = 0) -> NDArray[np.float64] | None:
        """Scores ``z_i = Σ_l w_l·x_i^(l)`` for the root's ``indices``, at ``root``; see the module doc."""
        self._check_root(root)
        w, X = _check_block(w_local, X_local)
        if self.rank == root:
            if indices is None:
                raise ValueError("the root must pass the sample indices to aggregate")
            chosen = _check_indices(indices, X.shape[0])
            rid, announcements = self.node.announce(chosen)
            for message in announcements:
                self.transport.send(message.dest, message.buffer)
            return self._drive(root, rid, self.node.start(root, rid, local_scores(X, w, chosen)))
        rid = self.node.claim_request_id(root)
        chosen = self._await_announcement(root, rid).indices
        if np.any(chosen < 0) or np.any(chosen >= X.shape[0]):
            raise ProtocolViolation(root, "REQUEST", f"sample indices {chosen.min()}..{chosen.max()} are "
                                    f"outside this party's {X.shape[0]} rows")
        self._drive(root, rid, self.node.start(root, rid, local_scores(X, w, chosen)))
        if indices is not None and not np.array_equal(np.asarray(indices), chosen):
            raise ValueError(f"party {self.rank} passed indices that differ from root {root}'s")
        return None

    def close(self) -> None:
        """Free the duplicated communicator of :meth:`over_mpi` (collective)."""
        if self._owned_comm is not None:
            self._flush()
            self._owned_comm.Free()
            self._owned_comm = None

    def __enter__(self) -> SecureAggregator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ the driver

    def _drive(self, root: int, rid: int, first: Step) -> NDArray[np.float64] | None:
        """Serve messages until this party's part of ``(root, rid)`` is done; the root's result."""
        result = self._perform(first, root, rid)
        wait = self._deadline(lambda: self.node.awaited(root, rid),
                              f"its partial sum of request ({root}, {rid})")
        while self.node.in_progress(root, rid):
            source, buffer = self._recv(wait)
            outcome = self._perform(self.node.receive(source, buffer), root, rid)
            if outcome is not None:
                result = outcome
        self._flush()
        return result

    def _await_announcement(self, root: int, rid: int) -> Requested:
        level = 0 if self.liveness is None else self.liveness.exchange_level
        wait = self._deadline(lambda: {root: level}, f"its REQUEST of a full pass ({root}, {rid})")
        while (root, rid) not in self._announced:
            source, buffer = self._recv(wait)
            self._perform(self.node.receive(source, buffer), root, rid)
        return self._announced.pop((root, rid))

    def _deadline(self, owed, what: str):
        """The ``wait`` of a polling receive: raises PeerTimeout once a peer of ``owed()`` (peer → level)
        has been silent past its limit since now; None (block) without a liveness."""
        liveness = self.liveness
        if liveness is None:
            return None
        since = liveness.clock()
        return lambda: liveness.check(owed(), since, what)

    def _recv(self, wait):
        return self.transport.recv() if wait is None else self.transport.recv(wait)

    def _flush(self) -> None:
        """Every send complete; a receiver that does not take its message waits at the exchange level."""
        if self.liveness is None:
            self.transport.flush()
        else:
            self.transport.flush(self.liveness.exchange_level)

    def _perform(self, step: Step, root: int, rid: int) -> NDArray[np.float64] | None:
        for message in step.outgoing:
            self.transport.send(message.dest, message.buffer)
        event = step.event
        if isinstance(event, Requested):
            self._announced[(event.root, event.rid)] = event
        elif isinstance(event, Completed):
            if (event.root, event.rid) != (root, rid):
                raise ProtocolError(f"request ({event.root}, {event.rid}) completed while serving ({root}, "
                                    f"{rid}): the ranks called the collective in different orders")
            return event.result()
        return None

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"root must be a rank in 0..{self.size - 1}, got {root}")


def secure_sum(comm: MPI.Comm, values: ArrayLike, tree_pair: TreePair | None = None, *, root: int = 0,
               seed: int = 0, masking: MaskingScheme | None = None, allow_leaky_q2: bool = False
               ) -> NDArray[np.float64] | None:
    """Collective: the element-wise sum over ranks of ``values``, at the root, through masked trees.

    The root is ``tree_pair.root`` when a pair is given, else ``root`` (with the seeded pair).
    """
    return _aggregator_for(comm, seed, masking, allow_leaky_q2).sum(values, root=root, tree_pair=tree_pair)


def secure_inner_product(comm: MPI.Comm, w_local: ArrayLike,
                         X_local: np.ndarray | sp.csr_array | sp.csr_matrix, indices: ArrayLike | None, *,
                         root: int = 0, seed: int = 0, masking: MaskingScheme | None = None,
                         allow_leaky_q2: bool = False) -> NDArray[np.float64] | None:
    """Collective: ``z[j] = Σ_l w_l·X_l[indices[j]]`` at ``root`` (``None`` elsewhere).

    ``X_local`` is this party's ``(n, d_l)`` block, dense or CSR; ``w_local`` its ``d_l`` weights.
    """
    aggregator = _aggregator_for(comm, seed, masking, allow_leaky_q2)
    return aggregator.inner_product(w_local, X_local, indices, root=root)


def local_scores(X: np.ndarray | sp.csr_array | sp.csr_matrix, w: NDArray[np.float64],
                 indices: NDArray[np.int64]) -> NDArray[np.float64]:
    """This party's partial products ``X[indices] @ w``, without materialising the rows of a CSR block."""
    if not sp.issparse(X):
        return X[indices] @ w
    if indices.size == 1:
        start, end = X.indptr[indices[0]], X.indptr[indices[0] + 1]
        return np.array([X.data[start:end] @ w[X.indices[start:end]]])
    starts = X.indptr[indices]
    lengths = X.indptr[indices + 1] - starts
    total = int(lengths.sum())
    first_slot = np.cumsum(lengths) - lengths
    positions = np.arange(total) + np.repeat(starts - first_slot, lengths)
    products = X.data[positions] * w[X.indices[positions]]
    return np.bincount(np.repeat(np.arange(indices.size), lengths), weights=products, minlength=indices.size)


# ---------------------------------------------------------------------------------------- internals


@functools.cache
def _session_keyval() -> int:
    """The MPI attribute key under which a communicator keeps its aggregators."""
    return MPI.Comm.Create_keyval()


def _aggregator_for(comm: MPI.Comm, seed: int, masking: MaskingScheme | None,
                    allow_leaky_q2: bool) -> SecureAggregator:
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py communicator, got {type(comm).__name__}")
    sessions: dict[tuple[Any, ...], SecureAggregator] | None = comm.Get_attr(_session_keyval())
    if sessions is None:
        sessions = {}
        comm.Set_attr(_session_keyval(), sessions)
    key = (seed, masking if masking is not None else FixedPointRing(), allow_leaky_q2)
    if key not in sessions:
        sessions[key] = SecureAggregator.over_mpi(comm, seed=seed, masking=key[1],
                                                  allow_leaky_q2=allow_leaky_q2)
    return sessions[key]


def _check_block(w_local: ArrayLike, X_local: Any) -> tuple[NDArray[np.float64], Any]:
    x_dtype = getattr(X_local, "dtype", None)
    if np.iscomplexobj(w_local) or (x_dtype is not None and np.dtype(x_dtype).kind == "c"):
        raise TypeError("w_local and X_local must be real: secure aggregation sums real numbers and would "
                        "drop the imaginary part")
    w = np.asarray(w_local, dtype=np.float64)
    if w.ndim != 1:
        raise ValueError(f"w_local must be a 1-D weight vector, got shape {w.shape}")
    if sp.issparse(X_local):
        if X_local.format != "csr":
            raise ValueError(f"sparse X_local must be CSR (convert once with .tocsr()), got {X_local.format}")
    elif not (isinstance(X_local, np.ndarray) and X_local.ndim == 2):
        raise ValueError("X_local must be a 2-D numpy array or a scipy CSR matrix")
    if X_local.shape[1] != w.size:
        raise ValueError(f"X_local has {X_local.shape[1]} columns but w_local has {w.size} weights")
    return w, X_local


def _check_indices(indices: ArrayLike, n_rows: int) -> NDArray[np.int64]:
    chosen = np.asarray(indices)
    if chosen.ndim == 0:
        chosen = chosen.reshape(1)
    if chosen.ndim != 1 or chosen.size == 0 or not np.issubdtype(chosen.dtype, np.integer):
        raise ValueError(f"indices must be a non-empty 1-D array of integers, got {chosen.dtype} "
                         f"{chosen.shape}")
    if chosen.min() < 0 or chosen.max() >= n_rows:
        raise ValueError(f"indices must lie in 0..{n_rows - 1}, got range {chosen.min()}..{chosen.max()}")
    return chosen.astype(np.int64, copy=False)
