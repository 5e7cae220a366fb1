"""The step size derived from the data (issue 25): ``--gamma auto`` (the paper's 0.05 stays the default:
measured in ``experiments/results/default_step``, the derived step is the safer one on unscaled features
and the slower one on the scaled data sets).

Unit tests check the losses' curvature constants, the expected-smoothness formula against a direct
computation on a matrix split into blocks, and the control plane's check of what the parties share.
The MPI jobs check that a run without ``--gamma`` trains well on breast-cancer at B = 1 and B = 64
and on a generated file of unscaled features where the old constant γ = 0.05 diverges, and that a run
that ends worse than w = 0 says so.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from mpi4py import MPI

from experiments._unscaled import write_unscaled_libsvm
from parties.audit import AuditLog
from parties.config import RunConfig, build_parser, from_args
from parties.control_plane import ControlPlane
from protocols.errors import ProtocolViolation
from tests.conftest import REPO_ROOT
from vertical.algorithms.vfb2 import Block
from vertical.datasets import load
from vertical.partition import random_blocks
from vertical.problems import PROBLEMS, LogisticLoss, RobustLoss, SquaredLoss, get_problem
from vertical.reference import evaluate, solve_reference
from vertical.step_size import block_row_norms, default_gamma, expected_smoothness

# ------------------------------------------------------------------------------------ the constants


@pytest.mark.parametrize("loss", [LogisticLoss(), SquaredLoss(), RobustLoss()], ids=lambda x: x.name)
def test_each_loss_curvature_is_its_second_derivatives_maximum(loss):
    z = np.linspace(-50, 50, 200_001)
    labels = (-1.0, 1.0) if isinstance(loss, LogisticLoss) else (-3.0, 0.0, 2.5)
    largest = max(float(np.max(loss.second_derivative(z, np.full_like(z, y)))) for y in labels)
    assert loss.curvature == pytest.approx(largest, rel=1e-6)
    assert {name: spec.loss.curvature for name, spec in PROBLEMS.items()} == {
        "logistic": 0.25, "nonconvex-logistic": 0.25, "least-squares": 2.0, "robust": 1.0}
    assert get_problem("least-squares").curvature == 2.0


def _blocks_matrix(seed: int = 3) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((40, 9)) * np.logspace(0, 1.5, 9)
    X[rng.random(X.shape) < 0.3] = 0.0
    return X, random_blocks(9, 3, seed=seed)


@pytest.mark.parametrize("batch", [1, 7, 40, 100])
def test_the_step_from_the_blocks_is_the_formula_on_the_whole_matrix(batch):
    X, blocks = _blocks_matrix()
    n = X.shape[0]
    shared = np.array([block_row_norms(Block.from_matrix(sp.csr_matrix(X[:, b]))) for b in blocks])
    c, lam = 0.25, 1e-3
    # the per-block terms, computed directly from the whole matrix
    l_max = c * sum(np.max(np.sum(X[:, b] ** 2, axis=1)) for b in blocks)
    l_mean = c * np.sum(X ** 2) / n  # Σ_l mean_i ‖x_il‖² = ‖X‖_F²/n
    b = min(batch, n)
    expected = (n - b) / (b * (n - 1)) * l_max + n * (b - 1) / (b * (n - 1)) * l_mean
    gamma = default_gamma(shared[:, 0].sum(), shared[:, 1].sum(), n, batch, c, lam)
    assert gamma == pytest.approx(1.0 / (expected + lam), rel=1e-12)
    # the bounds hold: L_max bounds every row's smoothness, L_mean the objective's
    assert l_max >= c * np.max(np.sum(X ** 2, axis=1))
    assert l_mean >= c * np.linalg.eigvalsh(X.T @ X / n).max()
    if batch == 1:  # SAG's step
        assert gamma == pytest.approx(1.0 / (l_max + lam))
    if batch >= n:  # full gradient descent's
        assert gamma == pytest.approx(1.0 / (l_mean + lam))


def test_block_row_norms_of_an_empty_row_and_an_empty_block():
    X = sp.csr_matrix(np.array([[3.0, 4.0], [0.0, 0.0]]))
    assert block_row_norms(Block.from_matrix(X)) == (25.0, 12.5)
    assert block_row_norms(Block.from_matrix(sp.csr_matrix((0, 2)))) == (0.0, 0.0)
    assert expected_smoothness(5.0, 1.0, 1, 1, 0.25) == 1.25
    assert default_gamma(0.0, 0.0, 10, 1, 0.25, 0.0) == 1.0  # flat objective: any step is exact


@pytest.mark.parametrize("bad", [(math.nan, 1.0), (1.0, math.inf), (-1.0, -2.0), (1.0, 2.0)])
def test_a_party_sharing_impossible_row_norms_is_named(bad):
    plane = ControlPlane(MPI.COMM_SELF, AuditLog(0, enabled=False))
    try:
        with pytest.raises(ProtocolViolation, match="row-norm bounds") as err:
            plane.gather_row_norms(*bad)
        assert err.value.sender == 0
        assert plane.gather_row_norms(4.0, 1.5).tolist() == [[4.0, 1.5]]
    finally:
        plane.close()


def test_gamma_auto_is_derived_and_a_number_is_kept():
    assert RunConfig().gamma == 0.05  # the paper's grid stays the default
    assert from_args(build_parser().parse_args([])).gamma == 0.05
    assert from_args(build_parser().parse_args(["--gamma", "auto"])).gamma is None
    assert from_args(build_parser().parse_args(["--gamma", "0.3"])).gamma == 0.3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--gamma", "fast"])
    decaying = RunConfig(gamma=None, gamma_decay=1.0)
    assert decaying.gamma_at(2.0, 0.3) == pytest.approx(0.1)
    assert RunConfig(gamma=0.3, gamma_decay=1.0).gamma_at(2.0) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="derived"):
        decaying.gamma_at(0.0)


# ------------------------------------------------------------------------------------- MPI jobs


def vfl(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "vfl.cli", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def trained(out: Path, *args: str) -> tuple[dict, str]:
    proc = vfl("train", "--out", str(out), "--no-progress", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out / "result.json").read_text()), proc.stdout


@pytest.fixture(scope="module")
def cancer_nonf():
    ds = load("breast-cancer", seed=0)
    problem = get_problem("logistic")
    sol = solve_reference(problem, ds.X_train, ds.y_train)
    return sol.f_star, evaluate(problem, sol.w, ds.X_test, ds.y_test)["accuracy"], ds


def _cancer_gamma(ds, batch: int) -> float:
    """The step every party derives, from the whole training matrix split as the launcher splits it."""
    X = sp.csr_matrix(ds.X_train)
    blocks = random_blocks(X.shape[1], 4, seed=0)
    shared = np.array([block_row_norms(Block.from_matrix(X[:, b])) for b in blocks])
    return default_gamma(shared[:, 0].sum(), shared[:, 1].sum(), X.shape[0], batch, 0.25, 1e-4)


@pytest.mark.mpi
def test_gamma_auto_breast_cancer_at_b1_reaches_the_nonf_accuracy(cancer_nonf, tmp_path):
    f_star, accuracy, ds = cancer_nonf
    result, stdout = trained(tmp_path / "run", "--dataset", "breast-cancer", "--f-star", str(f_star),
                             "--gamma", "auto")
    assert result["gamma"] == pytest.approx(_cancer_gamma(ds, 1), rel=1e-9)
    assert f"γ = {result['gamma']:.4g} (derived from the data)" in stdout
    assert result["record"]["test_accuracy"] >= accuracy - 0.005
    assert result["record"]["suboptimality"] < 0.04


@pytest.mark.mpi
def test_gamma_auto_breast_cancer_at_b64_takes_longer_steps_and_resumes_with_them(cancer_nonf, tmp_path):
    """B = 64 averages 64 rows' noise: the derived step is 14x B = 1's, and 10 epochs (71 steps) end
    at f − f* 0.059 where the old constant 0.05 ended at 0.092. The trace bound keeps the step at a
    third of what reaches NonF's accuracy in 10 epochs (0.3, by hand): 2 of 114 test rows short."""
    f_star, accuracy, ds = cancer_nonf
    half, _ = trained(tmp_path / "run", "--dataset", "breast-cancer", "-B", "64", "--f-star", str(f_star),
                      "--epochs", "5", "--gamma", "auto")
    # a resumed run derives its step again, from the same blocks: the same γ
    result, stdout = trained(tmp_path / "run", "--resume", "--epochs", "10")
    assert "resuming from epoch 5" in stdout and result["epochs"] == 10
    assert result["gamma"] == half["gamma"] == pytest.approx(_cancer_gamma(ds, 64), rel=1e-9)
    assert result["gamma"] > 10 * _cancer_gamma(ds, 1)
    assert result["record"]["suboptimality"] < 0.075
    assert result["record"]["test_accuracy"] >= accuracy - 0.02


@pytest.fixture(scope="module")
def unscaled_parties(tmp_path_factory):
    folder = tmp_path_factory.mktemp("unscaled")
    source = write_unscaled_libsvm(folder / "unscaled.libsvm")
    proc = vfl("split", str(source), "-n", "4", "-m", "2", "--task", "binary", "--n-features", "300",
               "--out", str(folder / "parties"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return folder / "parties"


@pytest.mark.mpi
def test_unscaled_features_train_with_the_derived_step_and_diverge_with_0_05(unscaled_parties, tmp_path):
    common = ["--party-files", str(unscaled_parties), "--no-reference", "-B", "16", "--epochs", "1"]
    result, _ = trained(tmp_path / "derived", *common, "--gamma", "auto")
    assert result["outcome"] == "budget" and result["record"]["loss"] < math.log(2)
    old = vfl("train", "--out", str(tmp_path / "old"), "--no-progress", *common, "--gamma", "0.05")
    assert old.returncode == 3, old.stdout + old.stderr  # EXIT_CODES["diverged"]
    assert "diverged" in old.stderr


@pytest.mark.mpi
def test_a_run_that_ends_worse_than_w0_says_so(unscaled_parties, tmp_path):
    result, stdout = trained(tmp_path / "run", "--party-files", str(unscaled_parties), "--no-reference",
                             "--gamma", "0.0005", "--epochs", "1")
    assert result["outcome"] == "budget" and result["record"]["loss"] > math.log(2)
    line = next(x for x in stdout.splitlines() if x.startswith("warning:"))
    assert "above the loss at w = 0 (0.693147)" in line and "smaller --gamma" in line
    assert result["warning"] == line
