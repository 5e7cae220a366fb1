"""``--party-files`` with a folder of ``party-<p>.csv`` files: validated and converted once, before
``mpiexec``, into binary party files in the run folder, which training then reads (issue 17)."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_breast_cancer

from vertical.datasets import load_party_file
from vertical.datasets.csv_parties import csv_parties_to_party_files, load_csv_parties
from vfl import VerticalLogisticRegression
from vfl.cli import main

ACTIVE = "id,age,income,label,split\n10,1.5,2,1,train\n11,2.5,3,0,train\n12,3.5,4,1,test\n13,0.5,1,0,train\n"
PASSIVE = "id,visits,split\n10,7,train\n11,8,train\n12,9,test\n13,6,train\n"
TRAIN = ["-n", "2", "-m", "1", "--allow-two-parties", "--epochs", "1"]


def write_folder(folder, *texts: str):
    folder.mkdir(parents=True, exist_ok=True)
    for p, text in enumerate(texts):
        (folder / f"party-{p}.csv").write_text(text)
    return folder


def test_a_csv_folder_becomes_binary_party_files_with_the_same_rows(tmp_path):
    folder = write_folder(tmp_path / "csv", ACTIVE, PASSIVE)
    parties = load_csv_parties(folder, 2, 1, "binary")
    paths = csv_parties_to_party_files(parties, 1, tmp_path / "bin", name="csv")
    active, passive = (load_party_file(path) for path in paths)
    assert active.has_labels and not passive.has_labels
    np.testing.assert_array_equal(active.train_ids, [10, 11, 13])
    np.testing.assert_array_equal(passive.test_ids, [12])
    np.testing.assert_array_equal(active.y_train, [1.0, -1.0, -1.0])        # 0/1 labels become ±1
    np.testing.assert_array_equal(active.X_train, [[1.5, 2], [2.5, 3], [0.5, 1]])
    np.testing.assert_array_equal(passive.X_test, [[9]])
    assert active.columns.tolist() == [0, 1] and passive.columns.tolist() == [2]
    assert active.feature_names == ("age", "income") and passive.feature_names == ("visits",)
    assert all(path.is_dir() for path in paths)  # memory-mappable folders, not .npz copies


def test_vfl_split_takes_one_labelled_csv_file(tmp_path, capsys):
    """A user's own single CSV (id, label, features; no split column) splits into party folders with
    a seeded 80/20 split, labels only at the active party; a broken line is one error naming it."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(50, 5))
    lines = ["id,label,a,b,c,d,e"] + [f"{100 + i},{i % 2}," + ",".join(f"{v:.3f}" for v in X[i])
                                       for i in range(50)]
    source = tmp_path / "customers.csv"
    source.write_text("\n".join(lines) + "\n")
    assert main(["split", str(source), "-n", "3", "-m", "1", "--out", str(tmp_path / "parts")]) == 0
    parties = [load_party_file(tmp_path / "parts" / f"party-{p}") for p in range(3)]
    assert [p.has_labels for p in parties] == [True, False, False]
    assert sum(p.n_features for p in parties) == 5
    assert parties[0].X_train.shape[0] == 40 and parties[0].X_test.shape[0] == 10
    np.testing.assert_array_equal(np.sort(np.concatenate([parties[1].train_ids, parties[1].test_ids])),
                                  np.arange(100, 150))
    source.write_text("\n".join([*lines[:10], "105,1,1.0", *lines[10:]]) + "\n")
    assert main(["split", str(source), "-n", "3", "--out", str(tmp_path / "parts2")]) == 2
    assert "customers.csv, line 11" in capsys.readouterr().err


@pytest.mark.parametrize("texts, fragments", [
    ((ACTIVE, PASSIVE.replace("11,8,", "11,nan,")),
     ["party-1.csv, line 3", "column 'visits' holds 'nan', which is not a finite number"]),
    ((ACTIVE, PASSIVE.replace("11,8,", "11,-Infinity,")),
     ["party-1.csv, line 3", "column 'visits' holds '-Infinity', which is not a finite number"]),
    ((ACTIVE, PASSIVE.replace("id,visits,split", "id,visits,label,split").replace(",train", ",1,train")
      .replace(",test", ",0,test")), ["party-1.csv", "contains labels", "passive"]),
    ((PASSIVE, PASSIVE), ["party-0.csv", "no labels"]),
    ((ACTIVE, PASSIVE.replace("11,8", "14,8")), ["not aligned", "id 11", "id 14"]),
    ((ACTIVE, PASSIVE.replace(",split", "").replace(",train", "").replace(",test", "")),
     ["party-0.csv has test rows", "party-1.csv has none"]),
    ((ACTIVE, "id,visits,split\n"), ["party-1.csv: no training rows"]),
    ((ACTIVE, "id,split\n10,train\n11,train\n12,test\n13,train\n"), ["party-1.csv: no feature columns"]),
    ((ACTIVE,), ["missing party-1.csv"]),
    ((ACTIVE.replace("2.5,3", "2.5," + "9" * ((128 << 10) + 1)), PASSIVE),
     ["party-0.csv, line 3", "field larger than field limit"]),
])
def test_bad_csv_folders_are_one_line_errors_before_mpiexec(tmp_path, capsys, texts, fragments):
    folder = write_folder(tmp_path / "csv", *texts)
    run = tmp_path / "run"
    assert main(["train", "--party-files", str(folder), *TRAIN, "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"vfl train: error: --party-files {folder}")
    for fragment in fragments:
        assert fragment in err
    assert not run.exists()   # refused before any folder was made or any rank started


@pytest.mark.mpi
def test_a_csv_folder_without_test_rows_trains_and_says_it_has_no_test_metric(tmp_path, capfd):
    drop_split = {",split": "", ",train": "", ",test": ""}
    texts = [ACTIVE, PASSIVE]
    for old, new in drop_split.items():
        texts = [t.replace(old, new) for t in texts]
    folder = write_folder(tmp_path / "csv", *texts)
    assert main(["train", "--party-files", str(folder), *TRAIN, "--out", str(tmp_path / "run")]) == 0
    assert "the data hold no test rows" in capfd.readouterr().out


@pytest.mark.mpi
def test_the_estimator_trains_on_a_csv_folder_and_leaves_no_temporary_folder(tmp_path, monkeypatch):
    """Any shape: three parties of 7, 11 and 12 columns of breast-cancer, rows in file order."""
    X, y = load_breast_cancer(return_X_y=True)
    X = (X - X.mean(axis=0)) / X.std(axis=0)
    ids = np.arange(1000, 1000 + X.shape[0])
    split = np.where(ids % 5 == 0, "test", "train")
    folder = tmp_path / "csv"
    folder.mkdir()
    for p, (a, b) in enumerate(((0, 7), (7, 18), (18, 30))):
        header = ["id", *(f"f{j}" for j in range(a, b)), *(["label"] if p == 0 else []), "split"]
        lines = [",".join(header)]
        for k in range(X.shape[0]):
            label = [str(y[k])] if p == 0 else []
            lines.append(",".join([str(ids[k]), *(f"{v:.6g}" for v in X[k, a:b]), *label, split[k]]))
        (folder / f"party-{p}.csv").write_text("\n".join(lines) + "\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    model = VerticalLogisticRegression(parties=3, active=1, lam=1e-2, epochs=4).fit(folder)
    assert [w.size for w in model.coef_blocks_] == [7, 11, 12]
    test = split == "test"
    assert model.score(X[test], np.where(y[test] == 1, 1.0, -1.0)) > 0.9
    assert model.history_[-1]["test_accuracy"] > 0.9
    assert model.run_dir_ is None and list(scratch.iterdir()) == []   # nobody asked to keep the run


def test_vfl_reference_pools_party_files_held_on_one_machine(tmp_path, capsys):
    """The NonF reference of a folder of party files equals the registered dataset's (a split), and a
    CSV folder (with -n, -m) gets one too: `vfl reference` used to know only dataset names."""
    def f_star(argv: list[str]) -> str:
        assert main(["reference", "--lam", "1e-2", *argv]) == 0
        return next(line.split()[2] for line in capsys.readouterr().out.splitlines() if "f* =" in line)

    assert main(["split", "breast-cancer", "-n", "3", "-m", "1", "--out", str(tmp_path / "split")]) == 0
    capsys.readouterr()
    assert f_star(["--party-files", str(tmp_path / "split")]) == f_star(["--dataset", "breast-cancer"])
    folder = write_folder(tmp_path / "csv", ACTIVE, PASSIVE)
    assert float(f_star(["--party-files", str(folder), "-n", "2", "-m", "1"])) > 0
    assert main(["reference", "--party-files", str(folder)]) == 2
    assert "needs -n" in capsys.readouterr().err
