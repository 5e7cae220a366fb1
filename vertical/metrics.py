"""Evaluation metrics of the VFB² paper: test accuracy (classification) and test RMSE (regression).

Both take ``(y_true, y_pred)`` as 1-D arrays of the same length and validate them, because they are the
numbers reported to users: a silent NaN or a broadcast of mismatched shapes would be a wrong result.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def accuracy(y_true: npt.ArrayLike, y_pred: npt.ArrayLike) -> float:
    """Fraction in [0, 1] of predictions equal to the true labels (labels compared exactly)."""
    t, p = _check_pair(y_true, y_pred)
    return float(np.mean(t == p))


def rmse(y_true: npt.ArrayLike, y_pred: npt.ArrayLike) -> float:
    """Root-mean-square error ``sqrt((1/n) Σ (ŷ_i − y_i)²)``."""
    t, p = _check_pair(y_true, y_pred)
    return float(np.sqrt(np.mean(np.square(p - t))))


def _check_pair(y_true: npt.ArrayLike, y_pred: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Both as finite float 1-D arrays of one common, non-zero length; ``ValueError`` otherwise."""
    arrays = []
    for what, values in (("y_true", y_true), ("y_pred", y_pred)):
        arr = np.asarray(values)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"{what} must be a non-empty 1-D array, got shape {arr.shape}")
        if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"{what} must hold real numbers, got dtype {arr.dtype}")
        arr = arr.astype(np.float64, copy=False)
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"{what} contains NaN or infinite values")
        arrays.append(arr)
    t, p = arrays
    if t.shape != p.shape:
        raise ValueError(f"y_true and y_pred differ in length: {t.shape[0]} vs {p.shape[0]}")
    return t, p
