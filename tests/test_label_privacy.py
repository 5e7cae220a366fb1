"""ε-label-DP by randomized response: the mechanism's distribution, and what a curious passive party
can still infer from a real run (no better than the mechanism allows)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from experiments.label_attacks import Transcript, attack_all, full_theta
from parties.config import ConfigError, RunConfig, validate
from parties.loading import noisy_labels
from parties.plan import JobPlan, label_dp_releases, resolve
from tests.test_runtime import train
from vertical.datasets import load
from vertical.label_privacy import (
    flip_probability,
    gaussian_epsilon,
    gaussian_noise_multiplier,
    randomized_response,
)


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


@pytest.fixture(scope="module")
def dp_run_resumed(tmp_path_factory):
    """SVRG at ε = 1, one epoch, then ``--resume`` to two: each passive party's transcript of the first
    run is kept aside (``before-resume-<rank>.npz``) before the second writes its own. One job pair
    serves the attack test (both runs' transcripts) and the same-noisy-labels test."""
    out = tmp_path_factory.mktemp("dp-resumed")
    common = ("-n", "3", "-m", "1", "--algorithm", "svrg", "--audit", "--dataset", "breast-cancer",
              "--lam", "0.01", "--label-privacy", "dp", "--epsilon", "1")
    train(out, *common, "--epochs", "1")
    for passive in (1, 2):
        (out / f"audit-{passive}.npz").rename(out / f"before-resume-{passive}.npz")
    train(out, *common, "--epochs", "2", "--resume")
    return out


@pytest.mark.mpi
def test_a_passive_party_learns_no_more_than_randomized_response_allows(dp_run_resumed):
    epsilon = 1.0
    y = load("breast-cancer", seed=0).y_train
    bound = 1 - flip_probability(epsilon)  # 0.73: the best guess of a label from its noisy copy
    for passive in (1, 2):
        for name in (f"before-resume-{passive}.npz", f"audit-{passive}.npz"):  # epoch 1, then epoch 2
            for attack, found in attack_all(dp_run_resumed / name, y).items():
                assert found["accuracy"] < bound + 4 * math.sqrt(bound * (1 - bound) / y.size), (name, attack)


@pytest.mark.mpi
def test_a_resumed_run_releases_the_same_noisy_labels_not_a_second_draw(dp_run_resumed):
    """The curious passive party reads every row's noisy label from the SVRG snapshot's full ϑ (for the
    logistic loss, sign ϑ_i = −ỹ_i whatever the model). Across a --resume it must read the same labels:
    a second draw would give it two noisy copies of each (the 2ε level; 61 % of rows agree at ε = 1)."""
    n = load("breast-cancer", seed=0).n_train
    before = np.sign(full_theta(Transcript.load(dp_run_resumed / "before-resume-1.npz"), n))
    after = np.sign(full_theta(Transcript.load(dp_run_resumed / "audit-1.npz"), n))
    assert np.isin(before, (-1, 1)).all() and np.isin(after, (-1, 1)).all()
    assert np.mean(before == after) == 1.0


def test_the_randomized_response_is_drawn_once_and_kept_in_the_partys_folder(tmp_path):
    y = np.where(np.arange(400) % 3 == 0, 1.0, -1.0)
    ids = np.arange(400, dtype=np.int64)
    fresh = JobPlan.of(RunConfig(dataset="breast-cancer", label_privacy="dp", epsilon=1.0, out=str(tmp_path)))
    resumed = JobPlan.of(RunConfig(dataset="breast-cancer", label_privacy="dp", epsilon=1.0,
                                   out=str(tmp_path), resume=True))
    drawn = noisy_labels(fresh, 0, y, ids)
    assert 0.15 < np.mean(drawn != y) < 0.4  # flipped at 1 / (1 + e): it is a draw
    assert np.array_equal(noisy_labels(resumed, 0, y, ids), drawn)
    other_eps = JobPlan.of(RunConfig(dataset="breast-cancer", label_privacy="dp", epsilon=2.0,
                                     out=str(tmp_path), resume=True))
    with pytest.raises(ValueError, match="not this run's randomized response"):
        noisy_labels(other_eps, 0, y, ids)
    with pytest.raises(ValueError, match="not this run's randomized response"):
        noisy_labels(resumed, 0, y, ids[::-1].copy())
    (tmp_path / "label-dp-0.npz").unlink()
    with pytest.raises(ValueError, match="missing: resuming would draw"):
        noisy_labels(resumed, 0, y, ids)


def test_a_second_fresh_load_of_the_same_labels_reuses_the_draw_and_other_labels_draw_anew(tmp_path):
    """A tool that loads a finished run's plan without resume, or a fresh run over an old one, must not
    make a second draw of the same labels (the next --resume would then train on it: 2ε in all). Other
    labels (or ε) are another release, drawn afresh; a resume refuses a draw of other labels."""
    y = np.where(np.arange(400) % 3 == 0, 1.0, -1.0)
    ids = np.arange(400, dtype=np.int64)
    fresh = JobPlan.of(RunConfig(dataset="breast-cancer", label_privacy="dp", epsilon=1.0, out=str(tmp_path)))
    drawn = noisy_labels(fresh, 0, y, ids)
    assert np.array_equal(noisy_labels(fresh, 0, y, ids), drawn)
    relabelled = -y
    other = noisy_labels(fresh, 0, relabelled, ids)
    assert 0.15 < np.mean(other != relabelled) < 0.4 and not np.array_equal(other, drawn)
    resumed = JobPlan.of(RunConfig(dataset="breast-cancer", label_privacy="dp", epsilon=1.0,
                                   out=str(tmp_path), resume=True))
    with pytest.raises(ValueError, match="not this run's randomized response"):
        noisy_labels(resumed, 0, y, ids)  # the folder now holds the draw of the other labels
    assert np.array_equal(noisy_labels(resumed, 0, relabelled, ids), other)


# ------------------------------------------- --label-privacy he --epsilon: Gaussian noise on gradients


def test_the_noise_multiplier_is_the_smallest_that_meets_epsilon():
    for epsilon, releases in ((1.0, 2), (4.0, 3), (16.0, 1)):
        sigma = gaussian_noise_multiplier(epsilon, 1e-5, releases)
        assert (gaussian_epsilon(sigma, 1e-5, releases) <= epsilon
                < gaussian_epsilon(sigma / 1.01, 1e-5, releases))
        # an independent bound: k Gaussian mechanisms are (k/2σ²)-zCDP, so ε ≤ ρ + 2√(ρ ln(1/δ))
        rho = releases / (2 * sigma**2)
        assert epsilon <= rho + 2 * math.sqrt(rho * math.log(1e5)) * 1.001
    # more releases need more noise, a looser ε less
    assert (gaussian_noise_multiplier(1.0, 1e-5, 4) > gaussian_noise_multiplier(1.0, 1e-5, 2)
            > gaussian_noise_multiplier(4.0, 1e-5, 2))


def test_each_row_is_in_at_most_the_accounted_number_of_batches():
    """PassBatches deals each pass's permutation to the dominators, and the training loop takes
    ⌈segment·n/(m·B)⌉ batches per dominator and segment: no row may be in more batches than
    label_dp_releases, the k of the accounting."""
    from parties.runtime import PassBatches

    n, batch = 455, 64
    for active, epochs, eval_every in ((1, 2.0, 1.0), (2, 2.5, 0.5), (3, 1.0, 0.25)):
        config = RunConfig(parties=4, active=active, batch_size=batch, epochs=epochs, eval_every=eval_every)
        counts = np.zeros(n, dtype=np.int64)
        first_pass = []
        for dominator in range(active):
            first_pass.append(PassBatches(n, batch, active, dominator, seed=7).take((n // batch) // active))
            batches = PassBatches(n, batch, active, dominator, seed=7)
            done = 0.0
            while done < epochs - 1e-9:
                segment = min(eval_every, epochs - done)
                np.add.at(counts, batches.take(math.ceil(segment * n / (active * batch))).ravel(), 1)
                done += segment
        rows = np.concatenate([b.ravel() for b in first_pass])
        assert np.unique(rows).size == rows.size  # one pass: every row at most once, over all dominators
        assert 0 < counts.max() <= label_dp_releases(config, n)


def test_noisy_he_refuses_what_the_accounting_does_not_cover():
    base = dict(dataset="breast-cancer", parties=3, active=1, algorithm="sgd", label_privacy="he",
                batch_size=64, epsilon=1.0, epochs=2.0)
    plan = resolve(RunConfig(**base))
    assert plan.noise_multiplier == pytest.approx(
        gaussian_noise_multiplier(1.0, 1e-5, label_dp_releases(plan.options, 455)))
    for bad, message in ((dict(algorithm="svrg"), "runs --algorithm sgd"),
                         (dict(target_suboptimality=1e-3), "budget only"),
                         (dict(resume=True), "cannot --resume"), (dict(delta=0.0), "--delta"),
                         (dict(epsilon=-1.0), "positive"),
                         (dict(batch_size=256, active=2, parties=4), "a batch per dominator")):
        with pytest.raises(ConfigError, match=message):
            resolve(RunConfig(**{**base, **bad}))
    with pytest.raises(ConfigError, match="--epsilon needs --label-privacy dp, he or dp-theta"):
        validate(RunConfig(dataset="breast-cancer", parties=3, epsilon=1.0))
    with pytest.raises(TypeError):  # σ is derived in the plan: no option can set it, not even a stale one
        RunConfig(**{**base, "noise_multiplier": 0.5})
    assert resolve(RunConfig(**{**base, "epsilon": None})).noise_multiplier is None
    # the noise is on ϑ now (sensitivity 1 whatever the rows): row clipping is gone, refused in one line
    validate(RunConfig(**{**base, "clip_quantile": 1.0}))
    for quantile in (0.95, 0.0):
        with pytest.raises(ConfigError, match=r"--clip-quantile is gone: .*noise to ϑ.*drop the option"):
            validate(RunConfig(**{**base, "clip_quantile": quantile}))
    # an ε so small that σ would not fit the encryption's fixed point is refused, not a "diverged" stop
    with pytest.raises(ConfigError, match="beyond what the encryption's fixed point holds"):
        resolve(RunConfig(**{**base, "epsilon": 1e-6}))


def test_noisy_he_needs_the_logistic_loss_whose_sensitivity_the_noise_is_sized_for():
    """One label moves ϑ by exactly 1 for the logistic loss only: least squares' ϑ = 2(z − y) moves by
    any amount (the noise would cover nothing), so he --epsilon with another loss is refused."""
    base = dict(dataset="breast-cancer", parties=3, active=1, algorithm="sgd", label_privacy="he",
                batch_size=64, epsilon=1.0)
    validate(RunConfig(**{**base, "problem": "nonconvex-logistic"}))  # the same loss, another regularizer
    for problem in ("least-squares", "robust"):
        with pytest.raises(ConfigError, match=f"needs a logistic loss, not --problem {problem}.*exactly 1"):
            validate(RunConfig(**{**base, "problem": problem}))
    validate(RunConfig(**{**base, "problem": "least-squares", "epsilon": None}))  # no noise, no claim
    with pytest.raises(ConfigError, match="does not take --f-star: f\\* is computed from all the labels"):
        validate(RunConfig(**{**base, "f_star": 0.3}))


def test_no_passive_party_reads_f_star_under_label_privacy(tmp_path):
    """f* is a function of all the labels. Under dp the launcher solves no reference; under he a given
    --f-star goes to the leader's own file, never into config.json, which every party reads."""
    import json

    from parties.launch import prepare
    from parties.plan import LEADER_ONLY, leader_view

    common = dict(dataset="breast-cancer", parties=3, active=1, progress=False)
    dp = prepare(RunConfig(**common, label_privacy="dp", epsilon=1.0, out=str(tmp_path / "dp")), echo=False)
    assert dp.f_star is None and json.loads((tmp_path / "dp" / "config.json").read_text())["f_star"] is None
    he = prepare(RunConfig(**common, label_privacy="he", algorithm="sgd", batch_size=64, f_star=0.25,
                           out=str(tmp_path / "he"), party_dir=str(tmp_path / "org{rank}")), echo=False)
    assert he.f_star == 0.25
    shared = (tmp_path / "he" / "config.json").read_text()
    assert "0.25" not in shared and json.loads(shared)["f_star"] is None
    for rank in (1, 2):  # a passive party's view: config.json and its own folder
        assert not (tmp_path / f"org{rank}" / LEADER_ONLY).exists()
        assert leader_view(JobPlan.from_json(shared), rank).f_star is None
    assert leader_view(JobPlan.from_json(shared), 0).f_star == 0.25  # the leader's own file


@pytest.mark.mpi
def test_predict_reads_the_run_as_it_is_and_draws_no_second_randomized_response(tmp_path):
    """``vfl predict RUN`` takes the run's saved plan: its party files where the folder is now (moved
    here), and the randomized response read back, never drawn again over the file a --resume needs."""
    import shutil

    from parties.predict import predict

    first = tmp_path / "first"
    train(first, "-n", "3", "-m", "1", "--algorithm", "sgd", "--dataset", "breast-cancer", "--lam", "0.01",
          "--label-privacy", "dp", "--epsilon", "1", "--epochs", "1")
    run = tmp_path / "moved"
    shutil.move(first, run)
    drawn = (run / "label-dp-0.npz").read_bytes()
    assert predict(run) == 0
    assert (run / "label-dp-0.npz").read_bytes() == drawn
    rows = np.loadtxt(run / "predictions-test.csv", delimiter=",", skiprows=1)
    assert rows.shape == (load("breast-cancer", seed=0).n_test, 4)
