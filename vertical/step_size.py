"""The default step size γ, derived from the data: what ``--gamma`` is when it is not given (or ``auto``).

A constant γ cannot fit every dataset: the step that is stable depends on the rows' norms (features on
a scale of 100 need a step 10⁴ times shorter than features on a scale of 1) and on the batch (B rows
average their noise, so a longer step is stable). The step comes from the *expected smoothness* of
mini-batch SGD under B-nice sampling (Gower et al. 2019, "SGD: General Analysis and Improved Rates",
Proposition 3.8):

    L(B) = (n − B)/(B(n − 1)) · L_rows + n(B − 1)/(B(n − 1)) · L_full,        γ = 1/(L(B) + λ),

``L_rows`` the smoothness of one row's loss, ``L_full`` the full objective's: B = 1 gives SAG's
1/(L_rows + λ), B = n gradient descent's. In a vertical split no party sees a whole row, so both are
bounded from the blocks; with ``c`` the loss's curvature (:attr:`vertical.problems.Loss.curvature`):

* ``L_full``: ``c · Σ_l λ_max(X_lᵀX_l)/n``, each party's own Gram matrix's top eigenvalue (computed
  locally, :func:`block_smoothness`). It bounds ``c · λ_max(XᵀX)/n``: ‖Σ_l X_l v_l‖ ≤ Σ_l √λ_l ‖v_l‖,
  then Cauchy–Schwarz. It is the trace bound's 2.1 (a9a) to 4.4 (w8a) times tighter.
* ``L_rows``: ``c · Σ_l max_i ‖x_il‖²``, at least every row's (the maximum of a sum is at most the sum
  of the maxima) — for a loss with an unbounded ϑ (least squares). For a loss with a bounded ϑ
  (:attr:`~vertical.problems.Loss.derivative_bound`: logistic, robust) the rows' term is the sum of
  each block's 99.9th percentile (:data:`ROW_QUANTILE`), and ``L_full`` is halved (gradient descent is
  stable up to 2/L). With a bounded ϑ a step too long for a few rows moves w by at most γ·|ϑ|·‖x_i‖
  when one of them is drawn, bounded noise; with the squared loss the same rows' residuals would
  grow geometrically.

Each party reveals three numbers about its block's scale (its largest and 99.9th-percentile squared
row norm, its Gram matrix's top eigenvalue), nothing about a row.

**Decision, and the evidence** (``python -m experiments default_step_scan``: the same updates run in
one process, the README's epochs; ``experiments/results/default_step/scan.md``). The plain bound
(maximum and trace) is safe but short where a few rows are long (D1: one row of squared norm 9,733
against a 99.9th percentile of 589 made γ = 0.000363, 79.92 % against NonF's 82.02 % at B = 1) and at
B = 64 (the trace bound; breast-cancer 95.61 % against 97.37 %). The rule above is within 0.5 points
of NonF on breast-cancer, D1, a9a and w8a at B = 1 and B = 64, in the scan and in real jobs
(``experiments/results/default_step/table.md``); on the generated file of features on scales 1 to
10⁴ (scaled, :mod:`vertical.standardize`) it reaches the scaled problem's NonF, 0.6 points below the
raw problem's. It is not conservative by much: on a9a twice the step loses 0.68 points at B = 1, four
times it 12 points at B = 64, so no larger multiple was taken. A safeguard that halves γ after an epoch whose
loss rose did not rescue four times the step within a9a's 3 epochs (−0.88 points at B = 1, −1.41 at
B = 64), and doubling γ while the loss falls (back to the best epoch and half the step after a rise)
oscillated (a9a B = 1: −0.51), so there is neither: a run that ends worse than w = 0 says so
(``parties/outcomes.py``).
"""

from __future__ import annotations

import math

import numpy as np

from vertical.algorithms.vfb2 import Block
from vertical.problems import Loss

#: The rows' term of a loss with a bounded ϑ: each block's 99.9th percentile of squared row norms.
ROW_QUANTILE = 0.999
#: Blocks up to this wide get the Gram matrix's top eigenvalue exactly (dense); wider ones by Lanczos.
DENSE_GRAM_COLUMNS = 256
#: Lanczos's relative tolerance, and the margin added to its estimate (a Ritz value is a lower bound).
LANCZOS_TOL = 1e-6
LANCZOS_MARGIN = 1e-4


def block_smoothness(block: Block) -> tuple[float, float, float]:
    """``(max_i ‖x_il‖², the ROW_QUANTILE-quantile of ‖x_il‖², λ_max(X_lᵀX_l)/n)`` of one party's block
    (zeros for a block without rows or columns). Each is at most the first: the quantile is one of the
    norms, and λ_max is at most the trace, the mean norm."""
    if block.n_rows == 0 or block.n_cols == 0:
        return 0.0, 0.0, 0.0
    rows = np.repeat(np.arange(block.n_rows), np.diff(block.indptr))
    squared = np.bincount(rows, weights=np.square(block.data), minlength=block.n_rows)
    largest = float(squared.max())
    quantile = min(float(np.quantile(squared, ROW_QUANTILE)), largest)
    mean = min(float(squared.mean()), largest)  # rows all alike: the mean may round above the largest
    return largest, quantile, min(_top_eigenvalue(block), mean)


def _top_eigenvalue(block: Block) -> float:
    """λ_max(X_lᵀX_l)/n: exact for a narrow block, else Lanczos from a seeded start (deterministic),
    raised by its margin; the trace bound (the mean squared row norm) if Lanczos does not converge."""
    from scipy.sparse.linalg import ArpackNoConvergence, LinearOperator, eigsh

    X, n, d = block.to_csr(), block.n_rows, block.n_cols
    if d <= DENSE_GRAM_COLUMNS:
        gram = (X.T @ X).toarray() / n
        return max(float(np.linalg.eigvalsh(gram)[-1]), 0.0)
    gram = LinearOperator((d, d), matvec=lambda v: X.T @ (X @ v) / n, dtype=np.float64)
    start = np.random.default_rng(0).standard_normal(d)
    try:
        top = eigsh(gram, k=1, which="LA", v0=start, tol=LANCZOS_TOL, return_eigenvectors=False)[0]
    except ArpackNoConvergence:
        return float(np.square(block.data).sum()) / n
    return max(float(top), 0.0) * (1.0 + LANCZOS_MARGIN)


def expected_smoothness(l_rows: float, l_full: float, n: int, batch_size: int) -> float:
    """``L(B)`` from the rows' and the full objective's smoothness. A batch larger than the data is the
    whole data (B = n); one row (n = 1) has only ``l_rows``."""
    b = min(max(int(batch_size), 1), max(int(n), 1))
    if n <= 1:
        return l_rows
    return (n - b) / (b * (n - 1)) * l_rows + n * (b - 1) / (b * (n - 1)) * l_full


def default_gamma(shared: np.ndarray, n: int, batch_size: int, loss: Loss, lam: float) -> float:
    """γ = 1/(L(B) + λ) from every party's :func:`block_smoothness` (``shared``: ``[q, 3]``, rows in any
    order); 1 when the objective is flat (all features 0 and λ = 0: any step is exact)."""
    shared = np.asarray(shared, dtype=np.float64).reshape(-1, 3)
    robust = loss.derivative_bound is not None
    rows = shared[:, 1 if robust else 0].sum()
    l_rows = loss.curvature * rows
    l_full = loss.curvature * shared[:, 2].sum() / (2.0 if robust else 1.0)
    smoothness = expected_smoothness(l_rows, l_full, n, batch_size) + lam
    if not math.isfinite(smoothness):
        raise ValueError(f"the data's smoothness bound is not finite ({smoothness}): the features are too "
                         "large to train on; scale them first (--standardize on)")
    return 1.0 / smoothness if smoothness > 0 else 1.0
