"""The types every loader shares: :class:`Dataset`, :class:`DatasetSpec`, and the seeded split.

Row ids. ``Dataset.train_ids`` / ``test_ids`` are the 0-based positions of the rows in the source
(file order, counting data rows only). Where the source ships a separate test file, test ids continue
after the training rows (``n_train_file + j``) so that ids are unique across both splits. Per-party
files carry these ids, so any party can check it holds the same samples as the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from vertical.datasets.validation import DataValidationError

TEST_FRACTION = 0.2
"""The paper: "randomly take 80% as training and the rest as test" where no test set is given."""

Matrix = np.ndarray | sp.csr_matrix


@dataclass(frozen=True, eq=False)
class Dataset:
    """A loaded dataset, split into train and test.

    ``X``: CSR float64 for LIBSVM data, dense float64 for tabular data, float32 in [0, 1] for images.
    ``y``: float64 in {-1, +1} (binary), float64 (regression), int64 in 0..K-1 (multiclass).
    ``seed``: the seed of the 80/20 split, ``None`` when the split came with the data.
    """

    name: str
    task: str
    X_train: Matrix
    y_train: np.ndarray
    X_test: Matrix
    y_test: np.ndarray
    train_ids: np.ndarray
    test_ids: np.ndarray
    seed: int | None
    feature_names: tuple[str, ...] | None = None

    @property
    def n_features(self) -> int:
        return int(self.X_train.shape[1])

    @property
    def n_train(self) -> int:
        return int(self.X_train.shape[0])

    @property
    def n_test(self) -> int:
        return int(self.X_test.shape[0])

    @property
    def n_classes(self) -> int | None:
        """Number of classes of a multiclass task (max label + 1 over both splits), else ``None``."""
        if self.task != "multiclass":
            return None
        return int(max(self.y_train.max(initial=-1), self.y_test.max(initial=-1))) + 1


Loader = Callable[["DatasetSpec", list[Path], int], Dataset]
"""``loader(spec, paths, seed)``: ``paths`` are the resolved ``spec.files``, in the same order."""


@dataclass(frozen=True)
class DatasetSpec:
    """What the registry knows about a dataset before loading it.

    ``n_rows``: rows of the training file, or of the whole file when the split is the seeded 80/20 one
    (before any row is dropped for missing values). ``n_test_rows``: rows of the given test file, or
    ``None`` for a seeded split. ``n_features``: after preprocessing. A loaded file that does not match
    is rejected (a truncated download), except the feature count when ``strict_features`` is False
    (then only a warning: the preprocessing rule could not be checked against the real file).
    """

    name: str
    task: str
    description: str
    loader: Loader
    files: tuple[str, ...]
    n_rows: int
    n_features: int
    n_test_rows: int | None = None
    aliases: tuple[str, ...] = ()
    system_dirs: tuple[Path, ...] = ()
    strict_features: bool = True
    notes: str = field(default="", compare=False)
    stand_in: str | None = None
    """The registered synthetic stand-in used when this dataset's real file is absent (D3, D4)."""

    @property
    def split(self) -> str:
        if self.n_test_rows is not None:
            return "given test file"
        return f"seeded {1 - TEST_FRACTION:.0%}/{TEST_FRACTION:.0%}"


def seeded_split(n_rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, test) row indices: a seeded random 20% is test; deterministic for a seed."""
    n_test = round(n_rows * TEST_FRACTION)
    order = np.random.default_rng(seed).permutation(n_rows)
    return np.sort(order[n_test:]), np.sort(order[:n_test])


def check_row_count(spec: DatasetSpec, path: Path, found: int, expected: int) -> None:
    """Reject a file whose row count differs from the published one (truncated or wrong file)."""
    if found != expected:
        raise DataValidationError(
            f"dataset {spec.name!r}: {path} has {found:,} rows, expected {expected:,} (truncated, or not "
            f"the published file?)"
        )
