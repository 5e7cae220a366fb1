"""Write two organisations' CSV files for the README walk-through: a clinic and a lab.

Made from scikit-learn's bundled Wisconsin breast-cancer data (569 real patients, 30 features), so
it runs offline. The clinic holds the first 15 features and the diagnosis (``label``: 1 benign,
0 malignant); the lab holds the other 15 and no label. Each knows some patients the other does not
(their id sets overlap, they are not equal) and lists them in its own order, as two real
organisations would. Both files carry a ``split`` column, a hold-out the two agreed on by id (ids
divisible by 5 are test rows), so the trained model gets a test accuracy. Features are standardised.

    python examples/hospital_csvs.py --out mine/
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np
from sklearn.datasets import load_breast_cancer

#: Patients only the clinic knows, and patients only the lab knows.
CLINIC_ONLY, LAB_ONLY = 30, 40


def write(path: Path, ids: np.ndarray, names: list[str], X: np.ndarray, y: np.ndarray | None) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", *names, *(["label"] if y is not None else []), "split"])
        for k, ident in enumerate(ids):
            label = [int(y[k])] if y is not None else []
            writer.writerow([int(ident), *(f"{v:.5g}" for v in X[k]), *label,
                             "test" if ident % 5 == 0 else "train"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for clinic.csv and lab.csv")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    bunch = load_breast_cancer()
    X = (bunch.data - bunch.data.mean(axis=0)) / bunch.data.std(axis=0)
    names = [str(n).replace(" ", "_") for n in bunch.feature_names]
    rng = np.random.default_rng(args.seed)
    n = X.shape[0]
    ids = rng.choice(np.arange(100_000, 1_000_000), size=n, replace=False)   # customer numbers
    order = rng.permutation(n)
    clinic_rows = np.sort(order[LAB_ONLY:])                   # all but the lab's own patients
    lab_rows = np.sort(order[:-CLINIC_ONLY])                  # all but the clinic's own patients
    args.out.mkdir(parents=True, exist_ok=True)
    half = X.shape[1] // 2
    clinic = rng.permutation(clinic_rows)
    write(args.out / "clinic.csv", ids[clinic], names[:half], X[clinic, :half], bunch.target[clinic])
    lab = rng.permutation(lab_rows)
    write(args.out / "lab.csv", ids[lab], names[half:], X[lab, half:], None)
    print(f"{args.out / 'clinic.csv'}: {clinic.size} patients, {half} features and the label; "
          f"{args.out / 'lab.csv'}: {lab.size} patients, {X.shape[1] - half} features; "
          f"{n - CLINIC_ONLY - LAB_ONLY} patients in both")


if __name__ == "__main__":
    main()
