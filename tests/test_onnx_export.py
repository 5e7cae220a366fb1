"""``to_onnx``: a fitted estimator written as ONNX scores rows in onnxruntime as the estimator does.

The linear estimators fit over real MPI parties (raw breast-cancer columns under ``standardize="center"``,
so the scaling folded into the layer matters); the split network is simulated in one process.
"""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_breast_cancer, load_diabetes

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def _session(path):
    onnx.checker.check_model(onnx.load(str(path)))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.mpi
def test_logistic_regression_in_onnxruntime_scores_as_the_estimator(tmp_path):
    from vfl import VerticalLogisticRegression

    X, y = load_breast_cancer(return_X_y=True)
    model = VerticalLogisticRegression(parties=3, lam=1e-2, gamma=0.05, epochs=2, standardize="center")
    model.fit(X[:400], y[:400])
    session = _session(model.to_onnx(tmp_path / "logistic.onnx"))
    score, proba = session.run(["score", "probabilities"], {"X": X[400:]})
    np.testing.assert_allclose(score, model.decision_function(X[400:]), rtol=0, atol=1e-6)
    np.testing.assert_allclose(proba, model.predict_proba(X[400:]), rtol=0, atol=1e-6)
    assert np.abs(score).max() > 1.0  # a model that scores, not w = 0


@pytest.mark.mpi
def test_linear_regression_in_onnxruntime_scores_as_the_estimator(tmp_path):
    from vfl import VerticalLinearRegression

    X, y = load_diabetes(return_X_y=True)
    model = VerticalLinearRegression(parties=3, lam=1e-3, epochs=2).fit(X[:300], y[:300])
    session = _session(model.to_onnx(tmp_path / "linear.onnx"))
    outputs = [o.name for o in session.get_outputs()]
    (score,) = session.run(None, {"X": X[300:]})
    assert outputs == ["score"]
    np.testing.assert_allclose(score, model.predict(X[300:]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("labels, top", [(2, "4-*"), (3, "4-6-*")])
def test_split_network_in_onnxruntime_scores_as_the_estimator(tmp_path, labels, top):
    """Two classes (one logit, σ) and three (softmax, a hidden top layer): each party's bottom on its own
    columns, summed, then the top, in float32 as the network was trained."""
    pytest.importorskip("torch")
    from vfl import VerticalMLPClassifier

    X, y = load_breast_cancer(return_X_y=True)
    X = (X - X.mean(axis=0)) / X.std(axis=0)
    y = y if labels == 2 else np.digitize(X[:, 0], [-0.5, 0.5])
    model = VerticalMLPClassifier(parties=3, bottom="*-8-4", top=top, epochs=1, batch_size=32, seed=1)
    model.fit(X[:400], y[:400])
    session = _session(model.to_onnx(tmp_path / "mlp.onnx"))
    logits, proba = session.run(["logits", "probabilities"], {"X": X[400:].astype(np.float32)})
    assert logits.shape == (169, 1 if labels == 2 else 3)
    np.testing.assert_allclose(proba, model.predict_proba(X[400:]), rtol=0, atol=1e-6)
    assert np.array_equal(model.classes_[proba.argmax(axis=1)], model.predict(X[400:]))
