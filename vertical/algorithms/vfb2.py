"""The VFB² update rules (Algorithms 2-7) as small strategies over one party's block.

A rule needs the regulariser λ·g (public: it acts on the party's own block) but not the loss, which
only active parties know. A rule owns the party's *algorithm state* (SVRG: ϑ_0 and μ_l;
SAGA: the gradient table) but not the model block ``w``, which the runtime shares between threads.
Both the dominator (its own block update, Alg. 2/4/6) and the collaborators (Alg. 3/5/7) call the same
:meth:`UpdateRule.apply`: the update of block l from (ϑ, i) is the same formula whoever computed ϑ
(the paper's backward updating: every party applies the same ϑ to its own block).

Full passes: SVRG needs the n-vector ϑ_0 at every outer-loop snapshot (:meth:`UpdateRule.snapshot`),
SAGA needs the n-vector of initial ϑ's once (:meth:`UpdateRule.initialize`). The runtime obtains it by
batched secure aggregation, the leader active party computes ϑ, and every party receives it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from vertical.kernel_codes import MODE_SAGA_SCALAR, MODE_SGD, MODE_SVRG
from vertical.problems import REG_NONE, Regularizer


class _Kernels:
    """:mod:`vertical.kernels`, imported at the first use of one of its names.

    Defining the rules must not import numba: the algorithm table (and so ``vfl train``'s option parser
    and its launcher) is built from them and never runs a kernel, while numba and its cached kernels
    cost a process a large part of a second. Each name is looked up once and then kept on this object,
    so the hot path pays a plain attribute read."""

    def __getattr__(self, name: str):
        from vertical import kernels as module

        value = getattr(module, name)
        setattr(self, name, value)
        return value


kernels = _Kernels()


@dataclass(frozen=True)
class Block:
    """One party's feature block as CSR arrays (rows = samples, columns = the party's features)."""

    indptr: np.ndarray
    indices: np.ndarray
    data: np.ndarray
    n_rows: int
    n_cols: int

    @classmethod
    def from_matrix(cls, X) -> Block:
        indptr, indices, data = kernels.csr_arrays(X)
        return cls(indptr, indices, data, int(X.shape[0]), int(X.shape[1]))

    def products(self, w: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Local partial products ``x_i^(l) · w_l`` for the given rows."""
        out = np.empty(rows.size, dtype=np.float64)
        kernels.row_dots(self.indptr, self.indices, self.data, w, rows, out)
        return out

    def to_csr(self) -> sp.csr_matrix:
        return sp.csr_matrix((self.data, self.indices, self.indptr), shape=(self.n_rows, self.n_cols))

    def rmatvec(self, theta: np.ndarray) -> np.ndarray:
        """``X_l^T ϑ`` (used for the SVRG / SAGA full local gradients)."""
        return np.asarray(self.to_csr().T @ theta, dtype=np.float64)


def regularizer_code(reg: Regularizer, lam: float) -> int:
    """The kernel code of a regulariser (declared with it in ``vertical.problems``); λ = 0 needs none."""
    if lam == 0.0:
        return REG_NONE
    if reg.kernel_code is None:
        raise ValueError(f"no VFB² kernel for regulariser {type(reg).__name__}")
    return reg.kernel_code


#: Default memory budget of the exact SAGA table (rule kwarg ``table_budget_bytes``).
SAGA_TABLE_BUDGET_BYTES = 2 * 1024**3


def saga_table_bytes(n_rows: int, n_cols: int) -> int:
    """Bytes of the exact SAGA gradient table of one party: n × d_l float64 (the mean is negligible).

    Public so that a launcher can refuse before starting MPI.
    """
    return 8 * int(n_rows) * int(n_cols)


def check_saga_table_budget(n_rows: int, n_cols: int, budget_bytes: int = SAGA_TABLE_BUDGET_BYTES) -> None:
    """Raise a one-line ``ValueError`` if the exact SAGA table would exceed ``budget_bytes``."""
    need = saga_table_bytes(n_rows, n_cols)
    if need > budget_bytes:
        raise ValueError(
            f"exact SAGA needs a {n_rows} x {n_cols} gradient table = {need / 1e9:.2f} GB, above the "
            f"budget of {budget_bytes / 1e9:.2f} GB; use algorithm 'saga-scalar' (O(n) memory) or raise "
            f"the budget (table_budget_bytes / --saga-table-budget)")


class UpdateRule(ABC):
    """Applies (ϑ, i) pairs to one party's block ``w``; subclasses are Algorithms 2/3, 4/5 and 6/7.

    ``lazy=True`` (default) uses the O(nnz)-per-step lazy kernels: ``w`` is then *not* up to date
    between barriers (coordinates not touched lately still owe dense steps), so every read of it goes
    through :meth:`products`, and :meth:`synchronize` must run before anything reads ``w`` directly
    (evaluation, checkpoint, predict, snapshot). ``lazy=False`` uses the eager reference kernels,
    O(d_l) per step; then ``w`` is always current and :meth:`synchronize` does nothing.

    ``batch_size`` = B: ``apply`` takes a multiple of B pairs and applies one step per B of them
    (mean of the B loss parts, dense part once). ``writers``: the number of threads that may call
    ``apply`` concurrently on the same ``w``, each with its own ``writer`` slot in ``range(writers)``
    (runtime: dominator 0, workers 1..k). ``exact_gap``: nonconvex catch-ups of at most this many steps
    are exact iterations (docs/lazy-updates.md).
    """

    name: str
    #: Whether the rule needs the n-vector of ϑ at w^s at the start of every outer loop (SVRG).
    needs_snapshot: bool = False
    #: Whether the rule needs the n-vector of ϑ at w^0 once before the first update (SAGA).
    needs_initial_pass: bool = False
    #: Which lazy kernel mode implements the rule (None: eager only).
    _mode: int | None = None

    def __init__(self, block: Block, regularizer: Regularizer, lam: float, gamma: float, *,
                 lazy: bool = True, batch_size: int = 1, writers: int = 1, exact_gap: int = 32) -> None:
        if batch_size < 1 or writers < 1 or exact_gap < 0:
            raise ValueError(f"need batch_size ≥ 1, writers ≥ 1, exact_gap ≥ 0; got {batch_size}, "
                             f"{writers}, {exact_gap}")
        self.block = block
        self.regularizer = regularizer
        self.lam = float(lam)
        self.reg = regularizer_code(regularizer, self.lam)
        self.batch_size = int(batch_size)
        self.writers = int(writers)
        self.exact_gap = int(exact_gap)
        self.lazy = bool(lazy) and self._mode is not None
        self._set_gamma(gamma)
        #: per coordinate: the clock value up to which w_j holds all dense steps
        self.last = np.zeros(block.n_cols, dtype=np.int64)
        #: per writer slot: steps applied; one 64-byte row each (no false sharing)
        self.counters = np.zeros((self.writers, 8), dtype=np.int64)
        self._synced_at = 0
        self.mu = np.zeros(block.n_cols)

    # -- the hot path -----------------------------------------------------------------------------

    def apply(self, w: np.ndarray, rows: np.ndarray, thetas: np.ndarray, writer: int = 0) -> None:
        """Apply the pairs (thetas[k], rows[k]) to ``w`` in order, in place (lock-free), as
        ``len(rows) / batch_size`` steps; ``writer`` is the caller's slot in ``range(writers)``."""
        if rows.size % self.batch_size:
            raise ValueError(f"{rows.size} pairs is not a multiple of batch_size {self.batch_size}")
        if self.lazy:
            if not 0 <= writer < self.writers:
                raise ValueError(f"writer slot {writer} out of range({self.writers})")
            b = self.block
            kernels.lazy_apply(b.indptr, b.indices, b.data, w, rows, thetas, self._mode, self._theta_ref(),
                               self.mu, self.gamma, self.lam, self.reg, self.batch_size, self.last,
                               self.counters, writer, self._log_a, self.exact_gap)
        else:
            self._apply_eager(w, rows, thetas)

    @abstractmethod
    def _apply_eager(self, w: np.ndarray, rows: np.ndarray, thetas: np.ndarray) -> None:
        """The eager reference kernel (O(d_l) per step)."""

    def _theta_ref(self) -> np.ndarray:
        """What a pair's ϑ is compared with: ϑ_0 (SVRG), the ϑ table (SAGA-scalar); unused for SGD."""
        return self.mu  # any float64 array; MODE_SGD never reads it

    def summed_values(self, rows: np.ndarray, thetas: np.ndarray) -> np.ndarray:
        """The per-row values whose feature-weighted sum is all a party needs for this batch's step
        (:meth:`apply_gradient`): ϑ itself for SGD, ϑ − ϑ_0 for SVRG. Under ``--label-privacy he`` these
        are what the dominator encrypts for passive parties."""
        return thetas

    def _require_eager(self, what: str) -> None:
        if self.lazy:
            raise RuntimeError(f"{what} needs the eager kernels (lazy=False)")

    def products(self, w: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Local partial products ``x_i^(l) · ŵ_l`` with every touched coordinate caught up.

        A pure read (writes neither ``w`` nor the rule's state): the communication thread calls it
        while workers write, and a reader that also wrote caught-up values back would be one more
        racing writer on ``w`` (lost updates) and on ``last`` for no gain.
        """
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if not self.lazy:
            return self.block.products(w, rows)
        b = self.block
        out = np.empty(rows.size, dtype=np.float64)
        has_mu = self._mode != MODE_SGD
        kernels.lazy_row_dots(b.indptr, b.indices, b.data, w, rows, out, self.mu, has_mu, self.gamma,
                              self.lam, self.reg, self.last, self.counters, self._log_a, self.exact_gap)
        return out

    def synchronize(self, w: np.ndarray) -> None:
        """Barrier: bring every coordinate of ``w`` up to date (O(d_l)); afterwards ``w`` is exact.

        Call it when no thread is writing: before a snapshot, an evaluation, a checkpoint or predict.
        """
        if self.lazy:
            kernels.lazy_synchronize(w, self.mu, self._mode != MODE_SGD, self.gamma, self.lam,
                                     self.reg, self.last, self.counters, self._log_a, self.exact_gap)
        self._synced_at = self.steps

    def set_gamma(self, gamma: float) -> None:
        """A new step size from the next step on (a schedule, at a segment boundary). Only after
        :meth:`synchronize` with nothing applied since: the lazy catch-up of a coordinate assumes one γ
        over all the steps since it was last brought up to date."""
        if self.lazy and self._synced_at != self.steps:
            raise RuntimeError("set_gamma needs every coordinate up to date: call synchronize first")
        self._set_gamma(gamma)

    def _set_gamma(self, gamma: float) -> None:
        self.gamma = float(gamma)
        #: log(1 − γλ), NaN when 1 − γλ < 0 (the L2 closed form then uses a plain power).
        gl = self.gamma * self.lam
        self._log_a = math.log1p(-gl) if gl <= 1.0 else math.nan

    def _set_mean_gradient(self, theta: np.ndarray) -> None:
        """μ_l = X_lᵀϑ / n, written into the existing ``mu`` (a snapshot at 4M columns would otherwise
        fault in two fresh 32 MB vectors)."""
        b = self.block
        if self.mu.size != b.n_cols:
            self.mu = np.zeros(b.n_cols)
        kernels.mean_block_gradient(b.indptr, b.indices, b.data, theta, self.mu)

    @property
    def steps(self) -> int:
        """Steps applied so far by all writer slots (the global clock)."""
        return int(self.counters[:, 0].sum())

    def _require_synchronized(self, w: np.ndarray | None, what: str) -> None:
        if w is not None:
            self.synchronize(w)
        elif self.lazy and self.steps != self._synced_at:
            raise RuntimeError(f"{self.name}: {what} needs an up-to-date block: call synchronize(w) first "
                               f"({self.steps - self._synced_at} steps since the last one)")

    # -- barriers ---------------------------------------------------------------------------------

    def snapshot(self, theta0: np.ndarray, w: np.ndarray | None = None) -> None:
        """Receive ϑ_{0,i} at the snapshot w^s for every training sample (SVRG only)."""
        raise NotImplementedError(f"{self.name} takes no snapshot")

    def initialize(self, theta_all: np.ndarray, w: np.ndarray) -> None:
        """Receive ϑ_i at w^0 for every training sample, once (SAGA only)."""
        raise NotImplementedError(f"{self.name} needs no initial pass")


class SGDRule(UpdateRule):
    """VFB²-SGD: ``w_l ← w_l − γ (ϑ x_i^(l) + λ ∇g(ŵ_l))``."""

    name = "sgd"
    _mode = MODE_SGD

    def apply_gradient(self, w: np.ndarray, gradient_sum: np.ndarray) -> None:
        """One step from the batch's summed block gradient Σ_b ϑ_b x_{i_b}: the step ``apply`` takes on
        the batch's B pairs, for a party that learns only the sum (``--label-privacy he``). Eager only:
        the lazy kernels' per-coordinate clocks count steps of (ϑ, i) pairs."""
        self._require_eager("apply_gradient")
        if self.reg != REG_NONE:
            w -= self.gamma * self.lam * self.regularizer.gradient(w)
        w -= (self.gamma / self.batch_size) * gradient_sum

    def _apply_eager(self, w, rows, thetas):
        b = self.block
        kernels.sgd_apply(b.indptr, b.indices, b.data, w, rows, thetas, self.gamma, self.lam, self.reg,
                          self.batch_size)


class SVRGRule(UpdateRule):
    """VFB²-SVRG inner step ``w_l ← w_l − γ ((ϑ_1 − ϑ_{0,i}) x_i^(l) + μ_l + λ∇g(ŵ_l))``.

    ``w_l = w_l^s`` at the start of each outer loop is implicit: the runtime takes the snapshot at the
    current ``w_l`` after draining every in-flight ϑ (a global barrier), and the last inner iterate
    becomes the next snapshot (Alg. 4 step 12), so no copy of w^s is needed. The lazy kernel assumes μ
    constant between barriers, so the snapshot must follow :meth:`synchronize`.
    """

    name = "svrg"
    needs_snapshot = True
    _mode = MODE_SVRG

    def __init__(self, block, regularizer, lam, gamma, **options):
        super().__init__(block, regularizer, lam, gamma, **options)
        self.theta0 = np.zeros(block.n_rows)

    def snapshot(self, theta0, w=None):
        """New ϑ_0 and μ = (1/n) X^T ϑ_0; synchronizes ``w`` first when given, else requires that the
        caller did (pending dense steps must be applied with the old μ)."""
        self._require_synchronized(w, "snapshot")
        self.theta0 = np.ascontiguousarray(theta0, dtype=np.float64)
        self._set_mean_gradient(self.theta0)

    def snapshot_mean(self, mu: np.ndarray) -> None:
        """The snapshot of a party that learns μ_l = (1/n) X_lᵀϑ_0 but not ϑ_0 (``--label-privacy he``):
        it steps only through :meth:`apply_gradient`, from sums of ϑ − ϑ_0 it never sees per row."""
        self._require_eager("snapshot_mean")
        self.theta0 = None
        self.mu = np.ascontiguousarray(mu, dtype=np.float64)

    def summed_values(self, rows, thetas):
        return thetas - self.theta0[rows]

    def apply_gradient(self, w: np.ndarray, gradient_sum: np.ndarray) -> None:
        """One inner step from Σ_b (ϑ_b − ϑ_{0,i_b}) x_{i_b}, the batch's summed block-gradient
        difference: exactly the step of :func:`~vertical.kernels.svrg_apply` on the batch's B pairs."""
        self._require_eager("apply_gradient")
        dense = self.mu + self.lam * self.regularizer.gradient(w) if self.reg != REG_NONE else self.mu
        w -= self.gamma * dense
        w -= (self.gamma / self.batch_size) * gradient_sum

    def _theta_ref(self):
        return self.theta0

    def _apply_eager(self, w, rows, thetas):
        b = self.block
        kernels.svrg_apply(b.indptr, b.indices, b.data, w, rows, thetas, self.theta0, self.mu,
                           self.gamma, self.lam, self.reg, self.batch_size)


class SAGARule(UpdateRule):
    """VFB²-SAGA with the exact per-sample block-gradient table of Algorithms 6-7 (n × d_l floats).

    Always eager (``lazy`` is ignored): α̃_i holds the dense λ∇g(ŵ) of the step that stored it, so
    every step reads and writes a whole d_l row of the table — O(d_l) by definition of the listing.
    Use ``saga-scalar`` for high-dimensional data. Refuses a table above ``table_budget_bytes``.
    """

    name = "saga"
    needs_initial_pass = True

    def __init__(self, block, regularizer, lam, gamma, *, table_budget_bytes: int = SAGA_TABLE_BUDGET_BYTES,
                 **options):
        check_saga_table_budget(block.n_rows, block.n_cols, table_budget_bytes)
        super().__init__(block, regularizer, lam, gamma, **options)
        self.table = np.zeros((block.n_rows, block.n_cols))  # calloc: pages arrive when written
        self.mean = np.zeros(block.n_cols)

    def initialize(self, theta_all: np.ndarray, w: np.ndarray) -> None:
        """α̃_i = ϑ_i x_i^(l) + λ∇g(w_l^0) for every i (Alg. 6 step 2), and their mean; filled in place
        (no dense temporary besides the table itself)."""
        b = self.block
        reg = self.lam * self.regularizer.gradient(w) if self.reg != REG_NONE else 0.0
        self.table[:] = reg
        row_of = np.repeat(np.arange(b.n_rows), np.diff(b.indptr))
        self.table[row_of, b.indices] += np.asarray(theta_all, dtype=np.float64)[row_of] * b.data
        self.mean = self.table.mean(axis=0)

    def _apply_eager(self, w, rows, thetas):
        b = self.block
        scratch = np.empty((3, b.n_cols))
        kernels.saga_table_apply(b.indptr, b.indices, b.data, w, rows, thetas, self.table, self.mean,
                                 scratch, self.gamma, self.lam, self.reg, self.batch_size)


class ScalarSAGARule(UpdateRule):
    """VFB²-SAGA with the scalar-ϑ table: O(n) memory, for sparse high-dimensional data.

    Exact for the loss part; the regulariser gradient is applied at the current ŵ instead of through
    the table, which keeps the expectation of the listing's update. Mini-batch: every pair of a step
    is compared with the table before the step, then the step's ϑ's are stored in order (a row twice
    in a step: both copies use the old entry, the last ϑ is kept).
    """

    name = "saga-scalar"
    needs_initial_pass = True
    _mode = MODE_SAGA_SCALAR

    def __init__(self, block, regularizer, lam, gamma, **options):
        super().__init__(block, regularizer, lam, gamma, **options)
        self.theta_table = np.zeros(block.n_rows)

    def initialize(self, theta_all: np.ndarray, w: np.ndarray) -> None:
        self._require_synchronized(w, "initialize")
        self.theta_table = np.array(theta_all, dtype=np.float64)
        self._set_mean_gradient(self.theta_table)

    def _theta_ref(self):
        return self.theta_table

    def _apply_eager(self, w, rows, thetas):
        b = self.block
        kernels.saga_scalar_apply(b.indptr, b.indices, b.data, w, rows, thetas, self.theta_table,
                                  self.mu, self.gamma, self.lam, self.reg, self.batch_size)


RULES: dict[str, type[UpdateRule]] = {r.name: r for r in (SGDRule, SVRGRule, SAGARule, ScalarSAGARule)}


def get_rule(name: str) -> type[UpdateRule]:
    """The update-rule class registered under ``name`` ("sgd", "svrg", "saga", "saga-scalar")."""
    try:
        return RULES[name]
    except KeyError:
        raise ValueError(f"unknown VFB² algorithm {name!r}; choose one of {sorted(RULES)}") from None
