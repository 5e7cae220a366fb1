"""A strict, small CSV reader: a header row, then rows of exactly as many fields.

Why not ``np.loadtxt`` / ``np.genfromtxt``: they either stop with an error that does not say which
line, or silently fill short lines with NaN. Here a blank line, a short or long line, a missing value
where none is allowed, or a non-numeric cell is a :class:`DataValidationError` naming file, line and
column. Missing values are the empty string or ``NA`` (the spelling of Kaggle's GiveMeSomeCredit).
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vertical.datasets.paths import open_binary
from vertical.datasets.validation import DataValidationError, Locate

MISSING_MARKERS = ("", "NA")


@dataclass(frozen=True)
class CsvTable:
    """The cells of a CSV file as strings: ``cells[i]`` is the data row at file line ``lines[i]``."""

    path: Path
    header: tuple[str, ...]
    cells: np.ndarray
    lines: np.ndarray

    @property
    def n_rows(self) -> int:
        return self.cells.shape[0]

    def locate(self, rows: np.ndarray | None = None) -> Locate:
        """Where row ``i`` of a selection ``rows`` of this table (default: all rows) is in the file."""
        lines = self.lines if rows is None else self.lines[rows]
        return lambda i: f"{self.path}, line {lines[i]}"

    def column_index(self, name: str) -> int:
        try:
            return self.header.index(name)
        except ValueError:
            raise DataValidationError(f"{self.path}: no column named {name!r} in the header "
                                      f"{list(self.header)}") from None

    def numeric(self, columns: list[int], *, missing_ok: bool = False) -> np.ndarray:
        """The given columns as float64; missing cells become NaN when ``missing_ok``, else an error."""
        block = self.cells[:, columns]
        missing = np.isin(block, MISSING_MARKERS)
        if missing.any() and not missing_ok:
            row, col = (int(i[0]) for i in np.nonzero(missing))
            raise DataValidationError(f"{self.path}, line {self.lines[row]}: missing value in column "
                                      f"{self.header[columns[col]]!r}")
        try:
            values = np.where(missing, "nan", block).astype(np.float64)
        except ValueError:
            values = None
        # a cell that does not parse, or that spells a non-finite number ("inf", "nan"): named by its
        # line and column here, as a text error is, rather than by a column index further down
        bad = np.ones(block.shape, dtype=bool) if values is None else ~np.isfinite(values) & ~missing
        for row, col in zip(*np.nonzero(bad), strict=True):  # only to name the first offending cell
            try:
                finite = math.isfinite(float(block[row, col]))
            except ValueError:
                finite = False
            if not finite:
                raise DataValidationError(
                    f"{self.path}, line {self.lines[row]}: column {self.header[columns[col]]!r} holds "
                    f"{str(block[row, col])!r}, which is not a finite number")
        assert values is not None, "astype failed but every cell parsed"
        return values


def read_csv(path: Path) -> CsvTable:
    """Parse ``path`` (plain, .gz or .bz2), checking that every data line has the header's width."""
    with open_binary(path) as raw, io.TextIOWrapper(raw, encoding="utf-8", newline="") as text:
        reader = csv.reader(text)
        try:
            header, rows, lines = _rows(path, reader)
        except csv.Error as error:  # a field over csv.field_size_limit(), a stray NUL, ...
            raise DataValidationError(f"{path}, line {reader.line_num}: {error}") from None
        except UnicodeDecodeError as error:  # decoded by the block: no line to name
            raise DataValidationError(f"{path}: not UTF-8 text ({error.reason})") from None
    cells = np.array(rows, dtype=str).reshape(len(rows), len(header))
    return CsvTable(path, tuple(name.strip() for name in header), np.char.strip(cells), np.array(lines))


def _rows(path: Path, reader) -> tuple[list[str], list[list[str]], list[int]]:
    """The header, and every data row with its line, each row as wide as the header."""
    try:
        header = next(reader)
    except StopIteration:
        raise DataValidationError(f"{path}: the file is empty (a header row is required)") from None
    rows, lines = [], []
    for row in reader:
        if len(row) != len(header):
            what = "is blank" if not row else f"has {len(row)} fields, the header has {len(header)}"
            raise DataValidationError(f"{path}, line {reader.line_num}: the line {what}")
        rows.append(row)
        lines.append(reader.line_num)
    return header, rows, lines
