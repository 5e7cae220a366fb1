"""``--standardize``: a party scales its own columns by statistics of its own training rows.

Why: one step size serves every column, and the step the data allows is set by the largest columns
(:mod:`vertical.step_size`), so a column a thousand times smaller than the others learns a million times
slower (its weight must grow a thousandfold, with steps a thousandfold shorter in its direction). Raw
measurements in different units (a credit limit in dollars beside an age in years) are like that; the
generated file of ``experiments/_unscaled.py`` (scales 1 to 10⁴) ends 10 epochs about 15 points below
NonF as given, and scaled at NonF of the scaled problem (``experiments/results/README.md``, "The
default step and scaling"). Scaling each column to one common scale is a change of each party's own
variables: w_j·x_j = (w_j·s_j)·(x_j/s_j), so the model class is the same and only the regulariser sees
the scales.

Each party fits its scaling on its own training rows and applies it to its own training and test rows;
nothing about it leaves the party (a column's scale is a statistic of that party's features). Modes:

* ``on`` (the default): divide each column by the root mean square of its non-zero training values,
  its typical magnitude where it is present. Zeros stay zeros, so sparse data stay sparse and an
  absent feature still means 0; an indicator column (0/1) is left as it is, whatever its frequency. Not
  the root mean square over all rows, nor the standard deviation: both shrink with a column's
  frequency, and dividing a rare indicator by them makes the few rows that have it very long (a
  category seen once in 24,000 rows would become a value of 155), which sets the step for everyone
  (:mod:`vertical.step_size`); measured on D1, where SAGA then stalled at f − f* between 6e-4 and
  1.2e-3 over 10 epochs.
* ``center``: subtract each column's mean, divide by its standard deviation (dense data: a column of
  ages, all near 40, becomes informative instead of a second intercept). A sparse block becomes dense.
* ``off``: the features as given; the paper's runs on the bundled datasets, whose loaders already
  scale as the paper did.

A column that is constant (zero spread) keeps scale 1; a scale within rounding of 1 is 1 and a mean
within rounding of 0 is 0, so that data already scaled (the bundled datasets) train bit for bit as
given.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

MODES = ("on", "center", "off")
#: ``center`` refuses to turn a sparse block into a dense one larger than this
MAX_DENSE_BYTES = 2 * 2**30
#: A scale this close to 1, or a mean this close to 0 (relative to the scale), is rounding: 1 and 0
#: exactly (breast-cancer and D1 as loaded: within 5e-14), so that scaling them changes no bit.
ROUNDING = 1e-12


@dataclass(frozen=True)
class Scaling:
    """x_j ↦ (x_j − shift_j)/scale_j for each column j of one party's block."""

    shift: np.ndarray
    scale: np.ndarray

    @property
    def centers(self) -> bool:
        return bool(np.any(self.shift != 0.0))


def fit_scaling(X, mode: str) -> Scaling:
    """The scaling of ``mode`` (``on`` or ``center``) fitted on the training rows ``X`` (dense or
    sparse, n × d)."""
    if mode not in ("on", "center"):
        raise ValueError(f"no scaling to fit for --standardize {mode!r}")
    n, d = X.shape
    if n == 0:
        return Scaling(np.zeros(d), np.ones(d))
    if sp.issparse(X):
        X = sp.csc_matrix(X, dtype=np.float64)
        X.eliminate_zeros()
        present = np.diff(X.indptr)
        mean = np.asarray(X.sum(axis=0), dtype=np.float64).ravel() / n
        square_sum = np.asarray(X.multiply(X).sum(axis=0), dtype=np.float64).ravel()
        spread = np.sqrt(np.maximum(square_sum / n - mean * mean, 0.0))
    else:
        X = np.asarray(X, dtype=np.float64)
        present = np.count_nonzero(X, axis=0)
        mean = X.mean(axis=0)
        square_sum = np.sum(X * X, axis=0)
        spread = X.std(axis=0)
    if mode == "on":
        return Scaling(np.zeros(d), _positive(np.sqrt(square_sum / np.maximum(present, 1))))
    scale = _positive(spread)
    return Scaling(np.where(np.abs(mean) <= ROUNDING * scale, 0.0, mean), scale)


def _positive(scale: np.ndarray) -> np.ndarray:
    """A constant column (or one too small to invert) keeps scale 1, and so does one whose scale is 1
    but for rounding (data already on that scale then train bit for bit as given)."""
    ok = (scale > 0) & np.isfinite(1.0 / np.where(scale > 0, scale, 1.0)) & (np.abs(scale - 1.0) > ROUNDING)
    return np.where(ok, scale, 1.0)


def apply_scaling(X, scaling: Scaling, *, who: str = "this party"):
    """``X`` scaled column by column: sparse stays sparse unless the scaling centres."""
    if X.shape[1] != scaling.scale.size:
        raise ValueError(f"{who}: the scaling is for {scaling.scale.size} columns, the block has "
                         f"{X.shape[1]}")
    inverse = 1.0 / scaling.scale
    if sp.issparse(X):
        if not scaling.centers:
            return sp.csr_matrix(sp.csr_matrix(X, dtype=np.float64) @ sp.diags(inverse))
        need = 8 * X.shape[0] * X.shape[1]
        if need > MAX_DENSE_BYTES:
            raise ValueError(f"{who}: --standardize center would make its sparse block dense "
                             f"({need / 2**30:.1f} GiB); use --standardize on, which keeps zeros")
        X = X.toarray()
    return (np.asarray(X, dtype=np.float64) - scaling.shift) * inverse
