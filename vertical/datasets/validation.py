"""Checks on labels and features shared by every loader and by the per-party files.

Each check raises :class:`DataValidationError` whose message names the file and the row, because a
user holding a 100,000-row file needs to know *where* it is wrong, not only that it is.

What counts as valid (decisions):
- binary labels: all in {-1, +1}, or all in {0, 1} (mapped 0 -> -1); anything else (2, NaN, 0.5, a
  mix such as {-1, 0, 1}) is an error at its first occurrence. A file whose labels are all one class
  is accepted: a party may legitimately hold a skewed shard.
- regression labels: finite floats. Multiclass labels: integers >= 0.
- features: finite. An all-zero sparse row is *valid* (LIBSVM w8a has rows with no features at all;
  they simply contribute nothing to w^T x). A blank or short CSV line is *not* valid: it is caught
  where the CSV is parsed (:mod:`vertical.datasets.csv_table`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import scipy.sparse as sp

TASKS = ("binary", "regression", "multiclass")

Locate = Callable[[int], str]
"""Turns a 0-based row index into a human location, e.g. ``"a.csv, line 17"``."""


class DataValidationError(ValueError):
    """Data that cannot be trusted for training (bad label, NaN feature, misaligned party files...)."""


def locate_rows(source: str, *, first_line: int | None = None, ids: np.ndarray | None = None) -> Locate:
    """A :data:`Locate` for ``source``: by file line when ``first_line`` (line of row 0) is given,
    else by row index, with the sample id appended when ``ids`` is given."""
    def locate(row: int) -> str:
        where = f"line {row + first_line}" if first_line is not None else f"row {row}"
        if ids is not None:
            where += f" (id {ids[row]})"
        return f"{source}, {where}"
    return locate


def _first_bad(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def binary_labels_to_pm1(y: np.ndarray, locate: Locate) -> np.ndarray:
    """Labels in {0,1} or {-1,+1} as float64 in {-1.0, +1.0}; anything else is an error."""
    y = np.asarray(y, dtype=np.float64)
    convention = (0.0, 1.0) if np.any(y == 0.0) else (-1.0, 1.0)
    bad = _first_bad(~np.isin(y, convention))
    if bad is not None:
        raise DataValidationError(
            f"{locate(bad)}: label {y[bad].item()!r} is not valid for a binary task (labels must be all in "
            f"{{-1, +1}} or all in {{0, 1}})"
        )
    return np.where(y == 1.0, 1.0, -1.0)


def regression_labels(y: np.ndarray, locate: Locate) -> np.ndarray:
    """Finite float64 targets."""
    y = np.asarray(y, dtype=np.float64)
    bad = _first_bad(~np.isfinite(y))
    if bad is not None:
        raise DataValidationError(f"{locate(bad)}: regression target {y[bad].item()!r} is not a finite "
                                  f"number")
    return y


def multiclass_labels(y: np.ndarray, locate: Locate) -> np.ndarray:
    """Class indices as int64 (integers >= 0)."""
    y = np.asarray(y)
    as_float = y.astype(np.float64)
    bad = _first_bad(~np.isfinite(as_float) | (as_float < 0) | (as_float != np.round(as_float)))
    if bad is not None:
        raise DataValidationError(
            f"{locate(bad)}: class label {y[bad].item()!r} is not valid for a multiclass task (labels "
            f"must be integers 0..K-1)"
        )
    return as_float.astype(np.int64)


def checked_labels(y: np.ndarray, task: str, locate: Locate) -> np.ndarray:
    """Labels converted to the canonical form of ``task`` (see the module docstring)."""
    if task == "binary":
        return binary_labels_to_pm1(y, locate)
    if task == "regression":
        return regression_labels(y, locate)
    if task == "multiclass":
        return multiclass_labels(y, locate)
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")


def check_finite_features(X: np.ndarray | sp.csr_matrix, locate: Locate) -> None:
    """Raise at the first row holding a NaN or an infinity (all-zero sparse rows are fine)."""
    if sp.issparse(X):
        X = sp.csr_matrix(X)
        bad = _first_bad(~np.isfinite(X.data))
        if bad is None:
            return
        row = int(np.searchsorted(X.indptr, bad, side="right") - 1)
        column, value = int(X.indices[bad]), X.data[bad]
    else:
        finite = np.isfinite(X)
        bad_row = _first_bad(~finite.all(axis=1))
        if bad_row is None:
            return
        row = bad_row
        column = int(np.flatnonzero(~finite[row])[0])
        value = X[row, column]
    raise DataValidationError(f"{locate(row)}: feature column {column} is {value.item()!r} (features must be "
                              f"finite)")


def checked_csr(where: str, data: np.ndarray, indices: np.ndarray, indptr: np.ndarray,
                shape: tuple[int, int], *, sort: bool = False) -> sp.csr_matrix:
    """A CSR matrix from arrays read back from a file, checked first: scipy trusts its arrays, and a
    decreasing ``indptr`` or a column index past the width reads (and writes) outside them later.

    Every array 1-d of its dtype (values real numbers, indices and pointers int32/int64), ``indptr`` of
    ``rows + 1`` entries from 0 to ``data.size`` never decreasing, every index in ``0..cols-1``, sorted
    and unique within its row (or, with ``sort``, put so: arrays in memory, not mapped); else one
    :class:`DataValidationError` naming ``where``."""
    rows, cols = shape
    for name, array, kinds in (("data", data, "iuf"), ("indices", indices, "i"), ("indptr", indptr, "i")):
        narrow = kinds == "i" and array.itemsize not in (4, 8)
        if array.ndim != 1 or array.dtype.kind not in kinds or narrow:
            raise DataValidationError(f"{where}: the CSR {name} array is {array.ndim}-d {array.dtype}")
    if rows < 0 or cols < 0:
        raise DataValidationError(f"{where}: the CSR shape {shape} is negative")
    if indptr.size != rows + 1 or indptr[0] != 0 or indptr[-1] != data.size or indices.size != data.size:
        raise DataValidationError(f"{where}: inconsistent CSR arrays ({rows} rows, indptr of "
                                  f"{indptr.size}, {data.size} values, {indices.size} indices)")
    steps = np.diff(indptr)
    if rows and steps.min() < 0:
        raise DataValidationError(f"{where}: row {int(np.argmax(steps < 0))} has a negative length")
    if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= cols):
        raise DataValidationError(f"{where}: a column index is outside 0..{cols - 1}")
    if data.dtype != np.float64:
        data = data.astype(np.float64)
    X = sp.csr_matrix((data, indices, indptr), shape=(rows, cols), copy=False)
    if sort:
        X.sum_duplicates()
    if not X.has_canonical_format:
        raise DataValidationError(f"{where}: column indices are not sorted and unique within each row")
    return X


_INTEGER_ID = re.compile(r"[+-]?[0-9]+(?:\.0*)?")
_INT64 = np.iinfo(np.int64)


def integer_id(text: str) -> int | None:
    """A sample id written as an integer (``42``, ``+42``, ``42.0``), parsed exactly: ``None`` when it is
    not one. Never through a float: 2^53 and 2^53 + 1 are two ids, not one."""
    text = text.strip()
    if not _INTEGER_ID.fullmatch(text):
        return None
    return int(text.split(".", 1)[0])


def integer_ids(cells: np.ndarray, locate: Locate) -> np.ndarray:
    """A column of id cells as int64, each parsed exactly; an id that is no integer, or does not fit
    in 64 bits, is an error at its first occurrence."""
    ids = np.empty(len(cells), dtype=np.int64)
    for row, cell in enumerate(cells):
        value = integer_id(str(cell))
        if value is None or not _INT64.min <= value <= _INT64.max:
            text = str(cell).strip()
            shown = "(empty)" if not text else text if len(text) <= 40 else text[:40] + "…"
            what = "is not an integer" if value is None else "does not fit in 64 bits"
            raise DataValidationError(f"{locate(row)}: id {shown} {what}")
        ids[row] = value
    return ids
