"""The NonF reference solver: optimality, closed forms, warm starts, and the a9a cross-check."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from tests.conftest import requires_dataset
from vertical.metrics import accuracy, rmse
from vertical.problems import get_problem
from vertical.reference import evaluate, solve_reference


def logistic_data(n: int = 400, d: int = 25, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    w_true = rng.normal(size=d)
    y = np.where(X @ w_true + rng.normal(size=n) >= 0, 1.0, -1.0)
    return X, y


def regression_data(n: int = 300, d: int = 20, seed: int = 1, sparse: bool = False):
    rng = np.random.default_rng(seed)
    X = sp.random(n, d, density=0.3, format="csr", random_state=seed, data_rvs=lambda k: rng.normal(size=k))
    y = X @ rng.normal(size=d) + 0.3 * rng.normal(size=n)
    return (X if sparse else X.toarray()), y


def test_strongly_convex_logistic_reaches_a_tiny_gradient_and_beats_perturbations() -> None:
    X, y = logistic_data()
    lam = 1e-3
    problem = get_problem("logistic", lam=lam)
    sol = solve_reference(problem, X, y)
    assert sol.converged and sol.grad_norm <= 1e-10
    assert sol.grad_norm == pytest.approx(np.linalg.norm(problem.gradient(sol.w, X, y)), rel=1e-6, abs=1e-16)
    assert sol.f_star == problem.objective(sol.w, X, y)
    assert sol.n_iter > 0 and sol.seconds > 0
    rng = np.random.default_rng(2)
    for scale in (1e-3, 1e-2, 1e-1, 1.0):
        for _ in range(5):
            delta = scale * rng.normal(size=X.shape[1]) / np.sqrt(X.shape[1])
            # λ-strong convexity at the minimiser: f(w* + δ) ≥ f* + (λ/2)‖δ‖².
            gap = problem.objective(sol.w + delta, X, y) - sol.f_star
            assert gap >= 0.5 * lam * (delta @ delta) * (1 - 1e-6)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "csr"])
def test_least_squares_matches_closed_form_ridge(sparse: bool) -> None:
    X, y = regression_data(sparse=sparse)
    lam = 1e-2
    n, d = X.shape
    # ∇f = (2/n) Xᵀ(Xw − y) + λw = 0  ⇔  ((2/n) XᵀX + λI) w = (2/n) Xᵀy   (loss (z − y)², no ½).
    Xd = X.toarray() if sparse else X
    w_ridge = np.linalg.solve(2.0 / n * Xd.T @ Xd + lam * np.eye(d), 2.0 / n * Xd.T @ y)
    sol = solve_reference(get_problem("least-squares", lam=lam), X, y)
    assert sol.converged
    np.testing.assert_allclose(sol.w, w_ridge, rtol=0, atol=1e-8)


def test_warm_start_from_the_solution_stops_immediately_at_the_same_point() -> None:
    X, y = logistic_data(seed=3)
    problem = get_problem("logistic", lam=1e-3)
    cold = solve_reference(problem, X, y)
    warm = solve_reference(problem, X, y, w0=cold.w)
    assert warm.n_iter <= 2
    np.testing.assert_allclose(warm.w, cold.w, rtol=0, atol=1e-10)


def test_newton_polish_finishes_what_a_truncated_lbfgs_started() -> None:
    X, y = logistic_data(seed=4)
    problem = get_problem("logistic", lam=1e-3)
    truncated = solve_reference(problem, X, y, max_iter=5, newton_polish=False)
    assert not truncated.converged and "Newton" not in truncated.message
    polished = solve_reference(problem, X, y, max_iter=5)
    assert polished.converged, polished.message
    assert "Newton-CG polish" in polished.message
    np.testing.assert_allclose(polished.w, solve_reference(problem, X, y).w, rtol=0, atol=1e-9)


@pytest.mark.parametrize("name", ["nonconvex-logistic", "robust"])
def test_nonconvex_problems_reach_a_stationary_point_below_the_start(name: str) -> None:
    problem = get_problem(name, lam=1e-3)
    X, y = logistic_data(seed=5) if problem.task == "binary" else regression_data(seed=5)
    sol = solve_reference(problem, X, y)
    assert sol.converged and sol.grad_norm <= 1e-10, sol.message
    assert sol.f_star < problem.objective(np.zeros(X.shape[1]), X, y)


def test_evaluate_reports_the_task_metric() -> None:
    X, y = logistic_data(seed=6)
    problem = get_problem("logistic", lam=1e-3)
    sol = solve_reference(problem, X[:300], y[:300])
    result = evaluate(problem, sol.w, X[300:], y[300:])
    assert result == {"accuracy": accuracy(y[300:], np.where(X[300:] @ sol.w >= 0, 1.0, -1.0))}
    assert result["accuracy"] > 0.8    # the labels are a noisy linear rule: a fit model must beat chance
    Xr, yr = regression_data(seed=7)
    reg = get_problem("least-squares", lam=1e-3)
    sol = solve_reference(reg, Xr[:200], yr[:200])
    assert evaluate(reg, sol.w, Xr[200:], yr[200:]) == {"rmse": rmse(yr[200:], Xr[200:] @ sol.w)}


def test_invalid_arguments_raise() -> None:
    X, y = logistic_data(n=20, d=3)
    problem = get_problem("logistic")
    with pytest.raises(ValueError, match="tol must be a positive number"):
        solve_reference(problem, X, y, tol=0.0)
    with pytest.raises(ValueError, match="y must be a 1-D array of length 20"):
        solve_reference(problem, X, y[:5])
    with pytest.raises(ValueError, match="w must be a 1-D array of length 3"):
        solve_reference(problem, X, y, w0=np.zeros(4))
    with pytest.raises(ValueError, match=r"problem must be a vertical\.problems\.Problem"):
        solve_reference("logistic", X, y)
    with pytest.raises(ValueError, match="max_iter"):
        solve_reference(problem, X, y, max_iter=0)


@pytest.mark.data
@requires_dataset("a9a")
def test_a9a_logistic_matches_scikit_learn() -> None:
    """NonF on a9a (λ = 1e-4, seeded 80/20 split) against scikit-learn's LogisticRegression.

    scikit-learn minimises C Σ log(1 + e^{−y w·x}) + ½‖w‖²; with C = 1/(λ n) that is f(w)/λ for our
    f(w) = (1/n) Σ L + (λ/2)‖w‖², so both have the same minimiser.
    """
    from sklearn.linear_model import LogisticRegression

    from vertical.datasets import load

    data = load("a9a", seed=0)
    lam = 1e-4
    problem = get_problem("logistic", lam=lam)
    sol = solve_reference(problem, data.X_train, data.y_train)
    ours = evaluate(problem, sol.w, data.X_test, data.y_test)["accuracy"]

    n = data.X_train.shape[0]
    sk = LogisticRegression(C=1.0 / (lam * n), fit_intercept=False, solver="newton-cholesky", tol=1e-12,
                            max_iter=1000).fit(data.X_train, data.y_train)
    w_sk = sk.coef_.ravel()
    f_sk = problem.objective(w_sk, data.X_train, data.y_train)
    theirs = accuracy(data.y_test, sk.predict(data.X_test))
    print(f"\na9a logistic λ={lam}: NonF f*={sol.f_star:.15g} ‖∇f‖={sol.grad_norm:.1e} "
          f"({sol.n_iter} iterations, {sol.seconds:.2f} s); scikit-learn f={f_sk:.15g}")
    print(f"a9a test accuracy: NonF {100 * ours:.2f}%  scikit-learn {100 * theirs:.2f}%")

    assert sol.converged, sol.message
    assert sol.f_star <= f_sk * (1 + 1e-12)
    assert sol.f_star == pytest.approx(f_sk, rel=1e-6)
    assert abs(ours - theirs) <= 0.003
