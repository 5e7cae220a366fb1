"""Small real datasets bundled with scikit-learn: always available, for tests and quick examples.

- ``breast-cancer`` (binary, 569 x 30): features standardised with training statistics; malignant
  (sklearn's 0) is -1, benign (1) is +1.
- ``diabetes`` (regression, 442 x 10): features as scikit-learn ships them (already centred and
  scaled); the target (disease progression, 25..346) is left in its units.
- ``digits`` (multiclass, 1797 x 64, 8x8 images): float32 in [0, 1] (pixel / 16), int64 labels 0..9;
  the real stand-in for horizontal-FL image experiments until MNIST/CIFAR arrive.

All three use the seeded 80/20 split.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sklearn import datasets as sk_datasets

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


def load_breast_cancer(spec: DatasetSpec, paths: list[Path], seed: int) -> Dataset:
    bunch = sk_datasets.load_breast_cancer()
    y = np.where(bunch.target == 1, 1.0, -1.0)
    return _split(spec, bunch.data.astype(np.float64), y, seed, standardise=True)


def load_diabetes(spec: DatasetSpec, paths: list[Path], seed: int) -> Dataset:
    bunch = sk_datasets.load_diabetes()
    return _split(spec, bunch.data.astype(np.float64), bunch.target.astype(np.float64), seed)


def load_digits(spec: DatasetSpec, paths: list[Path], seed: int) -> Dataset:
    bunch = sk_datasets.load_digits()
    return _split(spec, (bunch.data / 16.0).astype(np.float32), bunch.target.astype(np.int64), seed)

