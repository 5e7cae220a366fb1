"""Named datasets, loaded and split the way the papers do, with their files found and validated.

    >>> from vertical.datasets import load
    >>> ds = load("a9a", seed=0)            # doctest: +SKIP
    >>> ds.X_train.shape, ds.task           # doctest: +SKIP
    ((26049, 123), 'binary')

Modules: :mod:`~vertical.datasets.registry` (names, shapes, :func:`load`), :mod:`~vertical.datasets.paths`
(where files are looked for), :mod:`~vertical.datasets.libsvm`, :mod:`~vertical.datasets.credit`,
:mod:`~vertical.datasets.idx`, :mod:`~vertical.datasets.embedded` (the loaders),
:mod:`~vertical.datasets.party_files` (one file per party for multi-host runs) and
:mod:`~vertical.datasets.validation` (the checks, with errors naming file and row).
"""

from vertical.datasets.base import Dataset, DatasetSpec, seeded_split
from vertical.datasets.party_files import PartyData, check_aligned, load_party_file, split_to_party_files
from vertical.datasets.paths import DATA_DIR_ENV, DatasetNotFoundError, data_dir_candidates
from vertical.datasets.registry import DatasetInfo, get_spec, list_datasets, load
from vertical.datasets.validation import DataValidationError

__all__ = [
    "DATA_DIR_ENV",
    "DataValidationError",
    "Dataset",
    "DatasetInfo",
    "DatasetNotFoundError",
    "DatasetSpec",
    "PartyData",
    "check_aligned",
    "data_dir_candidates",
    "get_spec",
    "list_datasets",
    "load",
    "load_party_file",
    "seeded_split",
    "split_to_party_files",
]
