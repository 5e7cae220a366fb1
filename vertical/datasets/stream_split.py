"""``vfl split FILE.svm``: a LIBSVM file, however large, into per-party folders in bounded memory.

Two passes over the file, each a chunk of complete lines at a time (``chunk_bytes``, 8 MiB by
default), parsed by scikit-learn's C parser:

1. count the rows, keep the labels (8 bytes a row) and each row's line number (8 bytes), find the
   smallest and largest column index (LIBSVM is 1-based unless index 0 appears: the same rule as
   :func:`~vertical.datasets.libsvm.read_svmlight`) and the width, when not given;
2. draw the seeded 80/20 split and the column partition exactly as for a loaded dataset
   (:func:`~vertical.datasets.base.seeded_split`, :func:`~vertical.partition.random_blocks`), then parse again
   and append each chunk's entries to every party's ``.npy`` files (:class:`NpyAppender`).

Memory: one chunk's CSR, the per-row arrays above, and a column → (party, local column) map of
6 bytes per column (100 MB at webspam's 16.6M columns) plus the partition itself; never the data.
The output is the folder layout of :mod:`vertical.datasets.party_folder`, bit for bit what
``split_to_party_files(..., layout="folder")`` writes for the same file loaded in memory.

A line that cannot be parsed is reported as ``<file>, line <n>: <what is wrong>``.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from vertical.datasets.base import seeded_split
from vertical.datasets.libsvm import bad_libsvm_line
from vertical.datasets.party_files import (
    MANIFEST_NAME,
    PartyManifest,
    _check_active,
    clear_split,
    party_file_name,
)
from vertical.datasets.party_folder import FOLDER_FORMAT, META_NAME, SPLITS, NpyAppender
from vertical.datasets.paths import open_binary
from vertical.datasets.validation import TASKS, DataValidationError, checked_labels
from vertical.partition import contiguous_blocks, order_columns, random_blocks

CHUNK_BYTES = 8 << 20


@dataclass
class _Chunk:
    X: sp.csr_matrix  # raw column indices as written in the file
    y: np.ndarray
    lines: np.ndarray  # the 1-based line number of each row
    first_row: int


def _data_lines(text: bytes, first_line: int) -> np.ndarray:
    """Line numbers of the lines that hold a row (not blank, not only a comment)."""
    numbers = [first_line + i for i, line in enumerate(text.split(b"\n"))
               if line.split(b"#", 1)[0].strip()]
    return np.asarray(numbers, dtype=np.int64)


def _explain(path: Path, text: bytes, first_line: int, error: Exception) -> DataValidationError:
    """Find the line scikit-learn rejected, and say what is wrong with it."""
    found = bad_libsvm_line(path, text, first_line)
    if found is not None:
        return found
    last = first_line + text.count(b"\n") - 1
    return DataValidationError(f"{path}, lines {first_line}..{last}: cannot parse ({error})")


def _chunks(path: Path, chunk_bytes: int) -> Iterator[_Chunk]:
    """The file as CSR chunks of whole lines, each row with its line number."""
    from sklearn.datasets import load_svmlight_file  # here: importing sklearn costs ~1 s of start-up

    line, row = 1, 0
    with open_binary(path) as f:
        while True:
            text = f.read(chunk_bytes)
            if not text:
                return
            if not text.endswith(b"\n"):
                text += f.readline()
            lines = _data_lines(text, line)
            if lines.size:
                try:
                    X, y = load_svmlight_file(io.BytesIO(text), dtype=np.float64, zero_based=True,
                                              query_id=False)
                except (ValueError, OverflowError) as error:  # an index past a C int overflows
                    raise _explain(path, text, line, error) from None
                X = sp.csr_matrix(X)
                if X.shape[0] != lines.size:
                    raise _explain(path, text, line, ValueError(f"{X.shape[0]} rows from {lines.size} lines"))
                bad = np.flatnonzero(~np.isfinite(X.data))
                if bad.size:
                    r = int(np.searchsorted(X.indptr, bad[0], side="right") - 1)
                    raise DataValidationError(f"{path}, line {lines[r]}: feature {int(X.indices[bad[0]])} "
                                              f"is {X.data[bad[0]].item()!r} (features must be finite)")
                yield _Chunk(X, y, lines, row)
                row += X.shape[0]
            line += text.count(b"\n")


@dataclass(frozen=True)
class _Survey:
    """What the first pass learns."""

    n_rows: int
    labels: np.ndarray
    lines: np.ndarray
    min_index: int
    max_index: int
    max_line: int
    counts: np.ndarray  # nonzeros per raw column index (for --column-order frequency)


def _survey(path: Path, chunk_bytes: int) -> _Survey:
    labels, lines = [], []
    low, high, high_line = math.inf, -1, 0
    counts = np.zeros(0, dtype=np.int64)
    for chunk in _chunks(path, chunk_bytes):
        labels.append(chunk.y)
        lines.append(chunk.lines)
        if chunk.X.nnz:
            here = np.bincount(chunk.X.indices)
            if here.size > counts.size:
                counts = np.concatenate([counts, np.zeros(here.size - counts.size, dtype=np.int64)])
            counts[:here.size] += here
            low = min(low, int(chunk.X.indices.min()))
            top = int(chunk.X.indices.max())
            if top > high:
                row = int(np.searchsorted(chunk.X.indptr, int(np.argmax(chunk.X.indices)), side="right") - 1)
                high, high_line = top, int(chunk.lines[row])
    if not labels:
        raise DataValidationError(f"{path}: no rows (an empty LIBSVM file)")
    return _Survey(int(sum(y.size for y in labels)), np.concatenate(labels), np.concatenate(lines),
                   0 if low == math.inf else int(low), high, high_line, counts)


def _stand_in_info(path: Path) -> dict | None:
    from vertical.datasets.synth import read_sidecar, sidecar_path

    return read_sidecar(path) if sidecar_path(path).is_file() else None


class _PartyWriter:
    """One party's folder, filled a chunk at a time."""

    def __init__(self, folder: Path, labelled: bool) -> None:
        self.folder, self.labelled = folder, labelled
        for split in SPLITS:
            (folder / split).mkdir(parents=True)
        self.files = {f"{split}/{name}": NpyAppender(folder / split / f"{name}.npy", dtype)
                      for split in SPLITS
                      for name, dtype in (("data", np.float64), ("indices", np.int32), ("indptr", np.int64))}
        self.nnz = dict.fromkeys(SPLITS, 0)
        for split in SPLITS:
            self.files[f"{split}/indptr"].append(np.zeros(1, dtype=np.int64))

    def append(self, split: str, data: np.ndarray, indices: np.ndarray, counts: np.ndarray) -> None:
        self.files[f"{split}/data"].append(data)
        self.files[f"{split}/indices"].append(indices)
        self.files[f"{split}/indptr"].append(self.nnz[split] + np.cumsum(counts))
        self.nnz[split] += int(data.size)

    def finish(self, meta: dict, columns: np.ndarray, ids: dict[str, np.ndarray],
               labels: dict[str, np.ndarray]) -> None:
        for appender in self.files.values():
            appender.close()
        np.save(self.folder / "columns.npy", columns, allow_pickle=False)
        for split in SPLITS:
            np.save(self.folder / split / "ids.npy", ids[split], allow_pickle=False)
            if self.labelled:
                np.save(self.folder / split / "y.npy", labels[split], allow_pickle=False)
            meta[split] = {"kind": "csr", "rows": int(ids[split].size), "nnz": self.nnz[split]}
        (self.folder / META_NAME).write_text(json.dumps({"format": FOLDER_FORMAT, **meta}, indent=2) + "\n")


class _Router:
    """Sends each entry of a chunk to its party (by column) and its split (by row), renumbered to the
    party's local columns: the per-entry work of the second pass, with the maps built once."""

    def __init__(self, blocks: list[np.ndarray], width: int, base: int, is_test: np.ndarray,
                 renumbered: bool) -> None:
        self.owner = np.empty(width, dtype=np.int16 if len(blocks) < 2**15 else np.int32)
        self.local = np.empty(width, dtype=np.int32)
        for p, block in enumerate(blocks):
            self.owner[block] = p
            self.local[block] = np.arange(block.size, dtype=np.int32)
        self.base, self.is_test, self.renumbered = base, is_test, renumbered

    def route(self, chunk: _Chunk, writers: list[_PartyWriter]) -> None:
        X = chunk.X
        rows = np.repeat(np.arange(X.shape[0]), np.diff(X.indptr))
        columns = X.indices.astype(np.int64) - self.base
        entry_owner = self.owner[columns]
        chunk_test = self.is_test[chunk.first_row:chunk.first_row + X.shape[0]]
        for split, wanted in (("train", False), ("test", True)):
            in_split = chunk_test[rows] == wanted
            selected_rows = chunk_test == wanted
            for p, writer in enumerate(writers):
                mask = in_split & (entry_owner == p)
                counts = np.bincount(rows[mask], minlength=X.shape[0])[selected_rows]
                data, indices = X.data[mask], self.local[columns[mask]]
                if self.renumbered:   # local numbers no longer follow the file's order within a row
                    order = np.lexsort((indices, rows[mask]))
                    data, indices = data[order], indices[order]
                writer.append(split, data, indices, counts)


def _check_request(source: Path, task: str, chunk_bytes: int) -> None:
    """What can be refused before the file is read."""
    if not source.is_file():
        raise FileNotFoundError(f"LIBSVM file {source} does not exist")
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")


def _width(source: Path, survey: _Survey, base: int, n_features: int | None, stand_in: dict | None) -> int:
    """The number of features: as given, else a stand-in's, else the file's largest index; every
    index of the file must fall inside it."""
    width = n_features or (int(stand_in["n_features"]) if stand_in else survey.max_index - base + 1)
    if survey.max_index - base >= width:
        raise DataValidationError(f"{source}, line {survey.max_line}: feature index {survey.max_index} is "
                                  f"beyond the {width:,} features")
    return width


def _ordered_blocks(blocks: list[np.ndarray], raw_counts: np.ndarray, width: int,
                    column_order: str) -> tuple[list[np.ndarray], bool]:
    """The blocks with columns numbered by ``column_order`` (first-pass counts), and whether any block's
    numbering now differs from the file's index order (then each row's entries must be re-sorted)."""
    if column_order == "index":
        return blocks, False
    counts = np.zeros(width, dtype=np.int64)
    counts[:raw_counts.size] = raw_counts
    ordered = [order_columns(block, counts, column_order) for block in blocks]
    return ordered, any(a is not b for a, b in zip(ordered, blocks, strict=True))


def _publish(out: Path, writers: list[_PartyWriter], partial: list[Path], blocks: list[np.ndarray],
             common: dict, ids: dict[str, np.ndarray], labels: dict[str, np.ndarray]) -> list[Path]:
    """Close every party's folder and only then give it its final name, so that an interrupted split
    leaves ``*.partial`` folders and never a party folder that looks complete."""
    paths = []
    for p, (writer, block) in enumerate(zip(writers, blocks, strict=True)):
        meta = {"dataset": common["dataset"], "task": common["task"], "party": p,
                "n_features_total": common["n_features_total"], "n_features": int(block.size),
                "has_labels": writer.labelled}
        writer.finish(meta, block, ids, labels)
        final = out / party_file_name(p, "folder")
        partial[p].rename(final)
        paths.append(final)
    return paths


def split_libsvm_file(path: str | Path, parties: int, active: Sequence[int], out_dir: str | Path, *,
                      seed: int = 0, partition_seed: int | None = None, contiguous: bool = False,
                      n_features: int | None = None, task: str = "binary", dataset: str | None = None,
                      overwrite: bool = False, chunk_bytes: int = CHUNK_BYTES,
                      column_order: str = "index") -> list[Path]:
    """Split a LIBSVM file (plain, .gz, .bz2) into ``party-<p>/`` folders and ``manifest.json``.

    ``n_features``: the width (default: a stand-in's sidecar, else the largest index in the file).
    ``dataset``: the name recorded (default: a stand-in's name, else the file name). The train/test
    split (seed ``seed``) and the partition (``partition_seed``, default ``seed``) are those
    ``vfl split <name>`` draws for a registered dataset of the same rows and width; ``column_order``
    numbers each block's columns as :func:`~vertical.partition.order_columns` does (counts from the first
    pass).
    """
    source = Path(path)
    _check_request(source, task, chunk_bytes)
    stand_in = _stand_in_info(source)
    survey = _survey(source, chunk_bytes)
    base = 0 if survey.min_index == 0 else 1
    width = _width(source, survey, base, n_features, stand_in)
    if not 1 <= parties <= width:
        raise ValueError(f"the number of parties must be between 1 and the {width:,} features, got {parties}")
    active_parties = _check_active(active, parties)
    labels = checked_labels(survey.labels, task, lambda row: f"{source}, line {survey.lines[row]}")
    train_ids, test_ids = seeded_split(survey.n_rows, seed)
    is_test = np.zeros(survey.n_rows, dtype=bool)
    is_test[test_ids] = True
    p_seed = seed if partition_seed is None else partition_seed
    blocks = contiguous_blocks(width, parties) if contiguous else random_blocks(width, parties, seed=p_seed)
    blocks, renumbered = _ordered_blocks(blocks, survey.counts[base:base + width], width, column_order)
    router = _Router(blocks, width, base, is_test, renumbered)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    clear_split(out, overwrite)
    partial = [out / f"{party_file_name(p, 'folder')}.partial" for p in range(parties)]
    writers = [_PartyWriter(folder, p in active_parties) for p, folder in enumerate(partial)]
    for chunk in _chunks(source, chunk_bytes):
        router.route(chunk, writers)
    name = dataset or (stand_in["name"] if stand_in else source.name.removesuffix(".bz2").removesuffix(".gz"))
    ids = {"train": train_ids.astype(np.int64), "test": test_ids.astype(np.int64)}
    split_labels = {"train": labels[train_ids], "test": labels[test_ids]}
    common = {"dataset": name, "task": task, "n_features_total": width}
    paths = _publish(out, writers, partial, blocks, common, ids, split_labels)
    manifest = PartyManifest(name, task, parties, active_parties, int(train_ids.size), int(test_ids.size),
                             width, tuple(int(b.size) for b in blocks), seed, None if contiguous else p_seed,
                             tuple(p.name for p in paths))
    (out / MANIFEST_NAME).write_text(json.dumps(manifest.__dict__, indent=2) + "\n")
    return paths
