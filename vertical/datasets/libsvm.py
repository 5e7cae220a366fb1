"""LIBSVM / svmlight text files (plain, .bz2, .gz) read by scikit-learn into CSR float64.

Decisions:
- ``zero_based="auto"``: LIBSVM files are 1-based, but the a9a copy in the shared data folder (from
  the AVFL repository) is 0-based (indices 0..122). scikit-learn treats the files as 0-based when any
  of them contains index 0, else as 1-based; train and test files are read in one call so both get
  the same convention, and ``n_features`` is passed so both get the same width.
- ``qid:N`` fields (a9a here has one on every line) are ignored (``query_id=False``).
- Rows with no features (w8a) are valid all-zero rows.
- Binary labels are mapped to ±1 (covtype's {1, 2} through an explicit map first).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from vertical.datasets.base import Dataset, DatasetSpec, check_row_count, seeded_split
from vertical.datasets.paths import open_binary
from vertical.datasets.validation import (
    DataValidationError,
    check_finite_features,
    checked_labels,
    locate_rows,
)

#: scikit-learn's parser keeps a column index in a C int: a larger one overflows inside it
MAX_INDEX = 2**31 - 2
#: the bytes of whole lines a failed file is re-read by, to find the line at fault
_SCAN_BYTES = 8 << 20


def bad_libsvm_line(path: Path, text: bytes, first_line: int, width: int | None = None
                    ) -> DataValidationError | None:
    """The first line of ``text`` (whole lines of ``path`` from ``first_line``) that is no LIBSVM row:
    a label or value that is no number, a field that is not ``index:value``, indices not increasing,
    an index too large for the parser (or, given ``width``, past the file's 1-based width)."""
    top = MAX_INDEX if width is None else min(MAX_INDEX, width)
    for offset, raw in enumerate(text.split(b"\n")):
        fields = raw.split(b"#", 1)[0].split()
        if not fields:
            continue
        where = f"{path}, line {first_line + offset}"
        try:
            float(fields[0])
        except ValueError:
            return DataValidationError(f"{where}: label {_shown(fields[0])!r} is not a number")
        previous = -1
        for field in fields[1:]:
            name, sep, value = field.partition(b":")
            if name == b"qid":
                continue
            if not sep or not name.isdigit():
                return DataValidationError(f"{where}: {_shown(field)!r} is not index:value")
            try:
                float(value)
            except ValueError:
                return DataValidationError(f"{where}: {_shown(field)!r} has a value that is not a number")
            index = int(name) if len(name) <= 20 else math.inf
            if index > top:
                return DataValidationError(f"{where}: feature index {_shown(name)} is beyond the "
                                           f"{top:,} features this reader takes")
            if index <= previous:
                return DataValidationError(f"{where}: feature indices must be increasing ({_shown(field)!r} "
                                           f"after index {previous})")
            previous = index
    return None


def _shown(field: bytes) -> str:
    """A field of a file as a message shows it: decoded, and cut short."""
    text = field.decode(errors="replace")
    return text if len(text) <= 40 else text[:40] + "…"


def _explained(paths: Sequence[Path], width: int, error: Exception) -> DataValidationError:
    """Why scikit-learn refused ``paths``: the file and line at fault when one is found."""
    for path in paths:
        try:
            with open_binary(path) as f:
                line = 1
                while text := f.read(_SCAN_BYTES):
                    text += b"" if text.endswith(b"\n") else f.readline()
                    found = bad_libsvm_line(path, text, line, width)
                    if found is not None:
                        return found
                    line += text.count(b"\n")
        except (OSError, EOFError):
            continue
    names = ", ".join(str(p) for p in paths)
    return DataValidationError(f"cannot read LIBSVM file(s) {names}: {error}")


def read_svmlight(paths: Sequence[Path], n_features: int) -> list[tuple[sp.csr_matrix, np.ndarray]]:
    """``(X, y)`` per file, all with ``n_features`` columns; parse errors name the file and line."""
    from sklearn.datasets import load_svmlight_files  # here: importing sklearn costs ~1 s of start-up

    try:
        loaded = load_svmlight_files([str(p) for p in paths], n_features=n_features, dtype=np.float64,
                                     zero_based="auto", query_id=False)
    except (ValueError, OverflowError, OSError, EOFError) as error:  # OverflowError: an index past a C int
        raise _explained(paths, n_features, error) from None
    pairs = []
    for X, y in zip(loaded[0::2], loaded[1::2], strict=True):
        X = sp.csr_matrix(X, dtype=np.float64)
        X.sort_indices()
        pairs.append((X, np.asarray(y, dtype=np.float64)))
    return pairs


def _labels(spec: DatasetSpec, y: np.ndarray, path: Path,
            label_map: Mapping[float, float] | None) -> np.ndarray:
    if label_map is not None:
        y = y.copy()
        for source_value, value in label_map.items():
            y[y == source_value] = value
    return checked_labels(y, spec.task, locate_rows(str(path)))


def _minmax_target(y_train: np.ndarray, y_test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Targets mapped to [0, 1] with the training range (test values may fall slightly outside)."""
    low, span = y_train.min(), np.ptp(y_train) or 1.0
    return (y_train - low) / span, (y_test - low) / span


def _maxabs_scale(X_train: sp.csr_matrix, X_test: sp.csr_matrix) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """Columns divided by their training max |value| (keeps sparsity; all-zero columns untouched)."""
    scale = np.asarray(abs(X_train).max(axis=0).todense()).ravel()
    scale[scale == 0] = 1.0
    inverse = sp.diags(1.0 / scale, format="csr")
    return sp.csr_matrix(X_train @ inverse), sp.csr_matrix(X_test @ inverse)


def libsvm_loader(*, label_map: Mapping[float, float] | None = None, normalise_target: bool = False,
                  scale_features: bool = False) -> Callable[[DatasetSpec, list[Path], int], Dataset]:
    """A registry loader for one LIBSVM file (seeded 80/20 split) or a train/test pair.

    ``normalise_target``: min-max the regression target to [0, 1] (YearPredictionMSD, per the paper).
    ``scale_features``: divide columns by their training max |value| (YearPredictionMSD's raw audio
    features reach thousands, which no step size of the paper's grid survives).
    """

    def load(spec: DatasetSpec, paths: list[Path], seed: int) -> Dataset:
        pairs = read_svmlight(paths, spec.n_features)
        for path, (X, _), expected in zip(paths, pairs, (spec.n_rows, spec.n_test_rows), strict=False):
            check_row_count(spec, path, X.shape[0], expected)
            check_finite_features(X, locate_rows(str(path)))
        if len(pairs) == 2:
            (X_train, y_train), (X_test, y_test) = pairs
            y_train = _labels(spec, y_train, paths[0], label_map)
            y_test = _labels(spec, y_test, paths[1], label_map)
            train_ids = np.arange(X_train.shape[0])
            test_ids = X_train.shape[0] + np.arange(X_test.shape[0])
            split_seed = None
        else:
            (X, y), = pairs
            y = _labels(spec, y, paths[0], label_map)
            train_ids, test_ids = seeded_split(X.shape[0], seed)
            X_train, y_train, X_test, y_test = X[train_ids], y[train_ids], X[test_ids], y[test_ids]
            split_seed = seed
        if normalise_target:
            y_train, y_test = _minmax_target(y_train, y_test)
        if scale_features:
            X_train, X_test = _maxabs_scale(X_train, X_test)
        return Dataset(spec.name, spec.task, X_train, y_train, X_test, y_test, train_ids, test_ids,
                       split_seed)

    return load


def standin_loader(spec: DatasetSpec, paths: list[Path], seed: int) -> Dataset:
    """A ``vfl synth`` stand-in: its rows are whatever its sidecar says (the size is adjustable), its
    width the real set's; the seeded 80/20 split as for the real file. Refused without the sidecar."""
    from vertical.datasets.synth import read_sidecar

    path, = paths
    info = read_sidecar(path)
    if info["name"] != spec.name:
        raise DataValidationError(f"{path}: its sidecar describes {info['name']!r}, not {spec.name!r}")
    (X, y), = read_svmlight(paths, spec.n_features)
    if X.shape[0] != int(info["n_rows"]):
        raise DataValidationError(f"{path}: {X.shape[0]:,} rows, its sidecar says {int(info['n_rows']):,} "
                                  f"(truncated?)")
    check_finite_features(X, locate_rows(str(path)))
    y = _labels(spec, y, path, None)
    train_ids, test_ids = seeded_split(X.shape[0], seed)
    return Dataset(spec.name, spec.task, X[train_ids], y[train_ids], X[test_ids], y[test_ids], train_ids,
                   test_ids, seed)
