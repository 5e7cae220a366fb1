"""Losses, regularizers and problems: derivatives against finite differences, the BUM block identity,
numerical stability, prediction/metrics, and input validation."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from vertical.metrics import accuracy, rmse
from vertical.problems import (
    L2,
    PROBLEMS,
    LogisticLoss,
    Loss,
    NonconvexL2,
    NoRegularizer,
    Problem,
    RobustLoss,
    SquaredLoss,
    get_problem,
)

LOSSES = [LogisticLoss(), SquaredLoss(), RobustLoss()]
REGULARIZERS = [L2(), NonconvexL2(), NoRegularizer()]
# Scores from 0 to 1e3 in magnitude: the tails are where a naive log(1+exp(·)) overflows.
SCORES = np.array([-1e3, -250.0, -30.0, -3.7, -0.4, 0.0, 0.3, 1.9, 12.0, 40.0, 700.0, 1e3])


def central_difference(f, x: np.ndarray, h: np.ndarray) -> np.ndarray:
    return (f(x + h) - f(x - h)) / (2.0 * h)


def labels_for(loss: Loss, rng: np.random.Generator, size: int) -> np.ndarray:
    if isinstance(loss, LogisticLoss):
        return rng.choice([-1.0, 1.0], size=size)
    return rng.normal(scale=3.0, size=size)


def random_data(task: str, n: int, d: int, seed: int, density: float = 0.4):
    rng = np.random.default_rng(seed)
    X = sp.random(n, d, density=density, format="csr", random_state=seed,
                  data_rvs=lambda k: rng.normal(size=k))
    w_true = rng.normal(size=d)
    z = X @ w_true
    y = np.where(z + 0.5 * rng.normal(size=n) >= 0, 1.0, -1.0) if task == "binary" else z + rng.normal(size=n)
    return X, y, rng.normal(size=d)


# ---------------------------------------------------------------------------------------- losses


@pytest.mark.parametrize("loss", LOSSES, ids=lambda loss: loss.name)
def test_loss_derivatives_match_central_differences(loss: Loss) -> None:
    rng = np.random.default_rng(1)
    z = np.concatenate([SCORES, rng.normal(scale=5.0, size=40)])
    y = labels_for(loss, rng, z.size)
    h = 1e-6 * np.maximum(1.0, np.abs(z))
    fd_first = central_difference(lambda s: loss.value(s, y), z, h)
    fd_second = central_difference(lambda s: loss.derivative(s, y), z, h)
    np.testing.assert_allclose(loss.derivative(z, y), fd_first, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(loss.second_derivative(z, y), fd_second, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("loss", "z", "y", "value", "theta"), [
    (LogisticLoss(), 0.0, 1.0, np.log(2.0), -0.5),
    (LogisticLoss(), 0.0, -1.0, np.log(2.0), 0.5),
    (LogisticLoss(), 2.0, -1.0, np.log1p(np.exp(2.0)), 1.0 / (1.0 + np.exp(-2.0))),
    (LogisticLoss(), 1e3, -1.0, 1e3, 1.0),
    (LogisticLoss(), 1e3, 1.0, 0.0, 0.0),
    (SquaredLoss(), 3.0, 1.0, 4.0, 4.0),          # (z − y)² without ½, ϑ = 2(z − y)
    (SquaredLoss(), -1.0, 0.5, 2.25, -3.0),
    (RobustLoss(), 3.0, 1.0, np.log(3.0), 2.0 / 3.0),   # r = −2: log(4/2 + 1), ϑ = 2·2/(4 + 2)
    (RobustLoss(), 1.0, 1.0, 0.0, 0.0),
], ids=lambda v: getattr(v, "name", None))
def test_loss_values_at_known_points(loss: Loss, z: float, y: float, value: float, theta: float) -> None:
    assert loss.value(z, y) == pytest.approx(value, rel=1e-14, abs=1e-300)
    assert loss.derivative(z, y) == pytest.approx(theta, rel=1e-14, abs=1e-300)


@pytest.mark.parametrize("loss", LOSSES, ids=lambda loss: loss.name)
def test_losses_are_finite_and_warning_free_for_large_scores(loss: Loss) -> None:
    z = np.concatenate([SCORES, -SCORES])
    for y in (np.ones_like(z), -np.ones_like(z)):
        with np.errstate(over="raise", invalid="raise", divide="raise"):
            values = [loss.value(z, y), loss.derivative(z, y), loss.second_derivative(z, y)]
        for v in values:
            assert np.all(np.isfinite(v))


def test_logistic_tail_values_are_exact_not_rounded_to_zero_or_inf() -> None:
    loss = LogisticLoss()
    # log(1 + e^{−40}) ≈ e^{−40}: a naive log(1 + exp(·)) returns 0 here.
    assert loss.value(40.0, 1.0) == pytest.approx(np.exp(-40.0), rel=1e-12)
    assert loss.derivative(40.0, 1.0) == pytest.approx(-np.exp(-40.0), rel=1e-12)
    assert loss.second_derivative(40.0, 1.0) == pytest.approx(np.exp(-40.0), rel=1e-12)


def test_loss_methods_accept_scalars() -> None:
    for loss in LOSSES:
        assert np.ndim(loss.derivative(0.25, 1.0)) == 0
        assert float(loss.derivative(0.25, 1.0)) == float(loss.derivative(np.array([0.25]), 1.0)[0])


# ---------------------------------------------------------------------------------------- regularizers


@pytest.mark.parametrize("reg", REGULARIZERS, ids=lambda r: r.name)
def test_regularizer_gradients_match_central_differences(reg) -> None:
    rng = np.random.default_rng(2)
    w = np.concatenate([rng.normal(scale=2.0, size=15), [0.0, 1e-3, -40.0, 250.0]])
    h = 1e-6 * np.maximum(1.0, np.abs(w))
    # g is separable, so ∂g/∂w_j is the derivative of g on the one-entry vector [w_j]; differencing
    # the full sum instead would drown the step in the roundoff of the other terms.
    fd_grad = np.array([(reg.value(np.array([wj + hj])) - reg.value(np.array([wj - hj]))) / (2 * hj)
                        for wj, hj in zip(w, h, strict=True)])
    np.testing.assert_allclose(reg.gradient(w), fd_grad, rtol=1e-6, atol=1e-8)
    fd_diag = central_difference(reg.gradient, w, h)   # separable: coordinate j only moves gradient j
    np.testing.assert_allclose(reg.hessian_diagonal(w), fd_diag, rtol=1e-5, atol=1e-8)


def test_regularizer_values_at_known_points() -> None:
    w = np.array([3.0, -4.0])
    assert L2().value(w) == 12.5
    np.testing.assert_array_equal(L2().gradient(w), w)
    assert NonconvexL2().value(np.array([1.0, -1.0])) == pytest.approx(0.5)    # ½(½ + ½)
    np.testing.assert_allclose(NonconvexL2().gradient(np.array([1.0, -1.0])), [0.25, -0.25])
    assert NoRegularizer().value(w) == 0.0
    np.testing.assert_array_equal(NoRegularizer().gradient(w), [0.0, 0.0])


def test_l2_gradient_is_a_copy() -> None:
    w = np.array([1.0, 2.0])
    g = L2().gradient(w)
    g *= 10.0
    np.testing.assert_array_equal(w, [1.0, 2.0])


# ---------------------------------------------------------------------------------------- problems

PROBLEM_CASES = [get_problem(name, lam=0.05) for name in PROBLEMS] + [
    get_problem("robust", lam=0.05, regularizer="l2")]


@pytest.mark.parametrize("problem", PROBLEM_CASES, ids=lambda p: f"{p.name}-{p.regularizer.name}")
def test_gradient_and_hessian_match_finite_differences_of_objective(problem: Problem) -> None:
    X, y, w = random_data(problem.task, n=60, d=7, seed=3)
    eye = np.eye(w.size)
    h = 1e-6
    fd_grad = np.array([(problem.objective(w + h * e, X, y) - problem.objective(w - h * e, X, y)) / (2 * h)
                        for e in eye])
    np.testing.assert_allclose(problem.gradient(w, X, y), fd_grad, rtol=1e-6, atol=1e-8)
    hessian = problem.hessian_operator(w, X, y)
    fd_hess = np.column_stack([
        (problem.gradient(w + h * e, X, y) - problem.gradient(w - h * e, X, y)) / (2 * h) for e in eye])
    np.testing.assert_allclose(hessian @ eye, fd_hess, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("problem", PROBLEM_CASES, ids=lambda p: f"{p.name}-{p.regularizer.name}")
def test_dense_and_sparse_inputs_agree(problem: Problem) -> None:
    X, y, w = random_data(problem.task, n=50, d=9, seed=4)
    Xd = X.toarray()
    assert problem.objective(w, Xd, y) == pytest.approx(problem.objective(w, X, y), rel=1e-14)
    np.testing.assert_allclose(problem.gradient(w, Xd, y), problem.gradient(w, X, y), rtol=1e-12, atol=1e-15)
    theta = problem.theta(X @ w, y)
    np.testing.assert_allclose(problem.block_gradient(theta, Xd, w), problem.block_gradient(theta, X, w),
                               rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(problem.predict(w, Xd), problem.predict(w, X), rtol=1e-13)


def test_objective_is_mean_loss_plus_lambda_g() -> None:
    X, y, w = random_data("binary", n=30, d=5, seed=5)
    problem = get_problem("nonconvex-logistic", lam=0.3)
    z = X @ w
    expected = np.mean(np.log1p(np.exp(-y * z))) + 0.3 * 0.5 * np.sum(w**2 / (1 + w**2))
    assert problem.objective(w, X, y) == pytest.approx(expected, rel=1e-13)


@pytest.mark.parametrize("problem", PROBLEM_CASES, ids=lambda p: f"{p.name}-{p.regularizer.name}")
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "csr"])
def test_block_gradients_over_a_vertical_split_are_the_bum_identity(problem: Problem, sparse: bool) -> None:
    """Concatenating every party's ϑ_i x_i^(l) + λ∇g(w_l) gives the full per-sample gradient ∇f_i(w)."""
    n, d, q = 40, 11, 4
    X, y, w = random_data(problem.task, n=n, d=d, seed=6)
    X = X if sparse else X.toarray()
    rng = np.random.default_rng(6)
    blocks = np.array_split(rng.permutation(d), q)            # disjoint G_1..G_q of unequal content
    theta = problem.theta(X @ w, y)
    for i in rng.choice(n, size=5, replace=False):
        per_sample = np.empty(d)
        for G in blocks:
            per_sample[G] = problem.block_gradient(theta[i], X[[i]][:, G], w[G])
        # ∇f_i(w) is the gradient of the one-sample objective f_i(w) = L(w·x_i, y_i) + λ g(w).
        np.testing.assert_allclose(per_sample, problem.gradient(w, X[[i]], y[[i]]), rtol=1e-12, atol=1e-14)
    batch = rng.choice(n, size=8, replace=False)
    mini = np.empty(d)
    for G in blocks:
        mini[G] = problem.block_gradient(theta[batch], X[batch][:, G], w[G])
    np.testing.assert_allclose(mini, problem.gradient(w, X[batch], y[batch]), rtol=1e-12, atol=1e-14)


def test_block_gradient_accepts_a_single_dense_row_and_scalar_theta() -> None:
    problem = get_problem("logistic", lam=0.1)
    x_i, w_l = np.array([1.0, -2.0, 0.5]), np.array([0.3, 0.1, -0.7])
    theta = problem.theta(0.8, -1.0)
    np.testing.assert_allclose(problem.block_gradient(theta, x_i, w_l), theta * x_i + 0.1 * w_l, rtol=1e-15)


def test_mean_of_per_sample_gradients_is_the_full_gradient() -> None:
    problem = get_problem("least-squares", lam=0.2)
    X, y, w = random_data("regression", n=25, d=6, seed=7)
    theta = problem.theta(X @ w, y)
    # B = n rows in one batch is exactly (1/n) Σ_i ∇f_i(w).
    np.testing.assert_allclose(problem.block_gradient(theta, X, w), problem.gradient(w, X, y), rtol=1e-13)


def test_predict_and_score() -> None:
    X = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, -1.0]])
    w = np.array([1.0, -1.0])                                  # scores 1, −1, 0, 3
    binary = get_problem("logistic")
    np.testing.assert_array_equal(binary.predict(w, X), [1.0, -1.0, 1.0, 1.0])   # 0 ↦ +1
    assert binary.score(w, X, np.array([1.0, 1.0, 1.0, -1.0])) == 0.5
    regression = get_problem("least-squares")
    np.testing.assert_array_equal(regression.predict(w, X), [1.0, -1.0, 0.0, 3.0])
    assert regression.score(w, X, np.array([1.0, -1.0, 2.0, 3.0])) == pytest.approx(1.0)  # sqrt(4/4)


# ---------------------------------------------------------------------------------------- registry


def test_registry_and_defaults() -> None:
    assert set(PROBLEMS) == {"logistic", "nonconvex-logistic", "least-squares", "robust"}
    p = get_problem("logistic", lam=1e-4)
    assert (p.loss, p.regularizer, p.lam, p.task) == (LogisticLoss(), L2(), 1e-4, "binary")
    assert p.strongly_convex
    assert isinstance(get_problem("nonconvex-logistic").regularizer, NonconvexL2)
    assert not get_problem("nonconvex-logistic").strongly_convex
    assert get_problem("least-squares").task == "regression"
    assert isinstance(get_problem("robust").regularizer, NoRegularizer)      # (18) as printed
    assert isinstance(get_problem("robust", regularizer="l2").regularizer, L2)
    assert isinstance(get_problem("logistic", regularizer=NonconvexL2()).regularizer, NonconvexL2)


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known problems: logistic, nonconvex-logistic"):
        get_problem("svm")
    with pytest.raises(ValueError, match="known: l2, nonconvex, none"):
        get_problem("logistic", regularizer="l1")
    with pytest.raises(ValueError, match="lam"):
        get_problem("logistic", lam=-1.0)
    with pytest.raises(ValueError, match="lam"):
        get_problem("logistic", lam=float("nan"))


# ---------------------------------------------------------------------------------------- validation


def test_invalid_inputs_raise_clear_errors() -> None:
    problem = get_problem("logistic")
    X, y, w = random_data("binary", n=10, d=4, seed=8)
    with pytest.raises(ValueError, match=r"w must be a 1-D array of length 4 \(X has 4 columns\)"):
        problem.objective(w[:3], X, y)
    with pytest.raises(ValueError, match=r"y must be a 1-D array of length 10 \(X has 10 rows\)"):
        problem.gradient(w, X, y[:-1])
    with pytest.raises(ValueError, match=r"labels must be -1 or \+1, found \[0\.\]"):
        problem.objective(w, X, np.where(y > 0, 1.0, 0.0))
    bad_w = w.copy()
    bad_w[1] = np.inf
    with pytest.raises(ValueError, match="w contains NaN or infinite"):
        problem.gradient(bad_w, X, y)
    bad_sparse = X.copy()
    bad_sparse.data[0] = np.nan
    with pytest.raises(ValueError, match="X contains NaN"):
        problem.objective(w, bad_sparse, y)
    bad_dense = X.toarray()
    bad_dense[0, 0] = np.nan
    with pytest.raises(ValueError, match="X contains NaN"):
        problem.predict(w, bad_dense)
    with pytest.raises(ValueError, match="X must be 2-D"):
        problem.objective(w, np.ones(4), y)
    with pytest.raises(ValueError, match="X must be a numpy array or a scipy sparse matrix"):
        problem.objective(w, [[1.0] * 4] * 10, y)
    with pytest.raises(ValueError, match="theta must be a 1-D array of length 3"):
        problem.block_gradient(np.ones(2), X[:3], w)
    with pytest.raises(ValueError, match="w_block must be a 1-D array of length 2"):
        problem.block_gradient(np.ones(3), X[:3, :2], w)
    regression = get_problem("least-squares")
    with pytest.raises(ValueError, match="y contains NaN"):
        regression.score(w, X, np.full(10, np.nan))


def test_metrics_values_and_validation() -> None:
    assert accuracy([1, -1, 1, 1], [1.0, 1.0, 1.0, -1.0]) == 0.5
    assert rmse([0.0, 0.0, 0.0], [1.0, -2.0, 2.0]) == pytest.approx(np.sqrt(3.0))
    with pytest.raises(ValueError, match="differ in length: 3 vs 2"):
        accuracy([1, 1, 1], [1, 1])
    with pytest.raises(ValueError, match="y_pred contains NaN"):
        rmse([1.0], [np.nan])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        rmse([], [])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        accuracy(np.ones((2, 2)), np.ones((2, 2)))
