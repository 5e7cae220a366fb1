"""The paper's financial datasets D1 (UCI credit card default) and D2 (GiveMeSomeCredit).

The paper says only that categorical columns are one-hot encoded, giving 90 (D1) and 92 (D2) features.
Our rule, identical for both:

- a column listed as categorical is one-hot encoded over the values **observed in the whole file**
  (the schema, not a statistic of the training rows, so that a rare value landing only in the test
  split still has a column); a categorical column with exactly two observed values becomes a single
  0/1 indicator of the larger value (one column carries all the information);
- every other column is numeric and is standardised with the mean and standard deviation of the
  **training split** (a constant column gets scale 1), so that logistic regression with the paper's
  step sizes converges;
- columns keep their order in the file; one-hot blocks replace their column in place (so a contiguous
  feature split keeps a source column's indicators together).

D1, ``UCI_Credit_Card.csv[.gz]``: columns ``ID, X1..X23, Y`` (UCI names) or the Kaggle names
(``LIMIT_BAL, SEX, ..., default.payment.next.month``). Categorical: sex (X2), education (X3), marriage
(X4) and the six repayment statuses (X6-X11). On the real file the observed values give
1 (sex) + 7 + 4 + 11+11+11+11+10+10 = 76 indicator columns, plus 14 numeric = **90**, the paper's
count. ID is dropped; Y (1 = default) is the +1 class. The file has no missing values, and a missing
value is an error naming the line.

D2, ``cs-training.csv[.gz]`` (Kaggle "Give Me Some Credit"): the unnamed index column is dropped;
``SeriousDlqin2yrs`` is the label. Rows with a missing value (``NA`` in MonthlyIncome or
NumberOfDependents) are dropped, leaving 120,269 of 150,000 rows (the companion AVFL code's
96,257 + 24,012); the seeded 80/20 split gives 96,215 / 24,054. Categorical: the five small-integer
count columns (the three past-due counters, NumberRealEstateLoansOrLines, NumberOfDependents); numeric:
RevolvingUtilizationOfUnsecuredLines, age, DebtRatio, MonthlyIncome, NumberOfOpenCreditLinesAndLoans.
This aims at the paper's 92 but could not be checked here (the file is absent), so a different count
on the real file is a warning, not an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from vertical.datasets.base import Dataset, DatasetSpec, check_row_count, seeded_split
from vertical.datasets.csv_table import CsvTable, read_csv
from vertical.datasets.validation import DataValidationError, binary_labels_to_pm1, check_finite_features

UCI_HEADER = ("ID", *(f"X{j}" for j in range(1, 24)), "Y")
KAGGLE_UCI_HEADER = (
    "ID", "LIMIT_BAL", "SEX", "EDUCATION", "MARRIAGE", "AGE",
    "PAY_0", "PAY_2", "PAY_3", "PAY_4", "PAY_5", "PAY_6",
    *(f"BILL_AMT{j}" for j in range(1, 7)), *(f"PAY_AMT{j}" for j in range(1, 7)),
    "default.payment.next.month",
)
UCI_CATEGORICAL = (2, 3, 4, 6, 7, 8, 9, 10, 11)  # positions of X2, X3, X4, X6..X11 in the header

GMSC_LABEL = "SeriousDlqin2yrs"
GMSC_FEATURES = (
    "RevolvingUtilizationOfUnsecuredLines", "age", "NumberOfTime30-59DaysPastDueNotWorse", "DebtRatio",
    "MonthlyIncome", "NumberOfOpenCreditLinesAndLoans", "NumberOfTimes90DaysLate",
    "NumberRealEstateLoansOrLines", "NumberOfTime60-89DaysPastDueNotWorse", "NumberOfDependents",
)
GMSC_CATEGORICAL = frozenset({
    "NumberOfTime30-59DaysPastDueNotWorse", "NumberOfTimes90DaysLate", "NumberOfTime60-89DaysPastDueNotWorse",
    "NumberRealEstateLoansOrLines", "NumberOfDependents",
})


def encode_columns(values: np.ndarray, names: Sequence[str], categorical: Sequence[bool],
                   train_rows: np.ndarray) -> tuple[np.ndarray, tuple[str, ...]]:
    """One-hot the categorical columns and standardise the numeric ones (rule in the module docstring).

    Returns the dense float64 feature matrix for all rows and one name per output column.
    """
    blocks, out_names = [], []
    for column, name, is_categorical in zip(values.T, names, categorical, strict=True):
        if is_categorical:
            levels, codes = np.unique(column, return_inverse=True)
            if levels.size == 2:
                blocks.append((codes == 1).astype(np.float64)[:, None])
                out_names.append(f"{name}=={levels[1]:g}")
            else:
                blocks.append(np.eye(levels.size)[codes])
                out_names.extend(f"{name}=={level:g}" for level in levels)
        else:
            mean, std = column[train_rows].mean(), column[train_rows].std()
            blocks.append(((column - mean) / (std if std > 0 else 1.0))[:, None])
            out_names.append(name)
    return np.hstack(blocks), tuple(out_names)


def _tabular_dataset(spec: DatasetSpec, table: CsvTable, rows: np.ndarray, labels: np.ndarray,
                     features: np.ndarray, names: Sequence[str], categorical: Sequence[bool],
                     seed: int) -> Dataset:
    """Seeded split of the kept ``rows`` of ``table``, then encoding with training statistics."""
    y = binary_labels_to_pm1(labels, table.locate(rows))
    train, test = seeded_split(rows.size, seed)
    X, out_names = encode_columns(features, names, categorical, train)
    return Dataset(spec.name, spec.task, X[train], y[train], X[test], y[test], rows[train], rows[test],
                   seed, out_names)


def load_uci_credit_card(spec: DatasetSpec, paths: list[Path], seed: int) -> Dataset:
    """D1: see the module docstring."""
    table = read_csv(paths[0])
    if table.header not in (UCI_HEADER, KAGGLE_UCI_HEADER):
        raise DataValidationError(
            f"{table.path}: unexpected header {list(table.header)}; expected the UCI columns "
            f"{list(UCI_HEADER)} or the Kaggle columns {list(KAGGLE_UCI_HEADER)}"
        )
    check_row_count(spec, table.path, table.n_rows, spec.n_rows)
    values = table.numeric(list(range(1, len(table.header))))
    check_finite_features(values[:, :-1], table.locate())
    categorical = [j in UCI_CATEGORICAL for j in range(1, 24)]
    return _tabular_dataset(spec, table, np.arange(table.n_rows), values[:, -1], values[:, :-1],
                            table.header[1:-1], categorical, seed)


def load_give_me_some_credit(spec: DatasetSpec, paths: list[Path], seed: int) -> Dataset:
    """D2: see the module docstring."""
    table = read_csv(paths[0])
    check_row_count(spec, table.path, table.n_rows, spec.n_rows)
    columns = [table.column_index(name) for name in (GMSC_LABEL, *GMSC_FEATURES)]
    values = table.numeric(columns, missing_ok=True)
    labels_missing = np.isnan(values[:, 0])
    if labels_missing.any():
        line = table.lines[np.flatnonzero(labels_missing)[0]]
        raise DataValidationError(f"{table.path}, line {line}: missing label {GMSC_LABEL!r}")
    rows = np.flatnonzero(~np.isnan(values).any(axis=1))
    features = values[rows, 1:]
    check_finite_features(features, table.locate(rows))
    categorical = [name in GMSC_CATEGORICAL for name in GMSC_FEATURES]
    return _tabular_dataset(spec, table, rows, values[rows, 0], features, GMSC_FEATURES, categorical, seed)
