"""Per-party files: split -> files -> load -> re-assemble is lossless; every validation rule fires."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from vertical.datasets import Dataset, DataValidationError, load
from vertical.datasets.party_files import (
    PartyData,
    assemble_features,
    check_aligned,
    load_party_file,
    read_manifest,
    split_to_party_files,
)
from vertical.partition import contiguous_blocks, random_blocks


def sparse_dataset(n_train: int = 40, n_test: int = 10, n_features: int = 17) -> Dataset:
    rng = np.random.default_rng(1)
    X = sp.random(n_train + n_test, n_features, density=0.3, format="csr", random_state=2)
    X = sp.vstack([X[:-1], sp.csr_matrix((1, n_features))], format="csr")  # an all-zero row is valid
    y = rng.choice([-1.0, 1.0], size=n_train + n_test)
    ids = rng.permutation(1_000)[: n_train + n_test]
    return Dataset("toy", "binary", X[:n_train], y[:n_train], X[n_train:], y[n_train:], ids[:n_train],
                   ids[n_train:], seed=4)


def split_and_load(ds: Dataset, folder: Path, active: list[int], q: int = 2) -> list[PartyData]:
    return [load_party_file(p) for p in split_to_party_files(ds, contiguous_blocks(ds.n_features, q), active,
                                                              folder)]


def test_round_trip_sparse_keeps_csr_and_reassembles_exactly(tmp_path: Path) -> None:
    ds = sparse_dataset()
    blocks = random_blocks(ds.n_features, 3, seed=7)
    paths = split_to_party_files(ds, blocks, active=[1], out_dir=tmp_path, partition_seed=7)
    assert [p.name for p in paths] == ["party-0.npz", "party-1.npz", "party-2.npz"]
    parties = [load_party_file(p, expect_labels=(i == 1)) for i, p in enumerate(paths)]
    for party, block in zip(parties, blocks, strict=True):
        assert sp.isspmatrix_csr(party.X_train) and np.array_equal(party.columns, block)
        assert party.dataset == "toy" and party.task == "binary" and party.n_features_total == 17
    check_aligned(parties)
    X_train, X_test = assemble_features(parties)
    assert sp.isspmatrix_csr(X_train)
    assert (X_train != ds.X_train).nnz == 0 and (X_test != ds.X_test).nnz == 0
    assert np.array_equal(parties[1].y_train, ds.y_train) and np.array_equal(parties[1].y_test, ds.y_test)
    assert np.array_equal(parties[0].train_ids, ds.train_ids)


def test_round_trip_dense_real_data(tmp_path: Path) -> None:
    ds = load("breast-cancer", seed=3)
    paths = split_to_party_files(ds, contiguous_blocks(ds.n_features, 4), active=[0, 2], out_dir=tmp_path)
    parties = [load_party_file(p) for p in paths]
    X_train, X_test = assemble_features(parties)
    assert isinstance(X_train, np.ndarray)
    assert np.array_equal(X_train, ds.X_train) and np.array_equal(X_test, ds.X_test)
    assert [p.has_labels for p in parties] == [True, False, True, False]


def test_labels_only_in_active_files_and_manifest_has_no_features(tmp_path: Path) -> None:
    ds = sparse_dataset()
    paths = split_to_party_files(ds, contiguous_blocks(17, 3), active=[2], out_dir=tmp_path, partition_seed=9)
    for i, path in enumerate(paths):
        with np.load(path) as arrays:
            assert ("y_train" in arrays) == (i == 2) and ("y_test" in arrays) == (i == 2)
    manifest = read_manifest(tmp_path)
    assert (manifest.q, manifest.active, manifest.n_train, manifest.n_test) == (3, (2,), 40, 10)
    assert (manifest.task, manifest.dataset) == ("binary", "toy")
    assert (manifest.split_seed, manifest.partition_seed) == (4, 9)
    assert manifest.block_sizes == (6, 6, 5)
    raw = json.loads((tmp_path / "manifest.json").read_text())
    assert not {"X_train", "columns", "y_train"} & set(raw)


def test_split_refuses_to_overwrite_and_bad_arguments(tmp_path: Path) -> None:
    ds = sparse_dataset()
    split_to_party_files(ds, contiguous_blocks(17, 2), active=[0], out_dir=tmp_path)
    with pytest.raises(FileExistsError, match="already holds a split"):
        split_to_party_files(ds, contiguous_blocks(17, 2), active=[0], out_dir=tmp_path)
    paths = split_to_party_files(ds, contiguous_blocks(17, 3), active=[0], out_dir=tmp_path, overwrite=True)
    assert sorted(tmp_path.glob("party-*.npz")) == paths
    with pytest.raises(ValueError, match=r"distinct indices in 0\.\.1"):
        split_to_party_files(ds, contiguous_blocks(17, 2), active=[2], out_dir=tmp_path / "x")
    with pytest.raises(ValueError, match="at least one party must be active"):
        split_to_party_files(ds, contiguous_blocks(17, 2), active=[], out_dir=tmp_path / "x")
    with pytest.raises(ValueError, match="held by no party"):
        split_to_party_files(ds, [[0, 1], [2]], active=[0], out_dir=tmp_path / "x")


def test_passive_file_with_labels_and_active_file_without(tmp_path: Path) -> None:
    paths = split_to_party_files(sparse_dataset(), contiguous_blocks(17, 2), active=[0], out_dir=tmp_path)
    with pytest.raises(DataValidationError, match=r"party-0\.npz: the file contains labels, but this party"):
        load_party_file(paths[0], expect_labels=False)
    with pytest.raises(DataValidationError, match=r"party-1\.npz: the file has no labels, but an active"):
        load_party_file(paths[1], expect_labels=True)


def test_nan_feature_in_a_party_file_names_file_row_and_id(tmp_path: Path) -> None:
    ds = sparse_dataset()
    X_train = ds.X_train.copy()
    X_train.data[X_train.indptr[5]] = np.nan
    bad = Dataset("toy", "binary", X_train, ds.y_train, ds.X_test, ds.y_test, ds.train_ids, ds.test_ids, 4)
    column = int(X_train.indices[X_train.indptr[5]])
    paths = split_to_party_files(bad, [[column], [c for c in range(17) if c != column]], [1], tmp_path)
    with pytest.raises(DataValidationError, match=rf"party-0\.npz \(train\), row 5 \(id {ds.train_ids[5]}\)"):
        load_party_file(paths[0])


def test_misaligned_party_files(tmp_path: Path) -> None:
    ds = sparse_dataset()
    parties = split_and_load(ds, tmp_path, [0])
    shuffled_ids = ds.train_ids.copy()
    shuffled_ids[[3, 4]] = shuffled_ids[[4, 3]]
    other = Dataset("toy", "binary", ds.X_train, ds.y_train, ds.X_test, ds.y_test, shuffled_ids,
                    ds.test_ids, 4)
    moved = split_and_load(other, tmp_path / "b", [0])
    expected = rf"train row 3: .*party-0\.npz has sample id {ds.train_ids[3]}"
    with pytest.raises(DataValidationError, match=expected):
        check_aligned([parties[0], moved[1]])
    fewer = Dataset("toy", "binary", ds.X_train[:-1], ds.y_train[:-1], ds.X_test, ds.y_test,
                    ds.train_ids[:-1], ds.test_ids, 4)
    short = split_and_load(fewer, tmp_path / "c", [0])
    with pytest.raises(DataValidationError, match=r"party-1\.npz has 39 train rows but .*has 40"):
        check_aligned([parties[0], short[1]])


def test_active_parties_must_agree_on_labels_and_columns_must_not_overlap(tmp_path: Path) -> None:
    ds = sparse_dataset()
    first = split_and_load(ds, tmp_path, [0, 1])
    flipped = Dataset("toy", "binary", ds.X_train, -ds.y_train, ds.X_test, ds.y_test, ds.train_ids,
                      ds.test_ids, 4)
    second = split_and_load(flipped, tmp_path / "b", [0, 1])
    with pytest.raises(DataValidationError, match=r"train row 0 .*the labels of .* differ"):
        check_aligned([first[0], second[1]])
    copy = split_and_load(ds, tmp_path / "c", [0])
    with pytest.raises(DataValidationError, match="column 0 is held by both"):
        check_aligned([first[0], copy[0]])


# ---------------------------------------------------------------- CSV party files

CSV_ACTIVE = "id,age,income,label,split\n10,1.5,2,1,train\n11,2.5,3,0,train\n12,3.5,4,1,test\n"


def write_csv(tmp_path: Path, text: str, name: str = "bank.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_csv_party_file_layout(tmp_path: Path) -> None:
    party = load_party_file(write_csv(tmp_path, CSV_ACTIVE), expect_labels=True, task="binary")
    assert party.feature_names == ("age", "income") and party.columns is None
    assert party.X_train.tolist() == [[1.5, 2.0], [2.5, 3.0]] and party.X_test.tolist() == [[3.5, 4.0]]
    assert party.y_train.tolist() == [1.0, -1.0] and party.y_test.tolist() == [1.0]
    assert party.train_ids.tolist() == [10, 11] and party.test_ids.tolist() == [12]
    passive = load_party_file(write_csv(tmp_path, "id,x\n10,0\n11,1\n", "p.csv"), expect_labels=False)
    assert passive.X_train.shape == (2, 1) and passive.X_test.shape == (0, 1) and not passive.has_labels
    only_train = load_party_file(write_csv(tmp_path, "id,a,label\n10,1,1\n11,2,-1\n", "q.csv"), task="binary")
    check_aligned([only_train, passive])


@pytest.mark.parametrize(("text", "message"), [
    (CSV_ACTIVE.replace("11,2.5,3,0", "11,2.5,3,2"), r"bank\.csv, line 3: label 2\.0 is not valid for a bin"),
    (CSV_ACTIVE.replace("11,2.5,3,0", "11,2.5,3,NA"), r"bank\.csv, line 3: label nan is not valid"),
    (CSV_ACTIVE.replace("11,2.5,3,0", "11,nan,3,0"), r"bank\.csv, line 3: column 'age' holds 'nan'"),
    (CSV_ACTIVE.replace("11,2.5,3,0", "11,2.5,inf,0"), r"bank\.csv, line 3: column 'income' holds 'inf'"),
    (CSV_ACTIVE.replace("11,2.5,3,0", "11,,3,0"), r"bank\.csv, line 3: missing value in column 'age'"),
    (CSV_ACTIVE.replace("11,2.5,3,0", "11,2.5,abc,0"), r"bank\.csv, line 3: column 'income' holds 'abc'"),
    (CSV_ACTIVE.replace("11,2.5,3,0,train\n", "\n"), r"bank\.csv, line 3: the line is blank"),
    (CSV_ACTIVE.replace("11,2.5,3,0,train", "11,2.5,3"), r"bank\.csv, line 3: the line has 3 fields"),
    (CSV_ACTIVE.replace("11,2.5,3,0,train", "11.5,2.5,3,0,train"), r"bank\.csv, line 3: id 11\.5 is not an"),
    (CSV_ACTIVE.replace("11,2.5,3,0,train", "10,2.5,3,0,train"), r"bank\.csv: sample id 10 appears more"),
    (CSV_ACTIVE.replace("0,train", "0,valid"), r"bank\.csv, line 3: split 'valid' is not 'train' or 'test'"),
    (CSV_ACTIVE.replace("id,", "key,"), r"bank\.csv: no column named 'id'"),
    ("", r"bank\.csv: the file is empty"),
])
def test_csv_validation_rules(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(DataValidationError, match=message):
        load_party_file(write_csv(tmp_path, text), task="binary")


def test_csv_labels_need_a_task_and_are_checked_per_task(tmp_path: Path) -> None:
    path = write_csv(tmp_path, CSV_ACTIVE)
    with pytest.raises(DataValidationError, match="has a label column; pass task="):
        load_party_file(path)
    regression = load_party_file(path, task="regression")
    assert regression.y_train.tolist() == [1.0, 0.0]
    with pytest.raises(DataValidationError, match=r"line 2: class label -1"):
        load_party_file(write_csv(tmp_path, "id,a,label\n1,0,-1\n", "m.csv"), task="multiclass")
    with pytest.raises(DataValidationError, match="is for a binary task, regression was expected"):
        paths = split_to_party_files(sparse_dataset(), contiguous_blocks(17, 2), [0], tmp_path / "npz")
        load_party_file(paths[0], task="regression")


def test_csv_party_aligned_with_npz_party(tmp_path: Path) -> None:
    ds = sparse_dataset(n_train=3, n_test=1, n_features=4)
    npz = load_party_file(split_to_party_files(ds, contiguous_blocks(4, 2), [0], tmp_path)[1])
    rows = [f"{i},{v},{s}" for i, v, s in zip([*ds.train_ids, *ds.test_ids], range(4),
                                               ["train"] * 3 + ["test"], strict=True)]
    csv = load_party_file(write_csv(tmp_path, "\n".join(["id,x,split", *rows]) + "\n"), expect_labels=False)
    check_aligned([npz, csv])
    reordered = write_csv(tmp_path, "\n".join(["id,x,split", rows[1], rows[0], *rows[2:]]) + "\n", "r.csv")
    with pytest.raises(DataValidationError, match=r"train row 0: .*rows are not aligned"):
        check_aligned([npz, load_party_file(reordered)])


def _tampered(tmp_path: Path, **changes: np.ndarray) -> Path:
    """A valid sparse party file with some of its arrays replaced (as an untrusted peer could)."""
    path, _ = split_to_party_files(sparse_dataset(), contiguous_blocks(17, 2), [0], tmp_path / "good",
                                   overwrite=True)
    with np.load(path, allow_pickle=False) as z:
        arrays = {key: z[key] for key in z.files}
    arrays.update(changes)
    bad = tmp_path / "party-0.npz"
    np.savez(bad, **arrays)
    return bad


@pytest.mark.parametrize("name, make", [
    ("decreasing", lambda p: np.concatenate([[0], p[1:-1][::-1], p[-1:]])),
    ("out of range", lambda p: np.concatenate([p[:-1], [p[-1] + 10**6]])),
    ("huge pointer", lambda p: np.concatenate([[0], np.full(p.size - 2, 2**40), p[-1:]])),
    ("wrong length", lambda p: p[:-3]),
    ("floats", lambda p: p.astype(np.float64)),
    ("two-d", lambda p: p.reshape(1, -1)),
])
def test_a_party_file_with_a_bad_indptr_is_one_line_naming_the_file(tmp_path: Path, name, make) -> None:
    with np.load(_tampered(tmp_path)) as z:
        indptr = z["X_train_indptr"]
    bad = _tampered(tmp_path, X_train_indptr=make(indptr))
    with pytest.raises(DataValidationError, match=r"party-0\.npz \(X_train\)") as caught:
        load_party_file(bad)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("change", [
    {"X_train_indices": np.full(1, 10**9, dtype=np.int64)},
    {"X_train_shape": np.array([40, 2**40])},
    {"X_train_shape": np.array([-1, 3])},
    {"X_train_data": np.array(["a"])},
])
def test_bad_indices_and_dtypes_are_refused(tmp_path: Path, change) -> None:
    good = _tampered(tmp_path)
    with np.load(good) as z:
        indices = z["X_train_indices"].copy()
    if "X_train_indices" in change:  # the right length, one index far past the block's width
        indices[0] = change["X_train_indices"][0]
        change = {"X_train_indices": indices}
    with pytest.raises(DataValidationError, match=r"party-0\.npz"):
        load_party_file(_tampered(tmp_path, **change))


def test_vfl_train_on_a_tampered_party_file_is_one_line(tmp_path: Path, capsys) -> None:
    from vfl.cli import main

    folder = tmp_path / "parts"
    split_to_party_files(sparse_dataset(), contiguous_blocks(17, 3), [0], folder)
    with np.load(folder / "party-1.npz") as z:
        arrays = {key: z[key] for key in z.files}
    arrays["X_train_indptr"] = arrays["X_train_indptr"][::-1].copy()
    np.savez(folder / "party-1.npz", **arrays)
    code = main(["train", "--party-files", str(folder), "-n", "3", "-m", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and err.startswith("vfl train: error: ")
    assert "party-1.npz (X_train)" in err
