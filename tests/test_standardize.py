"""``--standardize`` (issue 25): each party scales its own columns by its own training rows' statistics.

Unit tests: what ``on`` and ``center`` compute, that the statistics are the training rows' only, that
a party keeps its scaling in its own folder and reads it back (checked) on resume and predict, that a
run from before the option is read as ``off``, and that the launcher's f* is the scaled problem's.
MPI jobs on a generated file of features on scales 1 to 10⁴: ``vfl predict`` scores with the scaling
training used (``on`` at B = 16), ``center`` under ``--label-privacy dp`` resumes and predicts, and
under ``--label-privacy he`` every party steps from its own scaled block, and so do the lock-step
modes under ``center``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from experiments._unscaled import write_unscaled_libsvm
from parties.config import RunConfig
from parties.loading import load_party, party_scaling, read_scaling, scaling_path
from parties.plan import JobPlan
from tests.conftest import REPO_ROOT
from vertical.datasets import load_party_file
from vertical.datasets.party_files import find_party_file
from vertical.problems import get_problem
from vertical.reference import solve_reference
from vertical.standardize import apply_scaling, fit_scaling


def _columns_on_scales(rows: int = 200, seed: int = 0) -> np.ndarray:
    """Columns on scales 1 to 10⁴ (one far from 0), an all-zero column and a rare indicator."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, 6)) * np.array([1.0, 10.0, 1e3, 1e4, 0.0, 0.0])
    X[:, 2] += 5e3
    X[rng.random(X.shape) < 0.5] = 0.0
    X[:, 5] = 0.0
    X[[3, 17], 5] = 1.0  # seen in 2 rows of 200
    return X


# ------------------------------------------------------------------------------------- the scaling


def test_on_divides_each_column_by_the_rms_of_its_nonzeros_and_keeps_zeros_sparsity_and_indicators():
    X = sp.csr_matrix(_columns_on_scales())
    scaling = fit_scaling(X, "on")
    scaled = apply_scaling(X, scaling)
    assert sp.issparse(scaled) and scaled.nnz == X.nnz and (scaled != 0).toarray().tolist() == (
        X != 0).toarray().tolist()
    dense = scaled.toarray()
    typical = [np.sqrt(np.mean(dense[dense[:, j] != 0, j] ** 2)) for j in range(4)]
    assert typical == pytest.approx(np.ones(4), rel=1e-12)  # each column's magnitude where present: 1
    assert scaling.scale[4] == 1.0 and not scaling.centers  # an all-zero column keeps scale 1
    assert scaling.scale[5] == 1.0 and dense[[3, 17], 5].tolist() == [1.0, 1.0]  # a rare indicator stays 0/1
    again = apply_scaling(X.toarray(), fit_scaling(X.toarray(), "on"))  # dense in, dense out, the same
    assert np.allclose(again, dense, rtol=1e-12)


def test_center_gives_each_column_mean_0_and_spread_1_on_the_training_rows():
    X = _columns_on_scales()
    for given in (X, sp.csr_matrix(X)):
        scaled = apply_scaling(given, fit_scaling(given, "center"))
        assert isinstance(scaled, np.ndarray)
        assert scaled[:, [0, 1, 2, 3, 5]].mean(axis=0) == pytest.approx(np.zeros(5), abs=1e-12)
        assert scaled[:, [0, 1, 2, 3, 5]].std(axis=0) == pytest.approx(np.ones(5), rel=1e-9)
        assert np.all(scaled[:, 4] == 0.0)


def test_test_rows_are_scaled_with_the_training_rows_statistics():
    X = _columns_on_scales()
    train, test = X[:150], np.vstack([X[:3], 7.0 * X[150:]])
    scaling = fit_scaling(train, "center")
    assert np.array_equal(apply_scaling(test, scaling)[:3], apply_scaling(train, scaling)[:3])
    assert not np.allclose(apply_scaling(test, scaling)[3:].std(axis=0)[:4], 1.0, rtol=0.5)


def test_data_already_on_that_scale_are_left_bit_for_bit():
    """Breast-cancer as loaded is standardised on its training rows: its scales are 1 and its means 0
    but for rounding, which counts as exact, so the default changes no bit of the paper's data."""
    from vertical.datasets import load

    X = load("breast-cancer", seed=0).X_train
    for mode in ("on", "center"):
        scaling = fit_scaling(X, mode)
        assert np.all(scaling.scale == 1.0) and np.all(scaling.shift == 0.0)
        assert np.array_equal(apply_scaling(X, scaling), X)
    assert not np.all(fit_scaling(1.001 * X, "on").scale == 1.0)  # a real 0.1 % is not rounding


def test_a_block_of_another_width_and_a_huge_dense_copy_are_refused(monkeypatch):
    X = sp.csr_matrix(_columns_on_scales())
    with pytest.raises(ValueError, match="party 2: the scaling is for 6 columns, the block has 4"):
        apply_scaling(X[:, :4], fit_scaling(X, "on"), who="party 2")
    monkeypatch.setattr("vertical.standardize.MAX_DENSE_BYTES", 1000)
    with pytest.raises(ValueError, match=r"would make its sparse block dense .*use --standardize on"):
        apply_scaling(X, fit_scaling(X, "center"))
    assert sp.issparse(apply_scaling(X, fit_scaling(X, "on")))  # scaling alone never densifies


# --------------------------------------------------------------------------- kept by each party


def vfl(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "vfl.cli", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _split(folder: Path, parties: int, active: int, rows: int = 1500) -> Path:
    """The generated file's ``rows`` (default: enough for 300 columns to train past 70 %), split."""
    source = write_unscaled_libsvm(folder / "unscaled.libsvm", rows=rows)
    proc = vfl("split", str(source), "-n", str(parties), "-m", str(active), "--task", "binary",
               "--n-features", "300", "--out", str(folder / "parties"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return folder / "parties"


@pytest.fixture(scope="module")
def unscaled_4_2(tmp_path_factory) -> Path:
    return _split(tmp_path_factory.mktemp("unscaled-4-2"), 4, 2)


def _plan(files: Path, tmp_path: Path, **options) -> JobPlan:
    config = RunConfig(parties=4, active=2, party_files=str(files), out=str(tmp_path / "run"),
                       party_dir=str(tmp_path / "org{rank}"), **options)
    return JobPlan.of(config)


def test_each_party_scales_its_own_columns_and_keeps_the_statistics_in_its_own_folder(unscaled_4_2, tmp_path):
    plan = _plan(unscaled_4_2, tmp_path)
    for rank in range(4):
        raw = load_party_file(find_party_file(unscaled_4_2, rank))
        party = load_party(plan, rank)
        expected = apply_scaling(raw.X_train, fit_scaling(raw.X_train, "on"))
        assert np.allclose(party.block.to_csr().toarray(), expected.toarray(), rtol=1e-12)
        assert sorted(p.name for p in (tmp_path / f"org{rank}").iterdir()) == [f"standardize-{rank}.npz"]
        saved = read_scaling(scaling_path(plan, rank), raw.X_train.shape[1], "on")
        assert np.array_equal(saved.scale, fit_scaling(raw.X_train, "on").scale)
    # resumed (and vfl predict, which reads the run as resumed): the saved statistics, not new ones
    resumed = JobPlan.of(dataclasses.replace(plan.options, resume=True))
    path = scaling_path(plan, 1)
    with np.load(path) as z:
        kept = dict(z)
    np.savez(path, **{**kept, "scale": 2 * kept["scale"]})  # planted: the resumed run must use these
    raw = load_party_file(find_party_file(unscaled_4_2, 1))
    assert np.allclose(load_party(resumed, 1).block.to_csr().toarray(),
                       raw.X_train.toarray() / (2 * kept["scale"]), rtol=1e-12)


@pytest.mark.parametrize("damage, message", [
    ("missing", "is missing"), ("mode", "not this run's --standardize on statistics"),
    ("width", "not this run's"), ("rows", "not this run's"), ("zero", "not this run's"),
    ("garbage", "is damaged")])
def test_a_missing_or_foreign_scaling_file_is_refused_in_one_line(unscaled_4_2, tmp_path, damage, message):
    plan = _plan(unscaled_4_2, tmp_path)
    raw = load_party_file(find_party_file(unscaled_4_2, 0))
    party_scaling(plan, 0, raw.X_train, raw.train_ids)
    path = scaling_path(plan, 0)
    with np.load(path) as z:
        kept = dict(z)
    if damage == "missing":
        path.unlink()
    elif damage == "garbage":
        path.write_bytes(b"not an npz")
    else:
        changed = {"mode": {"mode": "center"}, "width": {"scale": kept["scale"][:-1]},
                   "rows": {"ids_digest": np.zeros_like(kept["ids_digest"])},
                   "zero": {"scale": np.zeros_like(kept["scale"])}}[damage]
        np.savez(path, **{**kept, **changed})
    resumed = JobPlan.of(dataclasses.replace(plan.options, resume=True))
    with pytest.raises(ValueError, match=message) as err:
        party_scaling(resumed, 0, raw.X_train, raw.train_ids)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_a_saved_run_from_before_the_option_is_read_as_off():
    record = json.loads(JobPlan.of(RunConfig(out="/r")).to_json())
    for where in (record, record["options"]):
        del where["standardize"]
    assert JobPlan.from_json(json.dumps(record)).options.standardize == "off"
    assert RunConfig().standardize == "on"


def test_the_launchers_f_star_is_the_one_of_the_scaled_problem():
    from parties.launch import reference_f_star
    from vertical.datasets import load

    ds = load("diabetes", seed=0)  # features of scale 0.05: the scaling changes the problem
    problem = get_problem("least-squares", lam=0.1)
    for mode in ("on", "center"):
        scaled = apply_scaling(ds.X_train, fit_scaling(ds.X_train, mode))
        expected = solve_reference(problem, scaled, ds.y_train).f_star
        config = RunConfig(dataset="diabetes", problem="least-squares", lam=0.1, standardize=mode)
        assert reference_f_star(config) == pytest.approx(expected, rel=1e-9)
    off = reference_f_star(RunConfig(dataset="diabetes", problem="least-squares", lam=0.1, standardize="off"))
    assert off == pytest.approx(solve_reference(problem, ds.X_train, ds.y_train).f_star, rel=1e-9)
    assert abs(off - expected) > 1.0


# ------------------------------------------------------------------------------------- MPI jobs


def _train(out: Path, *args: str) -> dict:
    proc = vfl("train", "--out", str(out), "--no-progress", "--no-reference", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out / "result.json").read_text())


def _expected_scores(files: Path, run: Path, parties: int, mode: str) -> np.ndarray:
    """w·x of every test row, from each party's file, saved scaling and trained block (one machine)."""
    plan = JobPlan.from_json((run / "config.json").read_text())
    total = 0.0
    for rank in range(parties):
        data = load_party_file(find_party_file(files, rank))
        scaling = read_scaling(scaling_path(plan, rank), data.X_test.shape[1], mode)
        with np.load(run / f"party-{rank}.ckpt.npz") as z:
            total = total + apply_scaling(data.X_test, scaling) @ z["w"]
    return np.asarray(total).ravel()


def _predictions(run: Path) -> tuple[np.ndarray, np.ndarray]:
    proc = vfl("predict", str(run))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(run / "predictions-test.csv") as fh:
        rows = list(csv.DictReader(fh))
    scores = np.array([float(r["score"]) for r in rows])
    return scores, np.array([float(r["predicted_label"]) for r in rows])


@pytest.mark.mpi
def test_predict_scores_rows_with_the_scaling_training_used(unscaled_4_2, tmp_path):
    run = tmp_path / "run"
    result = _train(run, "--party-files", str(unscaled_4_2), "-B", "16", "--epochs", "1")
    scores, labels = _predictions(run)
    assert scores == pytest.approx(_expected_scores(unscaled_4_2, run, 4, "on"), abs=1e-6)
    y_test = load_party_file(find_party_file(unscaled_4_2, 0)).y_test
    assert np.mean(labels == y_test) == pytest.approx(result["record"]["test_accuracy"])
    assert result["record"]["test_accuracy"] > 0.7


@pytest.mark.mpi
def test_center_under_label_dp_resumes_and_predicts_with_the_same_statistics(small_files, tmp_path):
    files = small_files
    run = tmp_path / "run"
    options = ["--party-files", str(files), "-n", "3", "-m", "1", "--label-privacy", "dp", "--epsilon", "8",
               "--standardize", "center", "-B", "8"]
    first = _train(run, *options, "--epochs", "1")
    plan = JobPlan.from_json((run / "config.json").read_text())
    saved = [scaling_path(plan, r).read_bytes() for r in range(3)]
    resumed = _train(run, "--resume", "--epochs", "2")
    assert resumed["epochs"] == 2 and resumed["gamma"] == first["gamma"]
    assert [scaling_path(plan, r).read_bytes() for r in range(3)] == saved  # read back, not fitted again
    scores, _ = _predictions(run)
    assert scores == pytest.approx(_expected_scores(files, run, 3, "center"), abs=1e-6)
    assert resumed["record"]["loss"] < np.log(2)


@pytest.fixture(scope="module")
def small_files(tmp_path_factory) -> Path:
    """600 rows of 45 columns on scales 1 to 10⁴, split for q = 3, m = 1 (read only, so shared)."""
    folder = tmp_path_factory.mktemp("small")
    source = write_unscaled_libsvm(folder / "small.libsvm", rows=600, columns=45)
    files = folder / "parties"
    proc = vfl("split", str(source), "-n", "3", "-m", "1", "--task", "binary", "--n-features", "45",
               "--out", str(files))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return files


def _assert_plain_sgd_steps(files: Path, run: Path, gamma: float, lam: float, batch: int, mode: str, *,
                            epochs: float = 0.5) -> None:
    """Each party's trained block (q = 3, ``epochs``: one segment) equals mini-batch SGD's in one process
    on the blocks scaled as the run saved them (``mode``: ``on`` or ``center``), far from the features as
    given."""
    plan = JobPlan.from_json((run / "config.json").read_text())
    blocks = []
    for rank in range(3):
        data = load_party_file(find_party_file(files, rank))
        scaling = read_scaling(scaling_path(plan, rank), data.X_train.shape[1], mode)
        assert scaling.scale.max() > 100 and scaling.centers == (mode == "center")
        blocks.append(apply_scaling(data.X_train, scaling))
    y = load_party_file(find_party_file(files, 0)).y_train
    ws = _plain_minibatch_sgd(blocks, y, gamma, lam, batch, epochs=epochs)
    for rank, plain in enumerate(ws):
        with np.load(run / f"party-{rank}.ckpt.npz") as z:
            assert np.max(np.abs(plain)) > 0.01
            assert np.max(np.abs(z["w"] - plain)) < 1e-6, rank


def _plain_minibatch_sgd(blocks: list, y: np.ndarray, gamma: float, lam: float, batch: int, *,
                         epochs: float) -> list[np.ndarray]:
    """Mini-batch SGD on the blocks in one process, with the rows the lock-step runtime draws (seed 0)."""
    n = y.size
    problem = get_problem("logistic", lam=lam)
    ws = [np.zeros(b.shape[1]) for b in blocks]
    for rows in np.random.default_rng([0, 0]).integers(0, n, size=(math.ceil(epochs * n / batch), batch)):
        theta = problem.theta(sum(b[rows] @ w for b, w in zip(blocks, ws, strict=True)), y[rows])
        for b, w in zip(blocks, ws, strict=True):
            w -= gamma * lam * w
            w -= gamma / batch * (b[rows].T @ theta)
    return ws


@pytest.mark.mpi
def test_under_he_each_party_steps_from_its_own_scaled_block(small_files, tmp_path):
    """``--label-privacy he`` in sync mode takes exactly plain mini-batch SGD's steps (as
    ``tests/test_label_he.py`` shows on breast-cancer, whose scaling is 1): here on features of scales 1
    to 10⁴, so the passive parties' encrypted gradients must come from their scaled blocks."""
    files = small_files
    run, batch, lam = tmp_path / "run", 32, 0.1
    result = _train(run, "--party-files", str(files), "-n", "3", "-m", "1", "--algorithm", "sgd", "--mode",
                    "sync", "-B", str(batch), "--epochs", "0.5", "--label-privacy", "he", "--lam", str(lam))
    _assert_plain_sgd_steps(files, run, result["gamma"], lam, batch, "on")


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["sync-global"])  # sync: the first job of the resume test below
def test_center_in_lock_step_takes_mini_batch_sgds_steps_on_the_centred_blocks(small_files, tmp_path, mode):
    """The lock-step modes with ``--standardize center`` (a sparse block made dense, shifted and
    scaled) take exactly plain mini-batch SGD's steps on each party's centred block."""
    files = small_files
    run, batch, lam = tmp_path / "run", 32, 0.1
    result = _train(run, "--party-files", str(files), "-n", "3", "-m", "1", "--algorithm", "sgd", "--mode",
                    mode, "-B", str(batch), "--epochs", "0.5", "--standardize", "center", "--lam", str(lam))
    _assert_plain_sgd_steps(files, run, result["gamma"], lam, batch, "center")


@pytest.mark.mpi
def test_center_in_sync_mode_takes_mini_batch_sgds_steps_and_resumes_to_the_model_of_an_uninterrupted_run(
        small_files, tmp_path):
    """``--mode sync`` with ``--standardize center``, B = 16: its first epoch is plain mini-batch SGD's
    steps on each party's centred block, as in the test above. In lock step with one dominator a run
    takes the same steps run after run (to the secure sum's
    rounding; with two, the order in which a party applies the two steps of a round varies, and with
    the L2 decay it matters): with ``--standardize center`` and B = 16, 1 epoch then ``--resume`` to 2
    ends at the weights of 2 epochs straight, so the resumed parties scale their blocks as before and
    the dominator draws the rows the uninterrupted run drew (its sampler is kept in its checkpoint;
    without it the resumed run drew epoch 1's rows again and ended 0.1 away)."""
    batch, lam = 16, 0.1
    options = ["--party-files", str(small_files), "-n", "3", "-m", "1", "--mode", "sync",
               "--algorithm", "sgd", "--standardize", "center", "-B", str(batch), "--lam", str(lam)]
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    whole = _train(straight, *options, "--epochs", "2")
    first = _train(cut, *options, "--epochs", "1")
    _assert_plain_sgd_steps(small_files, cut, first["gamma"], lam, batch, "center", epochs=1)
    resumed = _train(cut, "--resume", "--epochs", "2")
    assert resumed["epochs"] == whole["epochs"] == 2
    for rank in range(3):
        with np.load(straight / f"party-{rank}.ckpt.npz") as a, np.load(cut / f"party-{rank}.ckpt.npz") as b:
            assert np.max(np.abs(a["w"])) > 1e-3
            np.testing.assert_allclose(b["w"], a["w"], rtol=0, atol=1e-6, err_msg=f"party {rank}")
