"""One data file per party, for runs where each party (host) reads only its own features.

``split_to_party_files`` writes, into ``out_dir``, one of two layouts with the same contents:

- ``layout="npz"`` (the default of this function, the format existing splits use):
  ``party-<p>.npz`` for p = 0..q-1: party p's train and test feature blocks (CSR kept as CSR, stored
  as its data/indices/indptr/shape arrays; dense kept dense), its global column indices, the train and
  test sample ids, the task and dataset name. **Labels only in the active parties' files.** One
  compressed file per organisation: the easiest to hand over.
- ``layout="folder"``: a folder ``party-<p>/`` of plain ``.npy`` arrays that a rank memory-maps
  instead of inflating (:mod:`vertical.datasets.party_folder`); what ``vfl split`` and the launcher write,
  because at news20/webspam widths a rank should not hold a private copy of its block.
- ``manifest.json``: q, which parties are active, n_train, n_test, n_features, task, dataset, split and
  partition seeds, and the per-party block sizes. Nothing about feature values.

``find_party_file(folder, p)`` finds party p's file or folder in a split; ``load_party_file`` reads
either layout back, or a **CSV party file** brought by an organisation, laid
out as: a header row; an ``id`` column (integer sample ids, unique, the alignment key); an optional
``label`` column (active parties only); an optional ``split`` column with values ``train`` / ``test``
(without it every row is a training row); every other column is a numeric feature (finite; no missing
values). The CSV's global column indices are unknown, so ``PartyData.columns`` is ``None`` and the
header names are kept as ``feature_names``. A CSV with labels needs ``task=`` to validate them.

Every problem is a :class:`DataValidationError` naming the file and the row (and sample id).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from vertical.datasets.base import Dataset, Matrix
from vertical.datasets.csv_table import read_csv
from vertical.datasets.party_folder import (
    is_party_folder,
    matrix_arrays,
    read_party_folder,
    write_party_folder,
)
from vertical.datasets.validation import (
    TASKS,
    DataValidationError,
    check_finite_features,
    checked_csr,
    checked_labels,
    integer_ids,
    locate_rows,
)
from vertical.partition import block_of, blocks_from_columns, column_counts, order_columns

FORMAT = "vfl-party-file/1"
MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "test")
LAYOUTS = ("npz", "folder")


def party_file_name(party: int, layout: str = "npz") -> str:
    """``party-<p>.npz``, or ``party-<p>`` for the folder layout."""
    return f"party-{party}.npz" if layout == "npz" else f"party-{party}"


def find_party_file(folder: str | Path, party: int) -> Path:
    """Party ``party``'s data in a split folder: the ``party-<p>/`` folder, else ``party-<p>.npz``.

    Raises FileNotFoundError naming both when neither is there.
    """
    base = Path(folder)
    as_folder, as_npz = base / party_file_name(party, "folder"), base / party_file_name(party, "npz")
    if is_party_folder(as_folder):
        return as_folder
    if as_npz.is_file():
        return as_npz
    raise FileNotFoundError(f"{base}: no data for party {party} ({as_folder.name}/ or {as_npz.name})")


def earlier_split(out: Path) -> list[Path]:
    """The files of a split already in ``out`` (party files or folders, the manifest)."""
    folders = [p for p in sorted(out.glob("party-*")) if is_party_folder(p) or p.name.endswith(".partial")]
    return sorted(out.glob("party-*.npz")) + folders + sorted(out.glob(MANIFEST_NAME))


def clear_split(out: Path, overwrite: bool) -> None:
    """Refuse to write over an earlier split unless ``overwrite``; then remove it."""
    earlier = earlier_split(out)
    if earlier and not overwrite:
        raise FileExistsError(f"{out} already holds a split ({earlier[0].name}, ...); pass overwrite=True "
                              f"(--overwrite) or choose an empty folder")
    for stale in earlier:
        if stale.is_dir():
            shutil.rmtree(stale)
        else:
            stale.unlink()


@dataclass(frozen=True, eq=False)
class PartyData:
    """What one party holds: its feature block for train and test rows, the ids, maybe labels.

    ``columns``: the block's global column indices (``None`` for a CSV file, where they are unknown).
    ``y_train``/``y_test``: ``None`` for a passive party.
    """

    source: Path
    X_train: Matrix
    X_test: Matrix
    train_ids: np.ndarray
    test_ids: np.ndarray
    y_train: np.ndarray | None
    y_test: np.ndarray | None
    task: str | None
    dataset: str | None = None
    party: int | None = None
    columns: np.ndarray | None = None
    n_features_total: int | None = None
    feature_names: tuple[str, ...] | None = None

    @property
    def has_labels(self) -> bool:
        return self.y_train is not None

    @property
    def n_features(self) -> int:
        return int(self.X_train.shape[1])


@dataclass(frozen=True)
class PartyManifest:
    """The contents of ``manifest.json``."""

    dataset: str
    task: str
    q: int
    active: tuple[int, ...]
    n_train: int
    n_test: int
    n_features: int
    block_sizes: tuple[int, ...]
    split_seed: int | None
    partition_seed: int | None
    files: tuple[str, ...]


def _matrix_arrays(prefix: str, X: Matrix) -> dict[str, np.ndarray]:
    if sp.issparse(X):
        return {f"{prefix}_data": X.data, f"{prefix}_indices": X.indices, f"{prefix}_indptr": X.indptr,
                f"{prefix}_shape": np.asarray(X.shape, dtype=np.int64)}
    return {prefix: np.asarray(X)}


def _check_active(active: Sequence[int], q: int) -> tuple[int, ...]:
    chosen = tuple(int(p) for p in active)
    if not chosen:
        raise ValueError("at least one party must be active (hold the labels)")
    if len(set(chosen)) != len(chosen) or any(not 0 <= p < q for p in chosen):
        raise ValueError(f"active parties must be distinct indices in 0..{q - 1}, got {list(active)}")
    return tuple(sorted(chosen))


def _write_folder(out: Path, dataset: Dataset, party: int, block: np.ndarray, labelled: bool) -> Path:
    arrays: dict[str, np.ndarray] = {"columns": block}
    meta = {"dataset": dataset.name, "task": dataset.task, "party": party,
            "n_features_total": dataset.n_features, "n_features": int(block.size), "has_labels": labelled}
    for split in SPLITS:
        block_arrays, meta[split] = matrix_arrays(split, block_of(getattr(dataset, f"X_{split}"), block))
        arrays.update(block_arrays)
        arrays[f"{split}/ids"] = np.asarray(getattr(dataset, f"{split}_ids"), dtype=np.int64)
        if labelled:
            arrays[f"{split}/y"] = np.asarray(getattr(dataset, f"y_{split}"))
    if dataset.feature_names is not None:
        arrays["feature_names"] = np.asarray(dataset.feature_names)[block].astype(np.str_)
    return write_party_folder(out / party_file_name(party, "folder"), meta, arrays)


def split_to_party_files(dataset: Dataset, blocks: Sequence[Sequence[int]], active: Sequence[int],
                         out_dir: str | Path, *, partition_seed: int | None = None,
                         overwrite: bool = False, layout: str = "npz",
                         column_order: str = "index") -> list[Path]:
    """Write one file per party (and ``manifest.json``) into ``out_dir``; return the party files in
    party order. ``blocks`` must be a partition of the dataset's columns (see :mod:`vertical.partition`).
    ``layout``: ``"npz"`` (one compressed file per party) or ``"folder"`` (memory-mappable).
    ``column_order``: how each block numbers its columns (:func:`vertical.partition.order_columns`).
    Refuses to overwrite an earlier split unless ``overwrite``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    checked_blocks = blocks_from_columns(blocks, dataset.n_features)
    if column_order != "index":
        counts = column_counts(dataset.X_train, dataset.X_test, n_features=dataset.n_features)
        checked_blocks = [order_columns(block, counts, column_order) for block in checked_blocks]
    q = len(checked_blocks)
    active_parties = _check_active(active, q)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    clear_split(out, overwrite)
    paths = []
    for party, block in enumerate(checked_blocks):
        if layout == "folder":
            paths.append(_write_folder(out, dataset, party, block, party in active_parties))
            continue
        arrays = {
            "format": np.asarray(FORMAT), "dataset": np.asarray(dataset.name),
            "task": np.asarray(dataset.task),
            "party": np.asarray(party), "n_features_total": np.asarray(dataset.n_features),
            "columns": block, "train_ids": np.asarray(dataset.train_ids, dtype=np.int64),
            "test_ids": np.asarray(dataset.test_ids, dtype=np.int64),
            **_matrix_arrays("X_train", block_of(dataset.X_train, block)),
            **_matrix_arrays("X_test", block_of(dataset.X_test, block)),
        }
        if dataset.feature_names is not None:
            arrays["feature_names"] = np.asarray(dataset.feature_names)[block]
        if party in active_parties:
            arrays["y_train"], arrays["y_test"] = dataset.y_train, dataset.y_test
        path = out / party_file_name(party)
        np.savez_compressed(path, **arrays)
        paths.append(path)
    manifest = PartyManifest(dataset.name, dataset.task, q, active_parties, dataset.n_train, dataset.n_test,
                             dataset.n_features, tuple(int(b.size) for b in checked_blocks), dataset.seed,
                             partition_seed, tuple(p.name for p in paths))
    (out / MANIFEST_NAME).write_text(json.dumps(manifest.__dict__, indent=2) + "\n")
    return paths


def read_manifest(directory: str | Path) -> PartyManifest:
    """The ``manifest.json`` written by :func:`split_to_party_files`."""
    path = Path(directory) / MANIFEST_NAME
    try:
        fields = json.loads(path.read_text())
        return PartyManifest(**{**fields, "active": tuple(fields["active"]),
                                "block_sizes": tuple(fields["block_sizes"]), "files": tuple(fields["files"])})
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise DataValidationError(f"{path}: not a valid party-split manifest ({error})") from error


def _labels_allowed(path: Path, has_labels: bool, expect_labels: bool | None) -> None:
    if expect_labels is True and not has_labels:
        raise DataValidationError(f"{path}: the file has no labels, but an active party needs them")
    if expect_labels is False and has_labels:
        raise DataValidationError(f"{path}: the file contains labels, but this party is passive "
                                  f"(only active parties may hold labels)")


def _validated(data: PartyData, expect_labels: bool | None) -> PartyData:
    """Shape, id, label and feature checks common to both file kinds."""
    path = data.source
    _labels_allowed(path, data.has_labels, expect_labels)
    labels: dict[str, np.ndarray] = {}
    if data.columns is not None and data.columns.size != data.n_features:
        raise DataValidationError(f"{path}: {data.n_features} feature columns but {data.columns.size} "
                                  f"column indices")
    for split in SPLITS:
        X, ids, y = getattr(data, f"X_{split}"), getattr(data, f"{split}_ids"), getattr(data, f"y_{split}")
        if X.shape[0] != ids.shape[0] or (y is not None and y.shape[0] != ids.shape[0]):
            labels_found = "" if y is None else f" and {y.shape[0]} labels"
            raise DataValidationError(f"{path}: {split} split has {X.shape[0]} feature rows, "
                                      f"{ids.shape[0]} ids{labels_found}")
        if X.shape[1] != data.n_features:
            raise DataValidationError(f"{path}: the {split} block has {X.shape[1]} columns, the train block "
                                      f"{data.n_features}")
        locate = locate_rows(f"{path} ({split})", ids=ids)
        check_finite_features(X, locate)
        if y is not None:
            labels[f"y_{split}"] = checked_labels(y, data.task or "", locate)
    all_ids = np.concatenate([data.train_ids, data.test_ids])
    unique, counts = np.unique(all_ids, return_counts=True)
    if (counts > 1).any():
        raise DataValidationError(f"{path}: sample id {unique[counts > 1][0]} appears more than once")
    return replace(data, **labels)


def _npz_matrix(path: Path, arrays: np.lib.npyio.NpzFile, prefix: str) -> Matrix:
    """A block as stored: dense, or CSR arrays checked before scipy sees them (a bad ``indptr`` makes
    scipy read outside its arrays)."""
    try:
        if prefix in arrays:
            X = arrays[prefix]
            if X.ndim != 2 or X.dtype.kind not in "iuf":
                raise DataValidationError(f"{path}: {prefix} is a {X.ndim}-d {X.dtype} array, not a matrix")
            return X
        parts = (arrays[f"{prefix}_data"], arrays[f"{prefix}_indices"], arrays[f"{prefix}_indptr"])
        shape = arrays[f"{prefix}_shape"]
    except KeyError as error:
        raise DataValidationError(f"{path}: missing array {error.args[0]!r} for {prefix}") from None
    except ValueError as error:  # an object array (allow_pickle=False) or a damaged member
        raise DataValidationError(f"{path}: corrupted matrix {prefix} ({error})") from None
    if shape.shape != (2,) or shape.dtype.kind not in "iu":
        raise DataValidationError(f"{path}: {prefix}_shape is not two integers")
    return checked_csr(f"{path} ({prefix})", *parts, (int(shape[0]), int(shape[1])), sort=True)


def _load_npz(path: Path, task: str | None) -> PartyData:
    with np.load(path, allow_pickle=False) as arrays:
        try:
            if str(arrays["format"]) != FORMAT:
                raise DataValidationError(f"{path}: format {str(arrays['format'])!r}, expected {FORMAT!r}")
            stored_task = str(arrays["task"])
            labels = (arrays["y_train"], arrays["y_test"]) if "y_train" in arrays else (None, None)
            names = tuple(str(n) for n in arrays["feature_names"]) if "feature_names" in arrays else None
            data = PartyData(path, _npz_matrix(path, arrays, "X_train"), _npz_matrix(path, arrays, "X_test"),
                             arrays["train_ids"], arrays["test_ids"], *labels, stored_task,
                             str(arrays["dataset"]), int(arrays["party"]), arrays["columns"],
                             int(arrays["n_features_total"]), names)
        except KeyError as error:
            raise DataValidationError(f"{path}: not a vfl party file (missing {error.args[0]!r})") from None
        except DataValidationError:
            raise
        except (ValueError, TypeError) as error:  # a field of the wrong shape or kind
            raise DataValidationError(f"{path}: not a valid vfl party file ({error})") from None
    if task is not None and task != stored_task:
        raise DataValidationError(f"{path}: the file is for a {stored_task} task, {task} was expected")
    return data


def _load_csv(path: Path, task: str | None) -> PartyData:
    table = read_csv(path)
    id_column = table.column_index("id")
    special = {"id", "label", "split"}
    feature_columns = [j for j, name in enumerate(table.header) if name not in special]
    ids = integer_ids(table.cells[:, id_column], table.locate())  # exactly: never through a float
    is_test = np.zeros(table.n_rows, dtype=bool)
    if "split" in table.header:
        split = table.cells[:, table.column_index("split")]
        bad = np.flatnonzero(~np.isin(split, SPLITS))
        if bad.size:
            raise DataValidationError(f"{path}, line {table.lines[bad[0]]}: split {str(split[bad[0]])!r} "
                                      f"is not 'train' or 'test'")
        is_test = split == "test"
    X = table.numeric(feature_columns)
    check_finite_features(X, table.locate())
    y = None
    if "label" in table.header:
        if task is None:
            raise DataValidationError(f"{path}: the file has a label column; pass task= (one of {TASKS}) "
                                      f"so its labels can be checked")
        label_column = table.column_index("label")
        raw = table.numeric([label_column], missing_ok=True)[:, 0]
        y = checked_labels(raw, task, table.locate())
    names = tuple(table.header[j] for j in feature_columns)
    train, test = ~is_test, is_test
    return PartyData(path, X[train], X[test], ids[train], ids[test], None if y is None else y[train],
                     None if y is None else y[test], task, feature_names=names)


def load_party_file(path: str | Path, *, expect_labels: bool | None = None,
                    task: str | None = None) -> PartyData:
    """Load and validate one party's data: a ``party-<p>/`` folder (memory-mapped) or an ``.npz`` from
    :func:`split_to_party_files`, or a ``.csv``.

    ``expect_labels``: True for an active party (labels required), False for a passive one (labels
    forbidden), None to accept either. ``task``: required for a CSV file with labels; for an npz file,
    checked against the stored task when given.
    """
    source = Path(path)
    if task is not None and task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    if is_party_folder(source):
        data = PartyData(source, **read_party_folder(source))
        if task is not None and task != data.task:
            raise DataValidationError(f"{source}: the data is for a {data.task} task, {task} was expected")
        return _validated(data, expect_labels)
    if source.is_dir():
        raise DataValidationError(f"{source}: a folder without party.json is not a vfl party folder")
    if not source.is_file():
        raise FileNotFoundError(f"party file {source} does not exist")
    is_csv = source.name.endswith((".csv", ".csv.gz", ".csv.bz2"))
    data = _load_csv(source, task) if is_csv else _load_npz(source, task)
    return _validated(data, expect_labels)


def check_aligned(parties: Sequence[PartyData]) -> None:
    """Raise unless all parties hold the same samples in the same order (and agree on labels/task).

    Also rejects two parties holding the same global column, when the columns are known.
    """
    if not parties:
        raise ValueError("check_aligned needs at least one party")
    first = parties[0]
    for other in parties[1:]:
        for split in SPLITS:
            ids, other_ids = getattr(first, f"{split}_ids"), getattr(other, f"{split}_ids")
            if ids.shape != other_ids.shape:
                raise DataValidationError(f"{other.source} has {other_ids.size} {split} rows but "
                                          f"{first.source} has {ids.size}")
            differ = np.flatnonzero(ids != other_ids)
            if differ.size:
                row = int(differ[0])
                raise DataValidationError(f"{split} row {row}: {first.source} has sample id {ids[row]} but "
                                          f"{other.source} has id {other_ids[row]} (rows are not aligned)")
        if first.task and other.task and first.task != other.task:
            raise DataValidationError(f"{first.source} is for a {first.task} task, {other.source} for "
                                      f"{other.task}")
    labelled = [p for p in parties if p.has_labels]
    for other in labelled[1:]:
        for split in SPLITS:
            differ = np.flatnonzero(getattr(labelled[0], f"y_{split}") != getattr(other, f"y_{split}"))
            if differ.size:
                row = int(differ[0])
                sample = getattr(other, f"{split}_ids")[row]
                raise DataValidationError(f"{split} row {row} (id {sample}): the labels of "
                                          f"{labelled[0].source} and {other.source} differ")
    if all(p.columns is not None for p in parties):
        columns = np.concatenate([p.columns for p in parties])
        owners = np.repeat(np.arange(len(parties)), [p.columns.size for p in parties])
        order = np.argsort(columns, kind="stable")
        repeated = np.flatnonzero(columns[order][1:] == columns[order][:-1])
        if repeated.size:
            first_owner, second_owner = owners[order][repeated[0]], owners[order][repeated[0] + 1]
            raise DataValidationError(f"column {columns[order][repeated[0]]} is held by both "
                                      f"{parties[first_owner].source} and {parties[second_owner].source}")


def assemble_features(parties: Sequence[PartyData]) -> tuple[Matrix, Matrix]:
    """The full (train, test) feature matrices rebuilt from all parties' blocks, in global column order
    (for a centralised "NonF" reference). Needs every party's column indices."""
    if any(p.columns is None for p in parties):
        raise ValueError("assemble_features needs global column indices (npz party files, not CSV)")
    check_aligned(parties)
    n_total = parties[0].n_features_total
    blocks_from_columns([p.columns for p in parties], n_total)
    order = np.argsort(np.concatenate([p.columns for p in parties]))
    assembled = []
    for split in SPLITS:
        blocks = [getattr(p, f"X_{split}") for p in parties]
        if any(sp.issparse(b) for b in blocks):
            assembled.append(sp.csr_matrix(sp.hstack(blocks, format="csr")[:, order]))
        else:
            assembled.append(np.hstack(blocks)[:, order])
    return assembled[0], assembled[1]
