"""ε-label-DP by randomized response: the mechanism's distribution, and what a curious passive party
can still infer from a real run (no better than the mechanism allows)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from experiments.label_attacks import attack_all
from parties.config import ConfigError, RunConfig, validate
from tests.test_runtime import train
from vfl.datasets import load
from vfl.label_privacy import flip_probability, randomized_response


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 4.0])
def test_randomized_response_flips_at_its_rate_and_is_epsilon_dp(epsilon):
    n = 200_000
    rng = np.random.default_rng(int(epsilon * 10))
    y = np.where(rng.random(n) < 0.3, 1.0, -1.0)
    out = randomized_response(y, epsilon, rng)
    rho = flip_probability(epsilon)
    assert rho == pytest.approx(1 / (1 + math.exp(epsilon)))
    assert abs(np.mean(out != y) - rho) < 5 * math.sqrt(rho * (1 - rho) / n)
    # ε-DP per label: P(out = +1 | y = +1) / P(out = +1 | y = −1) = e^ε, within sampling error
    ratio = np.mean(out[y == 1] == 1) / np.mean(out[y == -1] == 1)
    assert ratio == pytest.approx(math.exp(epsilon), rel=0.05)


def test_randomized_response_refuses_what_it_cannot_protect():
    with pytest.raises(ValueError, match="binary labels"):
        randomized_response(np.array([0.0, 1.0]), 1.0, np.random.default_rng())
    with pytest.raises(ValueError, match="positive finite"):
        flip_probability(0.0)
    base = dict(dataset="breast-cancer", label_privacy="dp", epsilon=1.0, active=1, parties=3)
    for bad, message in ((dict(epsilon=None), "needs --epsilon"), (dict(active=2), "needs -m 1"),
                         (dict(target_suboptimality=1e-3), "does not use f"),
                         (dict(problem="least-squares", dataset="diabetes"), "binary labels")):
        with pytest.raises(ConfigError, match=message):
            validate(RunConfig(**{**base, **bad}))


@pytest.mark.mpi
def test_a_passive_party_learns_no_more_than_randomized_response_allows(tmp_path):
    epsilon = 1.0
    train(tmp_path, "-n", "3", "-m", "1", "--algorithm", "svrg", "--epochs", "2", "--audit", "--dataset",
          "breast-cancer", "--lam", "0.01", "--label-privacy", "dp", "--epsilon", str(epsilon))
    y = load("breast-cancer", seed=0).y_train
    bound = 1 - flip_probability(epsilon)  # 0.73: the best guess of a label from its noisy copy
    for passive in (1, 2):
        for attack, found in attack_all(tmp_path / f"audit-{passive}.npz", y).items():
            assert found["accuracy"] < bound + 4 * math.sqrt(bound * (1 - bound) / y.size), attack
