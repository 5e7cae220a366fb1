"""The VFB² update rules, checked in one process against the NonF optimum and the paper's formulas."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.datasets import load_breast_cancer
from sklearn.preprocessing import StandardScaler

from vertical.algorithms.serial import run_serial
from vertical.algorithms.vfb2 import Block, get_rule
from vertical.problems import get_problem
from vertical.reference import solve_reference


@pytest.fixture(scope="module")
def cancer():
    X, y = load_breast_cancer(return_X_y=True)
    return StandardScaler().fit_transform(X), np.where(y == 1, 1.0, -1.0)


@pytest.fixture(scope="module")
def blocks():
    return np.array_split(np.random.default_rng(0).permutation(30), 3)


def _rule(name, X, problem, gamma, **options):
    """Rule ``name`` for one party holding all of ``X``, with ``problem``'s regulariser."""
    return get_rule(name)(Block.from_matrix(X), problem.regularizer, problem.lam, gamma=gamma, **options)


@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("problem_name", ["logistic", "nonconvex-logistic", "least-squares"])
@pytest.mark.parametrize("sparse", [False, True])
def test_sgd_step_is_minus_gamma_block_gradient(problem_name, sparse, lazy, cancer):
    """One dominated update of block l is w_l ← w_l − γ(ϑ x_i^(l) + λ∇g(w_l)) (Alg. 2 steps 6-7).

    The sparse row leaves coordinates untouched: the lazy rule owes them the dense step until
    ``synchronize`` (a barrier), after which ``w`` is exact."""
    X, _ = cancer
    Xb = X[:, :10].copy()
    if sparse:
        Xb[np.abs(Xb) < 0.7] = 0.0
        Xb = sp.csr_matrix(Xb)
    problem = get_problem(problem_name, lam=0.3)
    rng = np.random.default_rng(1)
    w = rng.normal(size=10)
    rule = _rule("sgd", Xb, problem, 0.1, lazy=lazy)
    i, theta = 7, 0.42
    expected = w - 0.1 * problem.block_gradient(np.array([theta]), Xb[[i]], w)
    rule.apply(w, np.array([i]), np.array([theta]))
    rule.synchronize(w)
    np.testing.assert_allclose(w, expected, rtol=1e-12)


def test_svrg_step_matches_listing(cancer):
    """Alg. 5 line 7 with λ restored: ϑ_1 x_i + λ∇g(ŵ) − (ϑ_0i x_i + λ∇g(w^s)) + ∇f(w^s)."""
    X, _ = cancer
    problem = get_problem("nonconvex-logistic", lam=0.5)
    rng = np.random.default_rng(2)
    n, d = X.shape
    theta0 = rng.normal(size=n)
    w_s = rng.normal(size=d)
    w = w_s + 0.1 * rng.normal(size=d)
    rule = _rule("svrg", X, problem, 0.01)
    rule.snapshot(theta0)
    full_grad_s = X.T @ theta0 / n + problem.lam * problem.regularizer.gradient(w_s)
    i, theta1 = 11, -0.3
    v = (theta1 * X[i] + problem.lam * problem.regularizer.gradient(w)
         - (theta0[i] * X[i] + problem.lam * problem.regularizer.gradient(w_s)) + full_grad_s)
    expected = w - 0.01 * v
    rule.apply(w, np.array([i]), np.array([theta1]))
    rule.synchronize(w)
    np.testing.assert_allclose(w, expected, rtol=1e-10, atol=1e-14)


def test_saga_exact_table_update(cancer):
    """Alg. 7: ṽ = ϑx_i + λ∇g(ŵ) − α̃_i + mean(α̃); then α̃_i ← ϑx_i + λ∇g(ŵ), mean kept exact."""
    X, _ = cancer
    problem = get_problem("logistic", lam=0.2)
    rng = np.random.default_rng(3)
    n, d = X.shape
    w = rng.normal(size=d)
    rule = _rule("saga", X, problem, 0.05)
    rule.initialize(rng.normal(size=n), w)
    table_before = rule.table.copy()
    i, theta = 5, 0.8
    new = theta * X[i] + problem.lam * w
    expected_w = w - 0.05 * (new - table_before[i] + table_before.mean(axis=0))
    rule.apply(w, np.array([i]), np.array([theta]))
    np.testing.assert_allclose(w, expected_w, rtol=1e-12)
    np.testing.assert_allclose(rule.table[i], new, rtol=1e-12)
    np.testing.assert_allclose(rule.mean, rule.table.mean(axis=0), rtol=1e-10, atol=1e-14)


def test_unknown_algorithm_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown VFB² algorithm 'adam'.*sgd"):
        get_rule("adam")


@pytest.mark.parametrize("algorithm", ["svrg", "saga", "saga-scalar"])
def test_variance_reduced_rules_reach_the_nonf_optimum(algorithm, cancer, blocks):
    X, y = cancer
    problem = get_problem("logistic", lam=1e-2)
    f_star = solve_reference(problem, X, y).f_star
    result = run_serial(problem, X, y, blocks, algorithm, gamma=0.02, epochs=30, seed=1)
    assert result.objective[-1] - f_star < 1e-5


def test_variance_reduction_beats_sgd_per_epoch(cancer, blocks):
    X, y = cancer
    problem = get_problem("logistic", lam=1e-2)
    f_star = solve_reference(problem, X, y).f_star
    gaps = {a: run_serial(problem, X, y, blocks, a, gamma=0.02, epochs=15, seed=1).objective[-1] - f_star
            for a in ("sgd", "svrg", "saga")}
    assert gaps["svrg"] < gaps["sgd"] / 10
    assert gaps["saga"] < gaps["sgd"] / 10
