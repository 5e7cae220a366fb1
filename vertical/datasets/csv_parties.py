"""A folder of per-party CSV files (``party-<p>.csv``), turned once into the binary party files.

Organisations bring their data as CSV (the layout :func:`~vertical.datasets.party_files.load_party_file`
validates: ``id``, ``label`` on active parties only, optional ``split``, numeric features), usually
straight from ``vfl align``. Training reads binary party files, so the launcher converts the folder
once, before ``mpiexec``: every file is loaded with the CSV checks (errors name file and line), the rows
are checked to line up across parties, and :func:`~vertical.datasets.party_files.split_to_party_files`
writes the result, so whichever binary format it writes is the one training reads. Any shape is
accepted: a party's columns are simply its CSV's feature columns, in party order.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from vertical.datasets.base import Dataset, seeded_split
from vertical.datasets.party_files import PartyData, check_aligned, load_party_file, split_to_party_files
from vertical.datasets.validation import DataValidationError


def csv_party_name(party: int) -> str:
    return f"party-{party}.csv"


def is_csv_folder(folder: str | Path) -> bool:
    """Whether ``folder`` holds per-party CSV files (``party-0.csv`` at least) rather than binary ones."""
    return (Path(folder) / csv_party_name(0)).is_file()


def load_csv_parties(folder: str | Path, parties: int, active: int, task: str) -> list[PartyData]:
    """Load and validate ``party-0.csv`` … ``party-<q-1>.csv``: labels exactly on parties ``0..active-1``,
    at least one feature column and one training row each, the same ids in the same order everywhere."""
    source = Path(folder)
    missing = [csv_party_name(p) for p in range(parties) if not (source / csv_party_name(p)).is_file()]
    if missing:
        raise DataValidationError(f"{source}: missing {', '.join(missing)} (one CSV file per party, "
                                  f"party-0.csv … party-{parties - 1}.csv)")
    loaded = [load_party_file(source / csv_party_name(p), expect_labels=p < active, task=task)
              for p in range(parties)]
    for data in loaded:
        if data.n_features == 0:
            raise DataValidationError(f"{data.source}: no feature columns (only id/label/split): every "
                                      f"party needs at least one")
        if data.train_ids.size == 0:
            raise DataValidationError(f"{data.source}: no training rows")
    with_split = [d.test_ids.size > 0 for d in loaded]
    if any(with_split) and not all(with_split):
        has, lacks = loaded[with_split.index(True)], loaded[with_split.index(False)]
        raise DataValidationError(f"{has.source} has test rows but {lacks.source} has none: every party's "
                                  f"file needs the same split column (or none)")
    check_aligned(loaded)
    return loaded


def csv_parties_to_party_files(parties: Sequence[PartyData], active: int, out_dir: str | Path, *,
                               name: str = "csv") -> list[Path]:
    """Write the loaded CSV parties (:func:`load_csv_parties`) as binary party files in ``out_dir``
    (replacing an earlier conversion); party p gets global columns after those of parties 0..p-1."""
    widths = [p.n_features for p in parties]
    starts = np.concatenate([[0], np.cumsum(widths)])
    blocks = [np.arange(starts[p], starts[p + 1]) for p in range(len(parties))]
    labelled = parties[0]
    names = tuple(n for p in parties for n in (p.feature_names or ()))
    dataset = Dataset(name, labelled.task or "", np.hstack([p.X_train for p in parties]), labelled.y_train,
                      np.hstack([p.X_test for p in parties]), labelled.y_test, labelled.train_ids,
                      labelled.test_ids, seed=None,
                      feature_names=names if len(names) == int(starts[-1]) else None)
    # the memory-mappable layout: the ranks map the converted blocks instead of each holding a copy
    return split_to_party_files(dataset, blocks, list(range(active)), out_dir, overwrite=True,
                                layout="folder")


def csv_file_dataset(path: str | Path, task: str, seed: int) -> Dataset:
    """One labelled CSV file (``id``, ``label``, optional ``split``, feature columns; the format of an
    active party's file) as a :class:`Dataset`, for ``vfl split FILE.csv``. Without a ``split`` column
    the rows are split 80/20 with ``seed``, as the registered datasets are."""
    data = load_party_file(path, expect_labels=True, task=task)
    X, y, ids = data.X_train, data.y_train, data.train_ids
    if data.X_test.shape[0] == 0:  # no split column: every row came as a training row
        train, test = seeded_split(X.shape[0], seed)
        return Dataset(Path(path).stem, task, X[train], y[train], X[test], y[test], ids[train], ids[test],
                       seed=seed, feature_names=data.feature_names)
    return Dataset(Path(path).stem, task, X, y, data.X_test, data.y_test, ids, data.test_ids, seed=None,
                   feature_names=data.feature_names)
