"""``--theta-noise per-row``: one noise draw per row for the whole run, under an identity top.

The claim (``vertical/nn/protection.py``, ``RowNoise``): every release of a row is a label-free
function of earlier releases, plus ``−e_y + n_i`` with the same ``n_i``. So a curious passive party
learns one noisy sample of the label however many passes it watches, and ε is that of one release.
These tests play that party.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from parties.config import ConfigError, RunConfig, validate
from tests.test_runtime import metrics, train
from vertical.nn.protection import RowNoise, sensitivity_of_identity_top

NET = ["--model", "mlp", "--algorithm", "sgd", "-m", "1", "--dataset", "breast-cancer", "--standardize",
       "off", "-B", "16", "--bottom", "*-8-1", "--top", "1", "-n", "3"]


def _releases(noise: RowNoise, labels: np.ndarray, passes: int, rng) -> np.ndarray:
    """What a passive party receives for every row in each of ``passes`` passes under an identity top
    with one logit: σ(z_t) − y + n, z_t drifting as training would (label-free here)."""
    rows = np.arange(labels.size)
    out = []
    for _ in range(passes):
        p = 1 / (1 + np.exp(-rng.normal(0, 1, labels.size)))
        out.append(noise.release((p - labels)[:, None], rows)[:, 0])
    return np.array(out)


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    auc = roc_auc_score(labels, scores)
    return max(auc, 1 - auc)


def test_watching_more_passes_does_not_sharpen_a_row_s_label_as_fresh_noise_would():
    """The attacker's best statistic, a row's mean release over the passes: with per-row noise its AUC
    stays that of one release; fresh noise of the same std averages away over 16 passes."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 4000).astype(float)
    noise = RowNoise.drawn(labels.size, 1, noise_multiplier=2.0, rng=rng)
    assert noise.std == 2.0 * sensitivity_of_identity_top(1)
    one = _auc(-_releases(noise, labels, 1, rng).mean(axis=0), labels)
    many = _auc(-_releases(noise, labels, 16, rng).mean(axis=0), labels)
    assert abs(many - one) < 0.03 and many < 0.66
    fresh = [RowNoise.drawn(labels.size, 1, noise_multiplier=2.0, rng=rng) for _ in range(16)]
    averaged = np.mean([_releases(f, labels, 1, rng)[0] for f in fresh], axis=0)
    assert _auc(-averaged, labels) > 0.9  # the same std drawn afresh every pass: the label shows


def test_a_row_keeps_its_noise_and_the_softmax_sensitivity_is_root_two():
    noise = RowNoise.drawn(50, 3, noise_multiplier=1.5, rng=np.random.default_rng(1))
    rows = np.array([7, 7, 9])
    released = noise.release(np.zeros((3, 3)), rows)
    assert np.array_equal(released[0], released[1]) and not np.array_equal(released[0], released[2])
    assert noise.std == pytest.approx(1.5 * np.sqrt(2))


def test_per_row_noise_is_refused_where_its_argument_does_not_hold():
    base = {"model": "mlp", "algorithm": "sgd", "active": 1, "parties": 3, "theta_noise": "per-row"}
    with pytest.raises(ConfigError, match="needs --label-privacy dp-theta"):
        validate(RunConfig(**base))
    with pytest.raises(ConfigError, match="needs an identity top"):
        validate(RunConfig(**base, label_privacy="dp-theta", epsilon=1.0, top="*-8-*"))
    validate(RunConfig(**base, label_privacy="dp-theta", epsilon=1.0, bottom="*-8-1", top="1"))


def with_sampling_error(auc: float, positives: int, negatives: int) -> float:
    """``auc`` plus three standard errors of an AUC measured on this many rows (Hanley and McNeil):
    where an attack's expected AUC is ``auc``, a measured one stays below this but for 0.1 % of runs."""
    q1, q2 = auc / (2 - auc), 2 * auc * auc / (1 + auc)
    var = auc * (1 - auc) + (positives - 1) * (q1 - auc * auc) + (negatives - 1) * (q2 - auc * auc)
    return auc + 3 * float(np.sqrt(var / (positives * negatives)))


def one_release_auc_ceiling(sigma: float, positives: int, negatives: int) -> float:
    """The most AUC one Gaussian release of noise multiplier σ lets any attack expect on a one-logit ϑ
    (labels one apart, noise σ: Φ(1/(σ√2))), with its sampling error on these rows: an attack that stays
    below it read no more than one release."""
    from scipy.stats import norm

    return with_sampling_error(float(norm.cdf(1 / (sigma * np.sqrt(2)))), positives, negatives)


@pytest.mark.mpi
def test_a_real_job_with_per_row_noise_learns_and_its_passive_transcripts_read_near_chance(tmp_path):
    """ε = 2 in one release (σ = 2.15 printed), async with -P 2 (the fresh mode is tested in lock-step):
    the job still learns breast-cancer (majority: 0.63), and on a passive party's transcript of 6 passes
    the direction attack and the projection attack (which averages a row's passes), oriented by 20 known
    labels, read no more than one release allows: AUC ≤ Φ(1/(σ√2)) = 0.63 within three standard errors
    (about 0.71 on these rows; an unprotected run reads ≥ 0.95, tests/test_vertical_nn_runtime.py). CI
    once saw 0.663 on 3 passes against a fixed 0.65, inside this sampling error. The AUC alone might
    not tell per-row from fresh noise (σ(z) blurs both), so the transcript is also checked directly:
    a row's releases differ by less than 1."""
    from experiments.label_attacks import Transcript, judge, theta_batches, theta_direction, theta_projection
    from parties.loading import load_party
    from parties.plan import JobPlan

    proc = train(tmp_path, *NET, "--mode", "async", "-P", "2", "--epochs", "6", "--label-privacy", "dp-theta",
                 "--epsilon", "2", "--theta-noise", "per-row", "--audit")
    assert "one Gaussian draw, added to its every ϑ, of noise multiplier σ = 2.15" in proc.stdout
    assert metrics(tmp_path)[-1]["test_accuracy"] >= 0.75  # 0.80-0.89 in 10 runs but one 0.798
    y = load_party(JobPlan.from_json((Path(tmp_path) / "config.json").read_text()), 0).y
    ceiling = one_release_auc_ceiling(2.15, int(np.sum(y == 1)), int(np.sum(y != 1)))
    assert 0.68 < ceiling < 0.73
    transcript = Transcript.load(tmp_path / "audit-2.npz")
    # the claim itself, on the transcript: a row's releases differ only by σ(z_t) − σ(z_s), inside
    # (−1, 1), where fresh noise of σ = 2.15 would spread each pair's difference by about 3
    seen: dict[int, list[float]] = {}
    for rows, thetas in theta_batches(transcript):
        for row, value in zip(rows.tolist(), thetas[:, 0].tolist(), strict=True):
            seen.setdefault(row, []).append(value)
    twice = [values for values in seen.values() if len(values) >= 2]
    assert len(twice) > 0.9 * y.size and max(max(v) - min(v) for v in twice) < 1.0
    for read in (theta_direction, theta_projection):
        attack = judge(read(transcript, y.size, (np.arange(20), y[:20])), y)
        auc = max(attack["auc"], 1 - attack["auc"])
        assert attack["coverage"] > 0.9 and auc <= ceiling, (read.__name__, attack)
