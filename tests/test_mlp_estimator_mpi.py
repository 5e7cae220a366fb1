"""``VerticalMLPClassifier(backend="mpi")``: the estimator trains over real MPI parties."""

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.metrics import log_loss

from vertical.datasets import load
from vfl import VerticalMLPClassifier


@pytest.mark.mpi
def test_the_estimator_trains_over_real_mpi_parties_and_holds_the_networks_they_trained():
    """fit over a real 4-party job learns digits from string labels; the networks it reads back are the
    ones the job trained: their loss on the training rows is the loss the job logged at its end."""
    ds = load("digits", seed=0)
    labels = np.array([f"digit-{d}" for d in range(10)])
    model = VerticalMLPClassifier(parties=4, bottom="*-32-8", top="8-*", lr=1e-2, batch_size=32, epochs=3,
                                  backend="mpi")
    assert clone(model).get_params() == model.get_params()
    assert model.fit(ds.X_train, labels[ds.y_train]) is model
    proba = model.predict_proba(ds.X_test)
    assert proba.shape == (ds.X_test.shape[0], 10) and np.allclose(proba.sum(axis=1), 1.0)
    assert model.score(ds.X_test, labels[ds.y_test]) > 0.85
    assert len(model.history_) >= 3 and model.epsilon_ is None
    logged = model.history_[-1]["loss"]
    held = log_loss(ds.y_train, model.predict_proba(ds.X_train), labels=np.arange(10))
    assert held == pytest.approx(logged, rel=1e-4)


def test_settings_the_runtime_does_not_have_are_refused_in_one_line():
    ds = load("breast-cancer", seed=0)
    for given, match in (({"optimizer": "sgd"}, "steps every network with Adam"),
                         ({"dtype": "float64"}, "trains in float32"),
                         ({"label_privacy": "dp", "epsilon": 4.0, "clip": 2.0}, "clips each row"),
                         ({"backend": "gpu"}, "backend must be")):
        with pytest.raises(ValueError, match=match):
            VerticalMLPClassifier(parties=3, **{"backend": "mpi", **given}).fit(ds.X_train, ds.y_train)


@pytest.mark.mpi
def test_a_label_dp_estimator_over_mpi_trains_protected_and_states_the_budget_it_was_calibrated_for():
    """label_privacy="dp" over MPI runs the job's ``--label-privacy dp-theta``: the noise multiplier it
    reports keeps the 4 passes' releases of every row within the ε asked for (the job counts a release
    more where its segments' batch quotas round up), and the protected networks still learn."""
    from vertical.label_privacy import gaussian_epsilon

    ds = load("breast-cancer", seed=0)
    model = VerticalMLPClassifier(parties=3, bottom="*-8-1", top="1", lr=1e-2, batch_size=32, epochs=4,
                                  label_privacy="dp", epsilon=8.0, backend="mpi").fit(ds.X_train, ds.y_train)
    assert model.noise_multiplier_ > 0
    assert 4.0 < gaussian_epsilon(model.noise_multiplier_, 1e-5, 4) <= 8.0
    assert model.score(ds.X_test, ds.y_test) > 0.75
