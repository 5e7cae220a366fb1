"""``vfl party --data`` takes what ``vfl train --party-files`` takes: besides a ``party-<p>/`` folder or
``.npz`` of ``vfl split``, a party's CSV file (``id``, ``label`` at an active party, ``split``, features),
or the folder of ``vfl align`` that holds its ``party-<p>.csv``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from parties.loading import own_party_file, read_own_party
from tests.conftest import REPO_ROOT
from tests.test_federation import free_port, make_orgs, run_parties, write_jobs
from vertical.datasets import load_party_file
from vertical.datasets.validation import DataValidationError


def write_party_csv(path, party) -> None:
    """A party file as the CSV an organisation would bring (exact: floats written with repr)."""
    rows = []
    labelled = party.has_labels
    header = ["id", *(["label"] if labelled else []), "split", *(f"f{c}" for c in party.columns.tolist())]
    for part, X, ids, y in (("train", party.X_train, party.train_ids, party.y_train),
                            ("test", party.X_test, party.test_ids, party.y_test)):
        dense = X.toarray() if hasattr(X, "toarray") else np.asarray(X)
        for k in range(dense.shape[0]):
            label = [repr(int(y[k] > 0))] if labelled else []
            rows.append(",".join([str(ids[k]), *label, part, *(repr(float(v)) for v in dense[k])]))
    path.write_text(",".join(header) + "\n" + "\n".join(rows) + "\n")


@pytest.fixture(scope="module")
def csv_split(tmp_path_factory):
    """breast-cancer for three parties, as vfl split's folders and as party-<p>.csv files."""
    from vfl.cli import main

    folder = tmp_path_factory.mktemp("csv-split")
    assert main(["split", "breast-cancer", "-n", "3", "-m", "1", "--out", str(folder / "bin")]) == 0
    (folder / "csv").mkdir()
    for p in range(3):
        write_party_csv(folder / "csv" / f"party-{p}.csv", load_party_file(folder / "bin" / f"party-{p}"))
    return folder


def test_a_party_csv_reads_as_the_same_rows_as_its_binary_file(csv_split, tmp_path):
    for p in range(3):
        binary = load_party_file(csv_split / "bin" / f"party-{p}")
        as_csv = read_own_party(own_party_file(csv_split / "csv" / f"party-{p}.csv", p), p == 0, "logistic")
        from_folder = own_party_file(csv_split / "csv", p)   # vfl align's folder: this party's file in it
        assert from_folder == csv_split / "csv" / f"party-{p}.csv"
        np.testing.assert_array_equal(as_csv.train_ids, binary.train_ids)
        np.testing.assert_array_equal(as_csv.test_ids, binary.test_ids)
        dense = binary.X_train.toarray() if hasattr(binary.X_train, "toarray") else binary.X_train
        np.testing.assert_array_equal(np.asarray(as_csv.X_train), dense)
        if p == 0:
            np.testing.assert_array_equal(as_csv.y_train, binary.y_train)
    empty = tmp_path / "party-1.csv"
    empty.write_text("id,split\n1,train\n")
    with pytest.raises(DataValidationError, match="no feature columns"):
        read_own_party(empty, False, "logistic")


@pytest.mark.mpi
def test_three_organisations_train_from_their_csv_files_as_vfl_train_does(csv_split, tmp_path):
    orgs = make_orgs(tmp_path, csv_split / "bin")
    for org in orgs:   # each brings its CSV; bank-b as vfl align left it, a folder with its party-1.csv
        shutil.rmtree(org.data)
        if org.rank == 1:
            org.data.mkdir()
            shutil.copy(csv_split / "csv" / "party-1.csv", org.data / "party-1.csv")
        else:
            org.data = org.root / f"party-{org.rank}.csv"
            shutil.copy(csv_split / "csv" / org.data.name, org.data)
    write_jobs(orgs, f"127.0.0.1:{free_port()}", **{o.name: {"epochs": 1} for o in orgs})
    results = run_parties([org.command("--join-timeout", "60") for org in orgs], timeout=240)
    for org, result in zip(orgs, results, strict=True):
        assert result.returncode == 0, f"{org.name}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"

    out = tmp_path / "one-mpiexec"
    cmd = [sys.executable, "-m", "vfl.cli", "train", "-n", "3", "-m", "1",
           "--party-files", str(csv_split / "csv"), "--algorithm", "sgd", "--mode", "sync-global",
           "--epochs", "1", "-B", "8", "--seed", "0",
           "--secure-channels", "--no-reference", "--no-progress", "--out", str(out)]
    one = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    expected = json.loads((out / "result.json").read_text())
    got = json.loads((orgs[0].run / "result.json").read_text())
    assert got["updates"] == expected["updates"]
    assert got["record"]["loss"] == pytest.approx(expected["record"]["loss"], rel=1e-9)
    assert got["record"]["test_accuracy"] == expected["record"]["test_accuracy"] > 0.85
