"""The step size derived from the data (issue 25), the default when ``--gamma`` is not given.

Unit tests check the losses' curvature and derivative bounds, the rule (``vertical/step_size.py``)
against a direct computation on a matrix split into blocks, the Gram eigenvalue's bound, and the
control plane's check of what the parties share. The MPI jobs check that a run without ``--gamma``
trains well on breast-cancer at B = 1 and B = 64 (and resumes with its step), that a generated file of
features on scales 1 to 10⁴ trains without any flag (where the paper's constant γ = 0.05 on the raw
features diverges), and that a run that ends worse than w = 0 says so.
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
from vertical.datasets import load, load_party_file
from vertical.datasets.party_files import find_party_file
from vertical.partition import random_blocks
from vertical.problems import PROBLEMS, LogisticLoss, RobustLoss, SquaredLoss, get_problem
from vertical.reference import evaluate, solve_reference
from vertical.step_size import (
    DENSE_GRAM_COLUMNS,
    ROW_QUANTILE,
    block_smoothness,
    default_gamma,
    expected_smoothness,
)

# ------------------------------------------------------------------------------------ the constants


@pytest.mark.parametrize("loss", [LogisticLoss(), SquaredLoss(), RobustLoss()], ids=lambda x: x.name)
def test_each_loss_curvature_and_derivative_bound_are_its_largest(loss):
    z = np.linspace(-50, 50, 200_001)
    labels = (-1.0, 1.0) if isinstance(loss, LogisticLoss) else (-3.0, 0.0, 2.5)
    largest = max(float(np.max(loss.second_derivative(z, np.full_like(z, y)))) for y in labels)
    assert loss.curvature == pytest.approx(largest, rel=1e-6)
    steepest = max(float(np.max(np.abs(loss.derivative(z, np.full_like(z, y))))) for y in labels)
    if loss.derivative_bound is None:  # the squared loss: ϑ grows with the residual
        assert steepest > 50
    else:
        assert steepest == pytest.approx(loss.derivative_bound, rel=1e-6)
        assert steepest <= loss.derivative_bound
    assert {name: spec.loss.curvature for name, spec in PROBLEMS.items()} == {
        "logistic": 0.25, "nonconvex-logistic": 0.25, "least-squares": 2.0, "robust": 1.0}
    assert get_problem("least-squares").curvature == 2.0


def _blocks_matrix(seed: int = 3, rows: int = 400) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, 9)) * np.logspace(0, 1.5, 9)
    X[rng.random(X.shape) < 0.3] = 0.0
    X[7] *= 30.0  # one long row: the robust rule's rows term passes over it, the strict one does not
    return X, random_blocks(9, 3, seed=seed)


@pytest.mark.parametrize("batch", [1, 7, 400, 1000])
@pytest.mark.parametrize("problem", ["logistic", "least-squares"])
def test_the_step_from_the_blocks_is_the_rule_on_the_whole_matrix(batch, problem):
    X, blocks = _blocks_matrix()
    n = X.shape[0]
    shared = np.array([block_smoothness(Block.from_matrix(sp.csr_matrix(X[:, b]))) for b in blocks])
    loss, lam = PROBLEMS[problem].loss, 1e-3
    c = loss.curvature
    norms = [np.sum(X[:, b] ** 2, axis=1) for b in blocks]
    # each party's three numbers, computed directly from the whole matrix
    assert shared[:, 0] == pytest.approx([m.max() for m in norms], rel=1e-12)
    assert shared[:, 1] == pytest.approx([np.quantile(m, ROW_QUANTILE) for m in norms], rel=1e-12)
    eigen = [np.linalg.eigvalsh(X[:, b].T @ X[:, b] / n)[-1] for b in blocks]
    assert shared[:, 2] == pytest.approx(eigen, rel=1e-9)
    # the bounds hold: the sum of the blocks' eigenvalues bounds the whole matrix's (tighter than its
    # trace), the sum of the blocks' largest row norms every row's
    whole = np.linalg.eigvalsh(X.T @ X / n)[-1]
    assert whole <= sum(eigen) < np.sum(X ** 2) / n
    assert np.max(np.sum(X ** 2, axis=1)) <= shared[:, 0].sum() * (1 + 1e-12)
    robust = problem == "logistic"  # |ϑ| ≤ 1: the rows' 99.9th percentile and 2/L for the full term
    l_rows = c * (shared[:, 1] if robust else shared[:, 0]).sum()
    l_full = c * sum(eigen) / (2 if robust else 1)
    b = min(batch, n)
    expected = (n - b) / (b * (n - 1)) * l_rows + n * (b - 1) / (b * (n - 1)) * l_full
    gamma = default_gamma(shared, n, batch, loss, lam)
    assert gamma == pytest.approx(1.0 / (expected + lam), rel=1e-12)
    if robust and batch == 1:  # the long row is above the 99.9th percentile: a longer step than SAG's
        assert gamma > 1.0 / (c * shared[:, 0].sum() + lam)
    if not robust and batch == 1:  # SAG's step, from a bound of every row
        assert gamma == pytest.approx(1.0 / (c * shared[:, 0].sum() + lam))
    if batch >= n:  # full gradient descent's: 1/L, or 2/L where ϑ is bounded
        assert gamma == pytest.approx(1.0 / (l_full + lam))


def test_a_wide_blocks_eigenvalue_by_lanczos_bounds_the_exact_one_closely():
    rng = np.random.default_rng(5)
    X = sp.random(300, DENSE_GRAM_COLUMNS + 50, density=0.05, random_state=rng, format="csr")
    X.data = rng.standard_normal(X.nnz) * 3
    exact = np.linalg.eigvalsh((X.T @ X).toarray() / 300)[-1]
    _, _, estimate = block_smoothness(Block.from_matrix(X))
    assert exact <= estimate <= exact * (1 + 2e-4)
    assert block_smoothness(Block.from_matrix(X)) == block_smoothness(Block.from_matrix(X))  # seeded


def test_block_smoothness_of_one_row_and_of_an_empty_block():
    X = sp.csr_matrix(np.array([[3.0, 4.0], [0.0, 0.0]]))
    largest, quantile, eigen = block_smoothness(Block.from_matrix(X))
    assert largest == 25.0 and quantile == pytest.approx(25.0 * ROW_QUANTILE) and eigen == pytest.approx(12.5)
    assert block_smoothness(Block.from_matrix(sp.csr_matrix((0, 2)))) == (0.0, 0.0, 0.0)
    assert expected_smoothness(5.0, 1.0, 1, 1) == 5.0
    flat = np.zeros((3, 3))
    assert default_gamma(flat, 10, 1, LogisticLoss(), 0.0) == 1.0  # flat objective: any step is exact


@pytest.mark.parametrize("bad", [(math.nan, 1.0, 1.0), (1.0, math.inf, 0.5), (-1.0, -2.0, 0.0),
                                 (1.0, 2.0, 0.5), (4.0, 1.0, 5.0), (4.0, 1.0, -0.1)])
def test_a_party_sharing_impossible_row_norms_is_named(bad):
    plane = ControlPlane(MPI.COMM_SELF, AuditLog(0, enabled=False))
    try:
        with pytest.raises(ProtocolViolation, match="row-norm bounds") as err:
            plane.gather_row_norms(*bad)
        assert err.value.sender == 0
        assert plane.gather_row_norms(4.0, 1.5, 0.5).tolist() == [[4.0, 1.5, 0.5]]
    finally:
        plane.close()


def test_the_step_is_derived_by_default_and_a_number_is_kept():
    assert RunConfig().gamma is None  # derived from the data
    assert from_args(build_parser().parse_args([])).gamma is None
    assert from_args(build_parser().parse_args(["--gamma", "auto"])).gamma is None
    assert from_args(build_parser().parse_args(["--gamma", "0.05"])).gamma == 0.05  # the paper's
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
    """The step every party derives, from the whole training matrix split as the launcher splits it
    (breast-cancer is standardised with its training statistics already: ``--standardize on`` leaves it)."""
    X = sp.csr_matrix(ds.X_train)
    blocks = random_blocks(X.shape[1], 4, seed=0)
    shared = np.array([block_smoothness(Block.from_matrix(X[:, b])) for b in blocks])
    return default_gamma(shared, X.shape[0], batch, LogisticLoss(), 1e-4)


@pytest.mark.mpi
def test_without_gamma_breast_cancer_at_b1_reaches_the_nonf_accuracy(cancer_nonf, tmp_path):
    f_star, accuracy, ds = cancer_nonf
    result, stdout = trained(tmp_path / "run", "--dataset", "breast-cancer", "--f-star", str(f_star))
    assert result["gamma"] == pytest.approx(_cancer_gamma(ds, 1), rel=1e-6)
    assert f"γ = {result['gamma']:.4g} (derived from the data)" in stdout
    assert result["record"]["test_accuracy"] >= accuracy - 0.005
    assert result["record"]["suboptimality"] < 0.04


@pytest.mark.mpi
def test_without_gamma_breast_cancer_at_b64_steps_longer_and_resumes_with_its_own(cancer_nonf, tmp_path):
    """B = 64 averages 64 rows' noise: the derived step is 36x B = 1's. A resumed run goes on with the
    step its checkpoints hold, not one derived again (the rule may have changed since): here planted
    as 0.2 in every party's checkpoint."""
    f_star, accuracy, ds = cancer_nonf
    run = tmp_path / "run"
    half, _ = trained(run, "--dataset", "breast-cancer", "-B", "64", "--f-star", str(f_star), "--epochs", "5")
    assert half["gamma"] == pytest.approx(_cancer_gamma(ds, 64), rel=1e-6)
    assert half["gamma"] > 30 * _cancer_gamma(ds, 1)
    for rank in range(4):
        path = run / f"party-{rank}.ckpt.npz"
        with np.load(path) as z:
            kept = dict(z)
        assert float(kept["gamma"]) == half["gamma"]
        np.savez(path, **{**kept, "gamma": 0.2})
    result, stdout = trained(run, "--resume", "--epochs", "10")
    assert "resuming from epoch 5" in stdout and result["epochs"] == 10
    assert "step size γ = 0.2, the run's, from its checkpoint" in stdout and result["gamma"] == 0.2
    assert result["record"]["suboptimality"] < 0.06
    assert result["record"]["test_accuracy"] >= accuracy - 0.01


@pytest.fixture(scope="module")
def unscaled_parties(tmp_path_factory):
    folder = tmp_path_factory.mktemp("unscaled")
    source = write_unscaled_libsvm(folder / "unscaled.libsvm")
    from vfl.cli import main  # in this process: no second interpreter's imports for a split

    assert main(["split", str(source), "-n", "4", "-m", "2", "--task", "binary", "--n-features", "300",
                 "--out", str(folder / "parties")]) == 0
    return folder / "parties"


@pytest.mark.mpi
def test_features_on_scales_1_to_10000_train_without_flags_where_0_05_diverges(unscaled_parties, tmp_path):
    """No option at all: each party scales its columns, the step comes from the scaled blocks, and one
    pass at B = 16 is well above the majority class and below the loss of w = 0. The paper's γ = 0.05
    on the features as given diverges (exit 3). Lock-step (``sync-global``), so the outcome does not
    depend on how a loaded machine interleaves the parties (one async run failed at load 19)."""
    common = ["--party-files", str(unscaled_parties), "--no-reference", "-B", "16", "--epochs", "1",
              "--mode", "sync-global"]
    result, _ = trained(tmp_path / "default", *common)
    labels = load_party_file(find_party_file(unscaled_parties, 0)).y_test
    majority = max(np.mean(labels > 0), np.mean(labels < 0))
    assert result["outcome"] == "budget" and result["record"]["loss"] < 0.5 < math.log(2)
    assert result["record"]["test_accuracy"] > majority + 0.2
    old = vfl("train", "--out", str(tmp_path / "old"), "--no-progress", *common, "--gamma", "0.05",
              "--standardize", "off")
    assert old.returncode == 3, old.stdout + old.stderr  # EXIT_CODES["diverged"]
    assert "diverged" in old.stderr


@pytest.mark.mpi
def test_a_run_that_ends_worse_than_w0_says_so(tmp_path):
    """γ = 2 on breast-cancer overshoots (the derived step is 0.008): three epochs end near loss 1,
    above log 2, without leaving 10x of it (which would be a divergence, with its own message)."""
    result, stdout = trained(tmp_path / "run", "--dataset", "breast-cancer", "--no-reference",
                             "--gamma", "2", "--epochs", "3")
    assert result["outcome"] == "budget" and result["record"]["loss"] > math.log(2)
    line = next(x for x in stdout.splitlines() if x.startswith("warning:"))
    assert "above the loss at w = 0 (0.693147)" in line and "smaller --gamma" in line
    assert result["warning"] == line
