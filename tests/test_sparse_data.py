"""Issue 11, data side: ``vfl synth`` stand-ins, the streaming ``vfl split FILE.svm``, the
memory-mappable ``party-<p>/`` folders, and a training run on them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from vertical.datasets import DataValidationError, load, load_party_file, split_to_party_files
from vertical.datasets.party_files import check_aligned, find_party_file, read_manifest
from vertical.datasets.registry import resolve_name
from vertical.datasets.stream_split import split_libsvm_file
from vertical.datasets.synth import SHAPES, _Generator, read_sidecar, write_standin
from vertical.partition import random_blocks
from vfl.cli import main as vfl

REPO_ROOT = Path(__file__).resolve().parents[1]


def _rows(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if not line.startswith("#")]


# ------------------------------------------------------------------------------------- vfl synth


def test_synth_has_the_real_width_and_nonzeros_and_is_seeded(tmp_path: Path) -> None:
    info = write_standin(tmp_path / "a.svm", "news20", n_rows=200, seed=3)
    write_standin(tmp_path / "b.svm", "news20", n_rows=200, seed=3)
    write_standin(tmp_path / "c.svm", "news20", n_rows=20, seed=4)
    assert (tmp_path / "a.svm").read_bytes() == (tmp_path / "b.svm").read_bytes()
    assert _rows(tmp_path / "a.svm")[:20] != _rows(tmp_path / "c.svm")
    assert info["n_features"] == 1_355_191 and info["n_rows"] == 200
    assert 0.85 * SHAPES["news20"].mean_nnz < info["mean_nnz"] < 1.15 * SHAPES["news20"].mean_nnz
    ds = load("news20-standin", data_dir=_as_data_dir(tmp_path, "a.svm"))
    X = sp.vstack([ds.X_train, ds.X_test]).tocsr()
    assert X.shape == (200, 1_355_191) and X.nnz == info["nnz"]
    assert np.allclose(sp.linalg.norm(X, axis=1), 1.0, atol=1e-6)  # unit ℓ2 rows
    use = np.bincount(X.indices, minlength=X.shape[1])
    top = np.sort(use)[::-1]
    assert top[0] > 0.9 * 200 and top[0] > 20 * np.median(use[use > 0])  # heavy-tailed column use
    assert 0.3 < info["positive_fraction"] < 0.7


def test_synth_labels_follow_the_planted_model_up_to_the_label_noise(tmp_path: Path) -> None:
    info = write_standin(tmp_path / "w.svm", "webspam", n_rows=150, seed=1, mean_nnz=300,
                         label_noise=0.1)
    gen = _Generator(info["n_features"], 300, 1, zipf_exponent=1.0, nnz_sigma=0.8, planted_fraction=0.05,
                     label_noise=0.1)
    agree = []
    for line in _rows(tmp_path / "w.svm"):
        label, *pairs = line.split()
        cols = np.array([int(p.split(":")[0]) - 1 for p in pairs])
        vals = np.array([float(p.split(":")[1]) for p in pairs])
        margin = vals @ gen.planted_weights(cols)
        if margin != 0:
            agree.append(np.sign(margin) == float(label))
    assert info["n_features"] == 16_609_143 and len(agree) == round(150 * (1 - info["coin_toss_fraction"]))
    assert len(agree) > 135
    assert abs(np.mean(agree) - 0.9) < 0.08  # the labels are w*·x's sign, 10 % of them flipped


def test_synth_is_labelled_a_stand_in_everywhere(tmp_path: Path, capsys) -> None:
    assert vfl(["synth", "news20", "--rows", "50", "--out", str(tmp_path)]) == 0
    path = tmp_path / "news20-standin.svm"
    assert "STAND-IN for news20" in capsys.readouterr().out
    assert path.read_text().startswith("# vfl stand-in for news20 (NOT the real data)")
    assert read_sidecar(path)["stand_in_for"] == "news20"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_name("news20", tmp_path) == "news20-standin"
        assert load("d3", data_dir=tmp_path).name == "news20-standin"
        from parties.config import RunConfig
        from parties.plan import job_dataset, resolve

        config = resolve(RunConfig(parties=3, active=1, dataset="news20", data_dir=str(tmp_path)))
        job_dataset.cache_clear()
    assert config.dataset == "news20-standin"  # what config.json, the summary and result.json show
    assert any("synthetic stand-in" in str(w.message) for w in caught)
    (tmp_path / "news20.binary").write_text("")  # the real file, when present, always wins
    assert resolve_name("news20", tmp_path) == "news20"
    path.with_name(path.name + ".stand-in.json").unlink()
    with pytest.raises(DataValidationError, match="no valid stand-in sidecar"):
        load("news20-standin", data_dir=tmp_path)
    assert vfl(["synth", "news20", "--rows", "50", "--out", str(tmp_path)]) == 2  # exists: no overwrite
    assert vfl(["synth", "news20", "--rows", "0", "--out", str(tmp_path / "x.svm")]) == 2
    assert "--rows must be at least 1" in capsys.readouterr().err


def _as_data_dir(folder: Path, name: str) -> Path:
    """A data folder where ``name`` (and its sidecar) is ``news20-standin.svm``."""
    target = folder / "data"
    target.mkdir(exist_ok=True)
    for suffix in ("", ".stand-in.json"):
        (target / f"news20-standin.svm{suffix}").write_bytes((folder / f"{name}{suffix}").read_bytes())
    return target


# ------------------------------------------------------------------------ streaming vfl split


def _same_split(streamed: list[Path], in_memory: list[Path]) -> None:
    for a, b in zip(streamed, in_memory, strict=True):
        names = sorted(str(f.relative_to(b)) for f in b.rglob("*.npy"))
        assert names == sorted(str(f.relative_to(a)) for f in a.rglob("*.npy"))
        for name in names:
            x, y = np.load(a / name), np.load(b / name)
            assert x.dtype == y.dtype and np.array_equal(x, y), name


def test_frequency_column_order_renumbers_each_block_and_changes_nothing_else(tmp_path: Path) -> None:
    """--column-order frequency: each party's block lists its columns by descending count of nonzeros
    (streamed and in memory bit for bit alike), every row's local indices stay sorted, the features
    reassemble to the original matrix, and serial training gives the same model mapped back."""
    from vertical.algorithms.serial import run_serial
    from vertical.datasets.party_files import assemble_features
    from vertical.problems import get_problem

    write_standin(tmp_path / "news20-standin.svm", "news20", n_rows=120, seed=5, mean_nnz=40)
    streamed = split_libsvm_file(tmp_path / "news20-standin.svm", 3, [0], tmp_path / "s", seed=2,
                                 chunk_bytes=4096, column_order="frequency")
    ds = load("news20-standin", seed=2, data_dir=tmp_path)
    blocks = random_blocks(ds.n_features, 3, seed=2)
    in_memory = split_to_party_files(ds, blocks, [0], tmp_path / "m", partition_seed=2, layout="folder",
                                     column_order="frequency")
    _same_split(streamed, in_memory)
    counts = (np.bincount(ds.X_train.indices, minlength=ds.n_features)
              + np.bincount(ds.X_test.indices, minlength=ds.n_features))
    parties = [load_party_file(p) for p in in_memory]
    for party, block in zip(parties, blocks, strict=True):
        assert sorted(party.columns.tolist()) == block.tolist()
        assert np.all(np.diff(counts[party.columns]) <= 0), "busiest columns first"
        X = party.X_train
        assert all(np.all(np.diff(X.indices[X.indptr[r]:X.indptr[r + 1]]) > 0) for r in range(X.shape[0]))
    X_train, _ = assemble_features(parties)
    assert (X_train != ds.X_train).nnz == 0
    problem = get_problem("logistic", lam=1e-3)
    by_index = run_serial(problem, ds.X_train, ds.y_train, blocks, "sgd", gamma=0.1, epochs=2, seed=0)
    reordered = [party.columns for party in parties]
    by_frequency = run_serial(problem, ds.X_train, ds.y_train, reordered, "sgd", gamma=0.1, epochs=2, seed=0)
    np.testing.assert_allclose(by_frequency.w, by_index.w, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="unknown column order 'rare'"):
        split_to_party_files(ds, blocks, [0], tmp_path / "x", layout="folder", column_order="rare")


def test_streaming_split_equals_the_in_memory_split(tmp_path: Path) -> None:
    """Chunks of 4 KiB cross many row boundaries; comments, blank lines, qid fields and a 0-based file
    are read as scikit-learn reads them; the result is bit for bit ``split_to_party_files``."""
    write_standin(tmp_path / "news20-standin.svm", "news20", n_rows=120, seed=5, mean_nnz=40)
    streamed = split_libsvm_file(tmp_path / "news20-standin.svm", 3, [0, 2], tmp_path / "s", seed=2,
                                 chunk_bytes=4096)
    ds = load("news20-standin", seed=2, data_dir=tmp_path)
    in_memory = split_to_party_files(ds, random_blocks(ds.n_features, 3, seed=2), [0, 2], tmp_path / "m",
                                     partition_seed=2, layout="folder")
    _same_split(streamed, in_memory)
    assert read_manifest(tmp_path / "s") == read_manifest(tmp_path / "m")
    assert read_manifest(tmp_path / "s").dataset == "news20-standin"

    text = "# a comment\n1 qid:3 0:0.5 7:1\n\n-1 qid:3 2:2 # trailing\n1 qid:4 8:1.5\n-1 qid:4\n" * 30
    (tmp_path / "tiny.svm").write_text(text)
    streamed = split_libsvm_file(tmp_path / "tiny.svm", 2, [0], tmp_path / "t", chunk_bytes=64)
    from sklearn.datasets import load_svmlight_file

    X, y = load_svmlight_file(str(tmp_path / "tiny.svm"), zero_based=True)
    parties = [load_party_file(p) for p in streamed]
    check_aligned(parties)
    from vertical.datasets.party_files import assemble_features

    X_train, _ = assemble_features(parties)
    train_ids = parties[0].train_ids
    assert X_train.shape == (96, 9) and (X_train != X[train_ids]).nnz == 0
    assert np.array_equal(parties[0].y_train, y[train_ids])


@pytest.mark.parametrize(("text", "message"), [
    ("1 1:0.5\n1 2:1 1:3\n", r"line 2: feature indices must be increasing \('1:3' after index 2\)"),
    ("1 1:0.5\n\n# c\nspam 2:1\n", r"line 4: label 'spam' is not a number"),
    ("1 1:0.5\n-1 4=2\n", r"line 2: '4=2' is not index:value"),
    ("1 1:0.5\n-1 4:x\n", r"line 2: '4:x' has a value that is not a number"),
    ("1 1:0.5\n-1 4:nan\n", r"line 2: feature 4 is nan \(features must be finite\)"),
    ("1 1:0.5\n2 4:1\n", r"line 2: label 2.0 is not valid for a binary task"),
    ("1 1:0.5\n-1 40:1\n", r"line 2: feature index 40 is beyond the 10 features"),
    ("1 1:0.5\n-1 2:1 1000000000000:1\n", r"line 2: feature index 1000000000000 is beyond the "),
])
def test_split_parse_errors_name_file_and_line(tmp_path: Path, text: str, message: str, capsys) -> None:
    path = tmp_path / "bad.svm"
    path.write_text(text)
    code = vfl(["split", str(path), "-n", "2", "--out", str(tmp_path / "out"), "--n-features", "10"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err
    assert __import__("re").search(message, err), err


def _rss_growth_of_split(small: Path, big: Path, out: Path, chunk_bytes: int) -> int:
    """How much (bytes) a fresh process's peak RSS grows when it splits ``big``, after it has split
    ``small`` (same imports, same code paths warmed up) into 4 party folders."""
    code = (f"import resource; from vertical.datasets.stream_split import split_libsvm_file as split; "
            f"peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
            f"split({str(small)!r}, 4, [0], {str(out / 'small')!r}, chunk_bytes={chunk_bytes}); "
            f"before = peak(); "
            f"split({str(big)!r}, 4, [0], {str(out / 'big')!r}, chunk_bytes={chunk_bytes}); "
            f"print(peak() - before)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1",
                               "OPENBLAS_NUM_THREADS": "1"}, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split()[-1]) * 1024  # ru_maxrss is in KiB on Linux


def test_split_of_a_file_larger_than_the_memory_cap_stays_bounded(tmp_path: Path) -> None:
    """A file of 1.5M nonzeros (18 MB decoded as CSR) is split by a process whose peak RSS grows by
    less than a third of that over what splitting a 40-row file took: memory follows the chunk
    (256 KiB of text), not the file. Loading the file whole would grow it by more than 18 MB."""
    rng = np.random.default_rng(0)
    lines = []
    for i in range(400):
        cols = np.sort(rng.choice(50_000, size=150, replace=False)) + 1
        pairs = " ".join(f"{c}:{v:.4f}" for c, v in zip(cols, rng.random(150), strict=True))
        lines.append(f"{'+1' if i % 2 else '-1'} {pairs}")
    block = ("\n".join(lines) + "\n").encode()
    big, small = tmp_path / "big.svm", tmp_path / "small.svm"
    with open(big, "wb") as f:
        for _ in range(25):  # 10,000 rows x 150 nonzeros
            f.write(block)
    small.write_bytes(("\n".join(lines[:40]) + "\n").encode())
    decoded = 1_500_000 * (8 + 4)  # a float64 value and an int32 index per nonzero
    growth = _rss_growth_of_split(small, big, tmp_path, 1 << 18)
    assert growth < decoded / 3, (f"peak RSS grew by {growth / 2**20:.1f} MiB for a file of "
                                  f"{decoded / 2**20:.1f} MiB decoded")
    manifest = read_manifest(tmp_path / "big")
    assert manifest.n_train + manifest.n_test == 10_000 and manifest.n_features == 50_000
    nnz = sum(json.loads((tmp_path / "big" / f"party-{p}" / "party.json").read_text())[s]["nnz"]
              for p in range(4) for s in ("train", "test"))
    assert nnz == 1_500_000


def _sparse_dataset(n: int = 300, d: int = 90, seed: int = 0):
    """A small sparse binary dataset, in memory."""
    from vertical.datasets import Dataset

    rng = np.random.default_rng(seed)
    X = sp.random(n, d, density=0.1, format="csr", random_state=seed)
    y = rng.choice([-1.0, 1.0], size=n)
    test = np.arange(0, n, 5)
    train = np.setdiff1d(np.arange(n), test)
    return Dataset("toy-sparse", "binary", X[train], y[train], X[test], y[test], train, test, seed)


# ------------------------------------------------------------------------ party-<p>/ folders


def test_folder_round_trip_is_memory_mapped_and_equals_the_npz(tmp_path: Path) -> None:
    for ds in (load("breast-cancer", seed=1), _sparse_dataset()):
        name = ds.name
        blocks = random_blocks(ds.n_features, 3, seed=1)
        folders = split_to_party_files(ds, blocks, [1], tmp_path / name / "f", layout="folder")
        npzs = split_to_party_files(ds, blocks, [1], tmp_path / name / "z")
        for p, (folder, npz) in enumerate(zip(folders, npzs, strict=True)):
            assert find_party_file(tmp_path / name / "f", p) == folder
            a, b = load_party_file(folder, expect_labels=p == 1), load_party_file(npz)
            for field in ("train_ids", "test_ids", "columns", "y_train", "y_test"):
                left, right = getattr(a, field), getattr(b, field)
                assert (left is None and right is None) or np.array_equal(left, right)
            for split in ("X_train", "X_test"):
                left, right = getattr(a, split), getattr(b, split)
                if sp.issparse(left):
                    assert (left != right).nnz == 0
                    values = left.data
                else:
                    assert np.array_equal(left, right)
                    values = left
                while getattr(values, "base", None) is not None:
                    values = values.base
                assert type(values).__name__ == "mmap"  # mapped, not read into private memory
            assert (a.dataset, a.task, a.n_features_total) == (b.dataset, b.task, b.n_features_total)


def test_find_party_file_prefers_the_folder_and_names_what_is_missing(tmp_path: Path) -> None:
    ds = load("breast-cancer")
    blocks = random_blocks(ds.n_features, 2, seed=0)
    npz = split_to_party_files(ds, blocks, [0], tmp_path)
    assert find_party_file(tmp_path, 1) == npz[1]
    with pytest.raises(FileExistsError, match="already holds a split"):
        split_to_party_files(ds, blocks, [0], tmp_path, layout="folder")
    folders = split_to_party_files(ds, blocks, [0], tmp_path, layout="folder", overwrite=True)
    assert find_party_file(tmp_path, 1) == folders[1] and not npz[1].exists()
    with pytest.raises(FileNotFoundError, match=r"no data for party 2 \(party-2/ or party-2\.npz\)"):
        find_party_file(tmp_path, 2)
    with pytest.raises(DataValidationError, match=r"without party\.json"):
        load_party_file(tmp_path)
    assert vfl(["split", "breast-cancer", "-n", "2", "--out", str(tmp_path / "cli")]) == 0
    assert find_party_file(tmp_path / "cli", 0).is_dir()  # vfl split writes folders by default
    assert vfl(["split", "breast-cancer", "-n", "2", "--out", str(tmp_path / "old"), "--format", "npz"]) == 0
    assert find_party_file(tmp_path / "old", 0).name == "party-0.npz"


def test_a_tampered_folder_is_refused_before_any_kernel_reads_it(tmp_path: Path) -> None:
    ds = _sparse_dataset(d=122)
    folder = split_to_party_files(ds, random_blocks(ds.n_features, 2, seed=0), [0], tmp_path,
                                  layout="folder")[1]
    indices = np.load(folder / "train" / "indices.npy")
    indices[7] = 10_000
    np.save(folder / "train" / "indices.npy", indices)
    with pytest.raises(DataValidationError, match=r"party-1 \(train\): a column index is outside 0\.\.60"):
        load_party_file(folder)
    np.save(folder / "train" / "indices.npy", indices[:-1])
    with pytest.raises(DataValidationError, match="inconsistent CSR arrays"):
        load_party_file(folder)
    (folder / "train" / "indices.npy").unlink()
    with pytest.raises(DataValidationError, match=r"missing train/indices\.npy"):
        load_party_file(folder)
    meta = json.loads((folder / "party.json").read_text())
    (folder / "party.json").write_text(json.dumps({**meta, "train": {"kind": "csr", "rows": "many"}}))
    with pytest.raises(DataValidationError, match="not a vfl party folder"):
        load_party_file(folder)


# ------------------------------------------------------------------------------- end to end


@pytest.mark.mpi
def test_train_on_a_streamed_split_of_a_stand_in(tmp_path: Path) -> None:
    """vfl synth → vfl split FILE.svm → vfl train --party-files: 3 parties, 300 rows, 1 epoch; the
    result names the stand-in."""
    from tests.test_runtime import train

    svm = tmp_path / "news20-standin.svm"
    assert vfl(["synth", "news20", "--rows", "300", "--mean-nnz", "60", "--out", str(svm)]) == 0
    assert vfl(["split", str(svm), "-n", "3", "-m", "1", "--out", str(tmp_path / "parties")]) == 0
    proc = train(tmp_path / "run", "-n", "3", "-m", "1", "--party-files", str(tmp_path / "parties"),
                 "--algorithm", "sgd", "--epochs", "1")  # the step derived from the scaled blocks
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["outcome"] == "budget" and result["updates"] == 240
    assert result["data"].startswith("news20-standin") and "news20-standin" in proc.stdout
    assert result["record"]["loss"] < np.log(2)  # it learned something in one pass
