"""The caps of ``experiments/label_dp_limit.py``: each mechanism's noise, set from an AUC cap, lets the
optimal attacker (who knows everything but the label) read exactly that AUC, and the runtime's ε over 5
passes guarantees the cap stated in the README (ε = 1.5: 0.60), row by row."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from experiments.label_dp_limit import gaussian_scale, rr_epsilon, runtime_cap
from vertical.label_privacy import gaussian_noise_multiplier

N = 200_000


@pytest.mark.parametrize("cap", [0.55, 0.6, 0.7])
def test_the_gaussian_target_noise_for_a_cap_gives_the_optimal_attack_that_auc(cap):
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, N)
    assert roc_auc_score(y, y + rng.normal(0, gaussian_scale(cap), N)) == pytest.approx(cap, abs=0.005)


@pytest.mark.parametrize("cap", [0.55, 0.6, 0.7])
def test_randomized_response_at_the_cap_s_epsilon_reads_that_auc_and_no_more(cap):
    rng = np.random.default_rng(2)
    y = rng.integers(0, 2, N)
    flipped = np.where(rng.random(N) < 1 / (1 + np.exp(rr_epsilon(cap))), 1 - y, y)
    assert roc_auc_score(y, flipped) == pytest.approx(cap, abs=0.005)


def test_the_runtime_s_epsilon_1_5_caps_the_optimal_attack_on_a_row_at_0_60_whatever_the_passes():
    """The passive party averages a row's 5 fresh releases of σ(z) − y + noise (σ(z) known to this
    attacker): its AUC is the cap, which ε = 1.5 puts at 0.60 and ε = 2 above it."""
    assert runtime_cap(1.5, passes=5) == pytest.approx(0.600, abs=0.002)
    assert runtime_cap(1.5, passes=6) == pytest.approx(runtime_cap(1.5, passes=5), abs=0.001)  # charged 6
    assert runtime_cap(2.0, passes=5) > 0.62 > runtime_cap(1.5, passes=5) > runtime_cap(1.0, passes=5)
    rng = np.random.default_rng(3)
    y = rng.integers(0, 2, N)
    sigma = gaussian_noise_multiplier(1.5, 1e-5, 5)
    mean_release = np.mean([-y + rng.normal(0, sigma, N) for _ in range(5)], axis=0)
    assert roc_auc_score(y, -mean_release) == pytest.approx(runtime_cap(1.5, passes=5), abs=0.005)
