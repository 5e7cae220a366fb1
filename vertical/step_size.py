"""The default step size γ, derived from the data: what ``--gamma`` is when it is not given.

A constant γ cannot fit every dataset: the step that is stable depends on the rows' norms (features on
a scale of 100 need a step 10⁴ times shorter than features on a scale of 1) and on the batch (B rows
average their noise, so a longer step is stable). As scikit-learn's SAG/SAGA do, the step comes from
the data's smoothness; here from the *expected smoothness* of mini-batch SGD under B-nice sampling
(Gower et al. 2019, "SGD: General Analysis and Improved Rates", Proposition 3.8):

    L(B) = (n − B)/(B(n − 1)) · L_max + n(B − 1)/(B(n − 1)) · L_mean,        γ = 1/(L(B) + λ),

where ``L_max`` bounds every row's smoothness and ``L_mean`` the full objective's. B = 1 gives SAG's
1/(L_max + λ), B = n full gradient descent's 1/(L_mean + λ).

In a vertical split no party sees a whole row, so both constants are bounded from the blocks: with
``c`` the loss's curvature (:attr:`vertical.problems.Loss.curvature`),

* ``L_max = c · Σ_l max_i ‖x_il‖²``, which is at least ``c · max_i ‖x_i‖²`` (the maximum of a sum is at
  most the sum of the maxima);
* ``L_mean = c · Σ_l mean_i ‖x_il‖² = c · tr(XᵀX)/n``, the trace bound of the objective's smoothness
  ``c · λ_max(XᵀX)/n``.

Each party reveals two numbers about its block (:func:`block_row_norms`), nothing about a row.
"""

from __future__ import annotations

import math

import numpy as np

from vertical.algorithms.vfb2 import Block


def block_row_norms(block: Block) -> tuple[float, float]:
    """``(max_i ‖x_il‖², mean_i ‖x_il‖²)`` of one party's block (0, 0 for a block without rows)."""
    if block.n_rows == 0:
        return 0.0, 0.0
    rows = np.repeat(np.arange(block.n_rows), np.diff(block.indptr))
    squared = np.bincount(rows, weights=np.square(block.data), minlength=block.n_rows)
    largest = float(squared.max())
    return largest, min(float(squared.mean()), largest)  # rows all alike: the mean may round above


def expected_smoothness(max_squared: float, mean_squared: float, n: int, batch_size: int,
                        curvature: float) -> float:
    """``L(B)`` from the summed per-block terms ``Σ_l max_i ‖x_il‖²`` and ``Σ_l mean_i ‖x_il‖²``.

    A batch larger than the data is the whole data (B = n); one row (n = 1) has only ``L_max``."""
    l_max, l_mean = curvature * max_squared, curvature * mean_squared
    b = min(max(int(batch_size), 1), max(int(n), 1))
    if n <= 1:
        return l_max
    return (n - b) / (b * (n - 1)) * l_max + n * (b - 1) / (b * (n - 1)) * l_mean


def default_gamma(max_squared: float, mean_squared: float, n: int, batch_size: int, curvature: float,
                  lam: float) -> float:
    """γ = 1/(L(B) + λ); 1 when the objective is flat (all features 0 and λ = 0: any step is exact)."""
    smoothness = expected_smoothness(max_squared, mean_squared, n, batch_size, curvature) + lam
    if not math.isfinite(smoothness):
        raise ValueError(f"the data's smoothness bound is not finite ({smoothness}): the features are too "
                         "large to train on; scale them first")
    return 1.0 / smoothness if smoothness > 0 else 1.0
