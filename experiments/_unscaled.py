"""A generated LIBSVM file whose features are not scaled: the case a constant default step cannot fit.

Each feature is a standard normal times its own scale, the scales spread evenly in log from 1 to
10,000 (``top``), as raw measurements in different units are; the label is the sign of a linear score
of the *standardised* features plus noise, so every feature carries signal whatever its scale. Sparse
(``density`` of the cells), as LIBSVM files usually are. The same seed writes the same file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

ROWS, COLUMNS = 5000, 300


def write_unscaled_libsvm(path: Path, *, rows: int = ROWS, columns: int = COLUMNS, density: float = 0.1,
                          noise: float = 0.5, seed: int = 0, top: float = 1e4) -> Path:
    """Write the file (labels ±1, 1-based indices) and return ``path``."""
    rng = np.random.default_rng(seed)
    scales = np.logspace(0.0, np.log10(top), columns)
    present = rng.random((rows, columns)) < density
    standard = rng.standard_normal((rows, columns)) * present
    w = rng.standard_normal(columns)
    score = standard @ w / np.sqrt(density * columns) + noise * rng.standard_normal(rows)
    labels = np.where(score >= 0, 1, -1)
    values = standard * scales
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for i in range(rows):
            cols = np.flatnonzero(present[i])
            cells = " ".join(f"{j + 1}:{values[i, j]:.6g}" for j in cols)
            fh.write(f"{labels[i]} {cells}\n")
    return path
