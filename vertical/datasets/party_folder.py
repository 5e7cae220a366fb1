"""The memory-mappable per-party format: a folder ``party-<p>/`` of plain ``.npy`` arrays.

An ``.npz`` is compressed, so a rank must inflate its whole block into private memory before it can
train. A folder of ``.npy`` files is opened with ``np.load(mmap_mode="r")``: the CSR arrays stay in
the page cache, shared by every process on the machine that reads them, read on demand, and never
copied (the kernels take CSR float64 / int32 / int64 exactly as stored here). Layout::

    party-<p>/party.json            format, dataset, task, party, widths, rows and nnz per split
    party-<p>/columns.npy           int64 global column indices of the block (sorted)
    party-<p>/<split>/ids.npy       int64 sample ids (split = train, test)
    party-<p>/<split>/y.npy         float64 labels (active parties only)
    party-<p>/<split>/data.npy      float64 CSR values          \\
    party-<p>/<split>/indices.npy   int32 CSR local columns      } sparse blocks
    party-<p>/<split>/indptr.npy    int64 CSR row pointers      /
    party-<p>/<split>/X.npy         float64 dense block (tabular data)

:class:`NpyAppender` writes an ``.npy`` whose length is only known at the end (the streaming
``vfl split`` appends a chunk at a time), by reserving the header and rewriting it on close.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from vertical.datasets.validation import DataValidationError, checked_csr

FOLDER_FORMAT = "vfl-party-folder/1"
META_NAME = "party.json"
SPLITS = ("train", "test")
_HEADER_BYTES = 128  # magic (6) + version (2) + length (2) + the header dict padded to 118


class NpyAppender:
    """An ``.npy`` file of one 1-d dtype, written by appending; ``close()`` fixes its length."""

    def __init__(self, path: Path, dtype: np.dtype | type) -> None:
        self.path, self.dtype, self.count = path, np.dtype(dtype), 0
        self._file = open(path, "wb")  # noqa: SIM115 (closed in close(), after the appends)
        self._file.write(b"\0" * _HEADER_BYTES)

    def append(self, values: np.ndarray) -> None:
        chunk = np.ascontiguousarray(values, dtype=self.dtype)
        self._file.write(chunk.tobytes())
        self.count += int(chunk.size)

    def close(self) -> None:
        header = repr({"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                       "shape": (self.count,)})
        body = header.encode("latin1").ljust(_HEADER_BYTES - 10 - 1) + b"\n"
        self._file.seek(0)
        self._file.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body)
        self._file.close()


def _save(path: Path, array: np.ndarray) -> None:
    np.save(path, np.ascontiguousarray(array), allow_pickle=False)


def write_party_folder(target: Path, meta: dict, arrays: dict[str, np.ndarray]) -> Path:
    """Write ``party.json`` and the given arrays (relative names such as ``train/data``) into
    ``target``, atomically: a half-written folder never carries the final name."""
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    for split in SPLITS:
        (partial / split).mkdir(parents=True)
    for name, array in arrays.items():
        _save(partial / f"{name}.npy", array)
    (partial / META_NAME).write_text(json.dumps({"format": FOLDER_FORMAT, **meta}, indent=2) + "\n")
    if target.exists():
        shutil.rmtree(target)
    os.replace(partial, target)
    return target


def matrix_arrays(split: str, X) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays and the ``party.json`` entry of one split's block (CSR as CSR, dense as dense)."""
    if sp.issparse(X):
        X = sp.csr_matrix(X, dtype=np.float64)
        X.sum_duplicates()
        arrays = {f"{split}/data": X.data.astype(np.float64, copy=False),
                  f"{split}/indices": X.indices.astype(np.int32, copy=False),
                  f"{split}/indptr": X.indptr.astype(np.int64, copy=False)}
        return arrays, {"kind": "csr", "rows": int(X.shape[0]), "nnz": int(X.nnz)}
    dense = np.ascontiguousarray(X)
    return {f"{split}/X": dense}, {"kind": "dense", "rows": int(dense.shape[0])}


def is_party_folder(path: Path) -> bool:
    return path.is_dir() and (path / META_NAME).is_file()


def _load(folder: Path, name: str, dtypes: tuple[type, ...], ndim: int = 1) -> np.ndarray:
    path = folder / f"{name}.npy"
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise DataValidationError(f"{folder}: missing {name}.npy") from None
    except (ValueError, OSError, SyntaxError) as error:
        raise DataValidationError(f"{path}: not a readable .npy array ({error})") from None
    if array.ndim != ndim or array.dtype.type not in dtypes:
        raise DataValidationError(f"{path}: expected a {ndim}-d {'/'.join(t.__name__ for t in dtypes)} "
                                  f"array, found {array.ndim}-d {array.dtype}")
    return array


def _csr(folder: Path, split: str, entry: dict, n_cols: int) -> sp.csr_matrix:
    """A CSR block over the memory-mapped arrays, checked so that the kernels never index outside."""
    where = f"{folder} ({split})"
    data = _load(folder, f"{split}/data", (np.float64,))
    indices = _load(folder, f"{split}/indices", (np.int32, np.int64))
    indptr = _load(folder, f"{split}/indptr", (np.int64, np.int32))
    return checked_csr(where, data, indices, indptr, (int(entry["rows"]), n_cols))


def read_party_folder(folder: Path) -> dict:
    """The fields of a :class:`~vertical.datasets.party_files.PartyData`, arrays memory-mapped."""
    try:
        meta = json.loads((folder / META_NAME).read_text())
        if meta.get("format") != FOLDER_FORMAT:
            raise DataValidationError(f"{folder}: format {meta.get('format')!r}, expected {FOLDER_FORMAT!r}")
        n_cols, entries = int(meta["n_features"]), {s: meta[s] for s in SPLITS}
        for split, entry in entries.items():
            if entry.get("kind") not in ("csr", "dense") or int(entry["rows"]) < 0:
                raise ValueError(f"{split}: kind {entry.get('kind')!r}, rows {entry['rows']!r}")
        task, has_labels = str(meta["task"]), bool(meta["has_labels"])
        fields = {"task": task, "dataset": str(meta["dataset"]), "party": int(meta["party"]),
                  "n_features_total": int(meta["n_features_total"])}
    except DataValidationError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise DataValidationError(f"{folder}: not a vfl party folder ({error!r})") from None
    columns = np.asarray(_load(folder, "columns", (np.int64,)))
    for split in SPLITS:
        entry = entries[split]
        if entry.get("kind") == "dense":
            X = _load(folder, f"{split}/X", (np.float64, np.float32), ndim=2)
        else:
            X = _csr(folder, split, entry, n_cols)
        fields[f"X_{split}"] = X
        fields[f"{split}_ids"] = np.asarray(_load(folder, f"{split}/ids", (np.int64,)))
        fields[f"y_{split}"] = (np.asarray(_load(folder, f"{split}/y", (np.float64, np.int64)))
                                if has_labels else None)
    if (folder / "feature_names.npy").is_file():
        fields["feature_names"] = tuple(str(n) for n in _load(folder, "feature_names", (np.str_,)))
    fields["columns"] = columns
    return fields

