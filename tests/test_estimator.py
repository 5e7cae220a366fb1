"""The Python API: ``VerticalLogisticRegression`` / ``VerticalLinearRegression`` fit over real MPI parties
and agree with the centralised (NonF) solution of the same problem."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.datasets import load_breast_cancer, load_diabetes
from sklearn.preprocessing import StandardScaler

from vertical.problems import get_problem
from vertical.reference import solve_reference
from vfl import VerticalLinearRegression, VerticalLogisticRegression

pytestmark = pytest.mark.mpi


def test_logistic_regression_fits_to_the_nonf_optimum_and_scores(tmp_path):
    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    labels = np.where(y == 1, "malignant", "benign")  # any two labels, as in scikit-learn
    model = VerticalLogisticRegression(parties=3, active=1, lam=1e-2, gamma=0.05, epochs=8,
                                       out=str(tmp_path))
    assert model.fit(X, labels) is model
    problem = get_problem("logistic", lam=1e-2)
    y_pm = np.where(labels == model.classes_[1], 1.0, -1.0)
    f_star = solve_reference(problem, X, y_pm).f_star
    assert problem.objective(model.coef_, X, y_pm) - f_star < 1e-4
    assert set(model.predict(X[:20])) <= {"malignant", "benign"}
    assert model.score(X, labels) > 0.97
    assert [b.size for b in model.coef_blocks_] == [c.size for c in model.columns_]
    assert sorted(np.concatenate(model.columns_)) == list(range(30))
    assert model.history_[-1]["epoch"] == 8
    assert model.gamma_ == 0.05 and VerticalLogisticRegression().get_params()["gamma"] is None  # derived
    assert model.run_dir_ == tmp_path / "run" and (model.run_dir_ / "metrics.jsonl").exists()   # asked for
    proba = model.predict_proba(X)  # scikit-learn's contract: one column per class, rows sum to 1
    assert proba.shape == (X.shape[0], 2) and np.allclose(proba.sum(axis=1), 1.0)
    np.testing.assert_allclose(proba[:, 1], 1 / (1 + np.exp(-model.decision_function(X))), rtol=1e-12)
    assert np.array_equal(model.classes_[proba.argmax(axis=1)], model.predict(X))
    np.testing.assert_allclose(model.predict_log_proba(X), np.log(proba), atol=1e-12)


def test_raw_features_are_scaled_by_each_party_and_the_model_is_in_their_units(tmp_path):
    """Breast-cancer as measured (areas in the hundreds beside ratios near 0.1), no step given: each
    party centres and scales its own columns, and ``coef_``/``intercept_`` give the parties' scores on
    the raw X."""
    from parties.loading import read_scaling
    from vertical.standardize import apply_scaling

    X, y = load_breast_cancer(return_X_y=True)
    model = VerticalLogisticRegression(parties=3, active=1, lam=1e-2, epochs=3, standardize="center",
                                       out=str(tmp_path))
    model.fit(X, y)
    assert model.gamma_ > 0 and model.intercept_ != 0.0
    scores = 0.0
    for rank, columns in enumerate(model.columns_):
        scaling = read_scaling(tmp_path / "run" / f"standardize-{rank}.npz", columns.size, "center")
        with np.load(tmp_path / "run" / f"party-{rank}.ckpt.npz") as block:
            scores = scores + apply_scaling(X[:, columns], scaling) @ block["w"]
    np.testing.assert_allclose(model.decision_function(X), scores, rtol=1e-9, atol=1e-9)
    assert model.score(X, y) > 0.95


def test_linear_regression_and_the_scikit_learn_protocol(tmp_path):
    X, y = load_diabetes(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    y = (y - y.mean()) / y.std()
    model = VerticalLinearRegression(parties=3, active=1, lam=1e-4, gamma=0.01, epochs=10)
    copy = clone(model)
    assert copy.get_params() == model.get_params() and copy is not model
    model.fit(X, y)
    problem = get_problem("least-squares", lam=1e-4)
    reference = solve_reference(problem, X, y)
    assert problem.objective(model.coef_, X, y) - reference.f_star < 2e-3  # flat: s1..s4 are collinear
    assert model.score(X, y) == pytest.approx(1 - np.mean((X @ reference.w - y) ** 2) / y.var(), abs=0.01)


def test_bad_input_is_a_one_line_error():
    model = VerticalLogisticRegression(parties=3)
    with pytest.raises(ValueError, match="binary: y has 3 classes"):
        model.fit(np.ones((6, 4)), [0, 1, 2, 0, 1, 2])
    with pytest.raises(ValueError, match="X contains NaN"):
        model.fit(np.full((4, 4), np.nan), [0, 1, 0, 1])
    with pytest.raises(ValueError, match="cannot give each of 3 parties one"):
        model.fit(np.ones((4, 2)), [0, 1, 0, 1])
    with pytest.raises(ValueError, match="has 4 rows but y has 3"):
        model.fit(np.ones((4, 4)), [0, 1, 0])
