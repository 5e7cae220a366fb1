"""Small real datasets bundled with scikit-learn: always available, for tests and quick examples.

- ``breast-cancer`` (binary, 569 x 30): features standardised with training statistics; malignant
  (sklearn's 0) is -1, benign (1) is +1.
- ``diabetes`` (regression, 442 x 10): features as scikit-learn ships them (already centred and
  scaled); the target (disease progression, 25..346) is left in its units.
- ``digits`` (multiclass, 1797 x 64, 8x8 images): float32 in [0, 1] (pixel / 16), int64 labels 0..9;
  the real stand-in for horizontal-FL image experiments until MNIST/CIFAR arrive.

All three use the seeded 80/20 split. scikit-learn is imported by the loaders, not here: a rank that
reads its party files never needs it, and importing it costs a process about half a second.
``breast-cancer``, the quickstart's data, is read straight from the CSV file scikit-learn ships
(:func:`bundled_breast_cancer`), so that ``vfl train`` does not import scikit-learn at all.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from vertical.datasets.base import Dataset, DatasetSpec, check_row_count, seeded_split


def _split(spec: DatasetSpec, X: np.ndarray, y: np.ndarray, seed: int,
           standardise: bool = False) -> Dataset:
    check_row_count(spec, Path(f"<scikit-learn {spec.name}>"), X.shape[0], spec.n_rows)
    train, test = seeded_split(X.shape[0], seed)
    X_train, X_test = X[train], X[test]
    if standardise:
        mean, std = X_train.mean(axis=0), X_train.std(axis=0)
        std[std == 0] = 1.0
        X_train, X_test = (X_train - mean) / std, (X_test - mean) / std
    return Dataset(spec.name, spec.task, X_train, y[train], X_test, y[test], train, test, seed)


def bundled_breast_cancer(n_rows: int = 569, n_features: int = 30) -> tuple[np.ndarray, np.ndarray] | None:
    """scikit-learn's ``breast_cancer.csv`` as (features, 0/1 targets), read without importing
    scikit-learn; None when the file is not where it was or not of the expected layout (its first line
    ``rows,features,name,name``, then one row of features and the target a line), and the caller falls
    back to ``sklearn.datasets.load_breast_cancer``. The same numbers: tests/test_datasets.py."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), "datasets", "data", "breast_cancer.csv")
    try:
        with path.open(encoding="utf-8") as fh:
            header = fh.readline().split(",")
            table = np.loadtxt(fh, delimiter=",", dtype=np.float64, ndmin=2)
    except (OSError, ValueError):
        return None
    if header[:2] != [str(n_rows), str(n_features)] or table.shape != (n_rows, n_features + 1):
        return None
    target = table[:, -1]
    if not np.isin(target, (0.0, 1.0)).all():
        return None
    return np.ascontiguousarray(table[:, :-1]), target.astype(np.int64)


def load_breast_cancer(spec: DatasetSpec, paths: list[Path], seed: int) -> Dataset:
    bundled = bundled_breast_cancer(spec.n_rows, spec.n_features)
    if bundled is None:
        from sklearn import datasets as sk_datasets

        bunch = sk_datasets.load_breast_cancer()
        bundled = bunch.data, bunch.target
    X, target = bundled
    y = np.where(target == 1, 1.0, -1.0)
    return _split(spec, X.astype(np.float64), y, seed, standardise=True)


def load_diabetes(spec: DatasetSpec, paths: list[Path], seed: int) -> Dataset:
    from sklearn import datasets as sk_datasets

    bunch = sk_datasets.load_diabetes()
    return _split(spec, bunch.data.astype(np.float64), bunch.target.astype(np.float64), seed)


def load_digits(spec: DatasetSpec, paths: list[Path], seed: int) -> Dataset:
    from sklearn import datasets as sk_datasets

    bunch = sk_datasets.load_digits()
    return _split(spec, (bunch.data / 16.0).astype(np.float32), bunch.target.astype(np.int64), seed)

