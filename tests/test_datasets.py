"""The dataset registry, file lookup, LIBSVM and credit-card loaders, splits, and the real files."""

from __future__ import annotations

import bz2
import dataclasses
import gzip
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from tests.conftest import requires_dataset
from vertical.datasets import (
    DatasetNotFoundError,
    DataValidationError,
    data_dir_candidates,
    get_spec,
    list_datasets,
    load,
    seeded_split,
)
from vertical.datasets.credit import GMSC_FEATURES, GMSC_LABEL, load_give_me_some_credit, load_uci_credit_card
from vertical.datasets.paths import DATA_DIR_ENV, candidate_paths

REQUIRED_NAMES = {
    "a9a": (), "w8a": (), "credit-card": ("d1", "uci-credit-card"), "give-me-some-credit": ("d2",),
    "news20": ("d3",), "webspam": ("d4",), "e2006-tfidf": ("d5",), "yearpredictionmsd": ("d6",),
    "rcv1": (), "real-sim": (), "covtype": (), "fashion-mnist": (), "mnist": (), "breast-cancer": (),
    "diabetes": (), "digits": (), "news20-standin": ("d3-standin",), "webspam-standin": ("d4-standin",),
}


# ---------------------------------------------------------------- registry and lookup


def test_every_required_name_and_alias_is_registered() -> None:
    for name, aliases in REQUIRED_NAMES.items():
        for key in (name, *aliases, name.upper()):
            assert get_spec(key).name == name
    assert get_spec("d5").n_test_rows is not None and get_spec("d6").task == "regression"
    assert get_spec("digits").task == "multiclass"


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown dataset 'mnits'.*a9a.*d1.*news20"):
        get_spec("mnits")


def test_absent_dataset_says_which_file_where_and_how(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    with pytest.raises(DatasetNotFoundError) as caught:
        load("d3")
    message = str(caught.value)
    assert isinstance(caught.value, FileNotFoundError)
    assert "'news20.binary'" in message
    for suffix in ("", ".bz2", ".gz"):
        assert f"{tmp_path / 'news20.binary'}{suffix}\n" in message + "\n"
    assert DATA_DIR_ENV in message


def test_data_dir_resolution_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    default = data_dir_candidates()
    assert default[-1] == tmp_path / "cache" / "vfl"
    shared = Path(__file__).resolve().parents[1].parent / "shared" / "data"
    assert (shared in default) == shared.is_dir()
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "mine"))
    assert data_dir_candidates() == [tmp_path / "mine"]
    assert data_dir_candidates(tmp_path / "arg") == [tmp_path / "arg"]


def test_system_dirs_are_searched_only_without_an_override(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    system = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
    spec = get_spec("fashion-mnist")
    assert system in candidate_paths(spec.files[0], system_dirs=spec.system_dirs)
    assert system not in candidate_paths(spec.files[0], data_dir=tmp_path, system_dirs=spec.system_dirs)


def test_list_datasets_reports_presence(tmp_path: Path) -> None:
    (tmp_path / "w8a.gz").write_bytes(gzip.compress(b"-1 3:1\n"))
    infos = {info.name: info for info in list_datasets(data_dir=tmp_path)}
    assert set(infos) == set(REQUIRED_NAMES)
    assert infos["w8a"].present and infos["w8a"].where == str(tmp_path)
    assert not infos["a9a"].present and infos["a9a"].where is None
    assert infos["digits"].present and infos["digits"].where == "bundled"
    assert infos["credit-card"].shape == (30_000, 90)
    assert infos["credit-card"].aliases == ("d1", "uci-credit-card")
    assert infos["e2006-tfidf"].split == "given test file" and infos["a9a"].split == "seeded 80%/20%"


def test_seeded_split_is_deterministic_disjoint_and_80_20() -> None:
    train, test = seeded_split(1_000, seed=5)
    again_train, again_test = seeded_split(1_000, seed=5)
    assert np.array_equal(train, again_train) and np.array_equal(test, again_test)
    assert train.size == 800 and test.size == 200
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(1_000))
    assert not np.array_equal(test, seeded_split(1_000, seed=6)[1])


# ---------------------------------------------------------------- LIBSVM


LIBSVM_TEXT = (
    "+1 qid:1 1:0.5 3:2\n"
    "-1 qid:2 2:1\n"
    "-1 qid:3\n"          # a row with no features: valid
    "+1 qid:4 1:1 2:1 3:1 4:-1\n"
    "-1 qid:5 4:3\n"
)


def write_text(path: Path, text: str) -> Path:
    data = text.encode()
    if path.suffix == ".bz2":
        data = bz2.compress(data)
    elif path.suffix == ".gz":
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("suffix", ["", ".bz2", ".gz"])
def test_libsvm_file_through_the_registry(tmp_path: Path, suffix: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    write_text(tmp_path / f"a9a{suffix}", LIBSVM_TEXT)
    monkeypatch.setattr("vertical.datasets.registry._BY_NAME", {
        "a9a": dataclasses.replace(get_spec("a9a"), n_rows=5, n_features=6)})
    ds = load("a9a", seed=1, data_dir=tmp_path)
    assert sp.isspmatrix_csr(ds.X_train) and ds.X_train.dtype == np.float64
    assert ds.n_features == 6 and ds.n_train == 4 and ds.n_test == 1 and ds.seed == 1
    file_order = np.argsort(np.concatenate([ds.train_ids, ds.test_ids]))
    full = sp.vstack([ds.X_train, ds.X_test]).toarray()[file_order]
    expected = np.zeros((5, 6))
    expected[0, [0, 2]] = [0.5, 2]
    expected[1, 1] = 1
    expected[3, :4] = [1, 1, 1, -1]
    expected[4, 3] = 3
    assert np.array_equal(full, expected), "1-based indices, qid ignored, the empty row kept as zeros"
    y = np.concatenate([ds.y_train, ds.y_test])[file_order]
    assert y.tolist() == [1, -1, -1, 1, -1]


def libsvm_spec(**changes: object):
    return dataclasses.replace(get_spec("a9a"), n_rows=5, n_features=6, **changes)


def load_libsvm_text(tmp_path: Path, text: str, **changes: object):
    path = write_text(tmp_path / "data.svm", text)
    spec = libsvm_spec(**changes)
    return spec.loader(spec, [path], 0), path


def test_zero_one_labels_become_plus_minus_one(tmp_path: Path) -> None:
    ds, _ = load_libsvm_text(tmp_path, LIBSVM_TEXT.replace("-1 ", "0 ").replace("+1 ", "1 "))
    assert set(np.concatenate([ds.y_train, ds.y_test]).tolist()) == {-1.0, 1.0}
    assert (np.concatenate([ds.y_train, ds.y_test]) == 1).sum() == 2


def test_label_outside_binary_is_rejected_naming_file_and_row(tmp_path: Path) -> None:
    with pytest.raises(DataValidationError, match=r"data\.svm, row 4: label 2\.0 is not valid for a binary"):
        load_libsvm_text(tmp_path, LIBSVM_TEXT.replace("-1 qid:5", "2 qid:5"))


def test_nan_feature_is_rejected_naming_file_and_row(tmp_path: Path) -> None:
    with pytest.raises(DataValidationError, match=r"data\.svm, row 1: feature column 1 is nan"):
        load_libsvm_text(tmp_path, LIBSVM_TEXT.replace("2:1\n", "2:nan\n"))


def test_truncated_file_is_rejected(tmp_path: Path) -> None:
    truncated = "".join(LIBSVM_TEXT.splitlines(keepends=True)[:4])
    with pytest.raises(DataValidationError, match=r"data\.svm has 4 rows, expected 5 \(truncated"):
        load_libsvm_text(tmp_path, truncated)


def test_feature_index_beyond_the_published_width_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(DataValidationError, match=r"data\.svm, line \d+: feature index 9 is beyond the 6 "):
        load_libsvm_text(tmp_path, LIBSVM_TEXT.replace("4:3", "9:3"))


def test_given_test_file_shares_width_and_gets_later_ids(tmp_path: Path) -> None:
    train = write_text(tmp_path / "r.train", "1.5 1:1\n2.5 2:1\n")
    test = write_text(tmp_path / "r.test", "3.5 5:1\n")
    spec = dataclasses.replace(get_spec("e2006-tfidf"), n_rows=2, n_test_rows=1, n_features=5)
    ds = spec.loader(spec, [train, test], 0)
    assert ds.X_train.shape == (2, 5) and ds.X_test.shape == (1, 5) and ds.seed is None
    assert ds.y_test.tolist() == [3.5] and ds.test_ids.tolist() == [2]


def test_yearprediction_target_is_min_max_normalised(tmp_path: Path) -> None:
    train = write_text(tmp_path / "y", "1990 1:100 2:-4\n2010 1:50 2:2\n2000 1:25 2:1\n")
    test = write_text(tmp_path / "y.t", "2005 1:200 2:1\n")
    spec = dataclasses.replace(get_spec("d6"), n_rows=3, n_test_rows=1, n_features=2)
    ds = spec.loader(spec, [train, test], 0)
    assert ds.y_train.tolist() == [0.0, 1.0, 0.5] and ds.y_test.tolist() == [0.75]
    assert np.allclose(ds.X_train.toarray(), [[1, -1], [0.5, 0.5], [0.25, 0.25]])
    assert np.allclose(ds.X_test.toarray(), [[2, 0.25]])


def test_covtype_labels_one_two_map_to_plus_minus_one(tmp_path: Path) -> None:
    path = write_text(tmp_path / "cov", "1 1:1\n2 2:1\n2 1:3\n1 2:2\n2 1:1\n")
    spec = dataclasses.replace(get_spec("covtype"), n_rows=5, n_features=2)
    ds = spec.loader(spec, [path], 0)
    y = np.concatenate([ds.y_train, ds.y_test])[np.argsort(np.concatenate([ds.train_ids, ds.test_ids]))]
    assert y.tolist() == [-1, 1, 1, -1, 1]


# ---------------------------------------------------------------- credit card (D1) and GiveMeSomeCredit (D2)


def write_uci_csv(path: Path, n_rows: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    columns = [
        np.arange(1, n_rows + 1), rng.integers(1, 50, n_rows) * 10_000, rng.integers(1, 3, n_rows),
        rng.integers(0, 7, n_rows), rng.integers(0, 4, n_rows), rng.integers(21, 70, n_rows),
        *(rng.integers(-2, 9, n_rows) for _ in range(6)),
        *(rng.integers(-1_000, 100_000, n_rows) for _ in range(12)), rng.integers(0, 2, n_rows),
    ]
    table = np.column_stack(columns)
    header = ",".join(["ID", *(f"X{j}" for j in range(1, 24)), "Y"])
    np.savetxt(path, table, fmt="%d", delimiter=",", header=header, comments="")
    return table


def test_uci_credit_card_encoding_rule(tmp_path: Path) -> None:
    table = write_uci_csv(tmp_path / "UCI_Credit_Card.csv", 400)
    spec = dataclasses.replace(get_spec("d1"), n_rows=400)
    ds = load_uci_credit_card(spec, [tmp_path / "UCI_Credit_Card.csv"], 3)
    levels = [np.unique(table[:, j]).size for j in (2, 3, 4, 6, 7, 8, 9, 10, 11)]
    expected_width = 14 + sum(1 if k == 2 else k for k in levels)
    assert ds.n_features == expected_width and ds.n_train == 320
    names = ds.feature_names
    assert names[:3] == ("X1", "X2==2", "X3==0"), "columns keep file order; binary sex is one indicator"
    numeric = [names.index(f"X{j}") for j in (1, 5, *range(12, 24))]
    assert np.allclose(ds.X_train[:, numeric].mean(axis=0), 0)
    assert np.allclose(ds.X_train[:, numeric].std(axis=0), 1)
    one_hot = [j for j in range(ds.n_features) if j not in numeric]
    assert set(np.unique(ds.X_test[:, one_hot])) <= {0.0, 1.0}
    rows = np.concatenate([ds.train_ids, ds.test_ids])
    y = np.concatenate([ds.y_train, ds.y_test])
    assert np.array_equal(y, np.where(table[rows, -1] == 1, 1.0, -1.0))


def test_uci_credit_card_rejects_a_wrong_header_and_a_missing_value(tmp_path: Path) -> None:
    path = tmp_path / "UCI_Credit_Card.csv"
    write_uci_csv(path, 10)
    spec = dataclasses.replace(get_spec("d1"), n_rows=10)
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0].replace("X5", "AGE"), *lines[1:]]) + "\n")
    with pytest.raises(DataValidationError, match="unexpected header"):
        load_uci_credit_card(spec, [path], 0)
    fields = lines[4].split(",")
    fields[5] = ""
    path.write_text("\n".join([*lines[:4], ",".join(fields), *lines[5:]]) + "\n")
    with pytest.raises(DataValidationError, match=r"Card\.csv, line 5: missing value in column 'X5'"):
        load_uci_credit_card(spec, [path], 0)


GMSC_HEADER = ",".join(['""', GMSC_LABEL, *GMSC_FEATURES])


def gmsc_row(i: int, label: int, past_due: int, dependents: str, income: str) -> str:
    values = [str(i), str(label), f"{0.1 * i:.3f}", str(30 + i), str(past_due), f"{0.01 * i:.3f}", income,
              str(i % 5), str(past_due % 2), str(i % 3), str(past_due), dependents]
    return ",".join(values)


def test_give_me_some_credit_rule_on_a_synthetic_file(tmp_path: Path) -> None:
    rows = [gmsc_row(i, i % 2, i % 4, str(i % 3), str(1000 * i)) for i in range(1, 21)]
    rows[4] = gmsc_row(5, 1, 0, "NA", "5000")     # missing NumberOfDependents: dropped
    rows[9] = gmsc_row(10, 0, 1, "0", "NA")       # missing MonthlyIncome: dropped
    path = tmp_path / "cs-training.csv"
    path.write_text("\n".join([GMSC_HEADER, *rows]) + "\n")
    spec = dataclasses.replace(get_spec("d2"), n_rows=20)
    ds = load_give_me_some_credit(spec, [path], 0)
    assert ds.n_train + ds.n_test == 18
    assert 4 not in ds.train_ids and 9 not in np.concatenate([ds.train_ids, ds.test_ids])
    # categorical: 30-59 past due (4 levels), 90 days late (2 -> 1 indicator), real estate (3),
    # 60-89 past due (4), dependents (3); numeric: the other five columns
    assert ds.n_features == 5 + 4 + 1 + 3 + 4 + 3
    assert "NumberOfDependents==2" in ds.feature_names and "MonthlyIncome" in ds.feature_names
    assert np.all(np.isfinite(ds.X_train))


def test_feature_count_mismatch_is_an_error_or_for_d2_a_warning(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    write_uci_csv(tmp_path / "UCI_Credit_Card.csv", 50)
    rows = [gmsc_row(i, i % 2, i % 4, str(i % 3), str(1000 * i)) for i in range(1, 21)]
    (tmp_path / "cs-training.csv").write_text("\n".join([GMSC_HEADER, *rows]) + "\n")
    monkeypatch.setattr("vertical.datasets.registry._BY_NAME", {
        "d1": dataclasses.replace(get_spec("d1"), n_rows=50),
        "d2": dataclasses.replace(get_spec("d2"), n_rows=20)})
    with pytest.raises(DataValidationError, match=r"'credit-card': \d+ features after prepro.*expected 90"):
        load("d1", data_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"20 features after preprocessing, expected 92 \(feature rule"):
        ds = load("d2", data_dir=tmp_path)
    assert ds.n_features == 20


def test_give_me_some_credit_missing_label_is_an_error(tmp_path: Path) -> None:
    rows = [gmsc_row(i, 0, 1, "1", "100") for i in range(1, 4)]
    rows[1] = rows[1].replace(",0,", ",NA,", 1)
    path = tmp_path / "cs-training.csv"
    path.write_text("\n".join([GMSC_HEADER, *rows]) + "\n")
    spec = dataclasses.replace(get_spec("d2"), n_rows=3)
    with pytest.raises(DataValidationError, match=r"cs-training\.csv, line 3: missing label"):
        load_give_me_some_credit(spec, [path], 0)


@pytest.mark.parametrize(("bad_line", "message"), [
    ("", "line 3: the line is blank"),
    ("7,0,0.1", "line 3: the line has 3 fields, the header has 12"),
])
def test_blank_or_short_csv_line_is_an_error(tmp_path: Path, bad_line: str, message: str) -> None:
    rows = [gmsc_row(i, 0, 1, "1", "100") for i in range(1, 4)]
    path = tmp_path / "cs-training.csv"
    path.write_text("\n".join([GMSC_HEADER, rows[0], bad_line, rows[2]]) + "\n")
    with pytest.raises(DataValidationError, match=message):
        load_give_me_some_credit(dataclasses.replace(get_spec("d2"), n_rows=3), [path], 0)


# ---------------------------------------------------------------- embedded


def test_embedded_datasets() -> None:
    cancer = load("breast-cancer", seed=0)
    assert cancer.X_train.shape == (455, 30) and set(np.unique(cancer.y_train)) == {-1.0, 1.0}
    assert np.allclose(cancer.X_train.mean(axis=0), 0, atol=1e-12)
    assert load("diabetes").task == "regression" and load("diabetes").y_train.dtype == np.float64
    digits = load("digits", seed=2)
    assert digits.n_classes == 10 and digits.y_train.dtype == np.int64 and digits.X_train.dtype == np.float32
    assert digits.X_train.min() >= 0.0 and digits.X_train.max() <= 1.0
    assert np.array_equal(load("digits", seed=2).train_ids, digits.train_ids)
    assert not np.array_equal(load("digits", seed=3).train_ids, digits.train_ids)


def test_breast_cancer_without_sklearn_is_sklearn_s_own(monkeypatch) -> None:
    """``vfl train``'s default data is read from scikit-learn's CSV file without importing scikit-learn
    (half a second of start-up): the same numbers as its loader, and its loader when the file is not
    where it was."""
    from sklearn.datasets import load_breast_cancer

    from vertical.datasets import embedded

    bunch = load_breast_cancer()
    X, target = embedded.bundled_breast_cancer(569, 30)
    assert np.array_equal(X, bunch.data) and np.array_equal(target, bunch.target)
    assert embedded.bundled_breast_cancer(570, 30) is None  # another layout: not guessed at
    direct = load("breast-cancer", seed=0)
    monkeypatch.setattr(embedded, "bundled_breast_cancer", lambda *shape: None)
    fallback = load("breast-cancer", seed=0)
    assert np.array_equal(direct.X_train, fallback.X_train) and np.array_equal(direct.y_test, fallback.y_test)


# ---------------------------------------------------------------- the real files


@pytest.mark.data
@requires_dataset("a9a")
def test_real_a9a() -> None:
    ds = load("a9a", seed=0)
    assert ds.n_train + ds.n_test == 32_561 and ds.n_features == 123 and ds.n_test == 6_512
    assert sp.isspmatrix_csr(ds.X_train) and set(np.unique(ds.y_train)) == {-1.0, 1.0}
    assert set(np.unique(ds.X_train.data)) == {1.0}, "a9a is 0/1-valued: the qid field is not a feature"
    assert np.diff(ds.X_train.indptr).max() == 14, "one active indicator per Adult attribute at most"
    again = load("a9a", seed=0)
    assert np.array_equal(again.test_ids, ds.test_ids) and (again.X_test != ds.X_test).nnz == 0


@pytest.mark.data
@requires_dataset("w8a")
def test_real_w8a_keeps_empty_rows() -> None:
    ds = load("w8a", seed=0)
    assert ds.n_train + ds.n_test == 49_749 and ds.n_features == 300
    empty = (np.diff(ds.X_train.indptr) == 0).sum() + (np.diff(ds.X_test.indptr) == 0).sum()
    assert empty > 0


@pytest.mark.data
@requires_dataset("credit-card")
def test_real_credit_card_gives_the_papers_90_features() -> None:
    ds = load("d1", seed=0)
    assert ds.n_features == 90 and ds.n_train == 24_000 and ds.n_test == 6_000
    assert np.all(np.isfinite(ds.X_train)) and set(np.unique(ds.y_train)) == {-1.0, 1.0}
    assert 0.2 < (ds.y_train == 1).mean() < 0.24, "about 22% of the clients default"


@pytest.mark.data
@requires_dataset("give-me-some-credit")
def test_real_give_me_some_credit_gives_the_papers_92_features() -> None:
    ds = load("d2", seed=0)
    assert ds.n_train + ds.n_test == 120_269
    assert ds.n_features == 92


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_a_huge_libsvm_index_is_one_line_naming_file_and_line(tmp_path: Path, suffix: str) -> None:
    """scikit-learn's parser overflows on an index past a C int (a traceback without a line)."""
    from vertical.datasets.libsvm import read_svmlight

    path = write_text(tmp_path / f"big.svm{suffix}", "1 1:0.5\n\n-1 2:1 1000000000000:1\n")
    where = r"big\.svm(\.gz)?, line 3: feature index 1000000000000"
    with pytest.raises(DataValidationError, match=where) as e:
        read_svmlight([path], 6)
    assert "\n" not in str(e.value)
