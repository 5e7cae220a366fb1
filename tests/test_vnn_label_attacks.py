"""Label leakage of vector ϑ, read from a passive party's transcript: the direction attack recovers the
binary labels of an unprotected split network, and under the protected mode (clipped, calibrated
Gaussian noise on each row's ϑ) the norm and direction attacks are at chance.

The runs are the one-process simulation of ``vertical/nn/simulate.py``; what the passive party received
is written as an ``--audit`` transcript of the runtime's format and read back by the attack suite."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from experiments.label_attacks import (  # noqa: E402
    Transcript,
    attack_all,
    judge,
    model_completion,
    theta_direction,
    theta_projection,
    write_simulated_audit,
)
from parties.runtime import TAG_THETA  # noqa: E402
from tests.conftest import requires_dataset  # noqa: E402
from vertical.datasets import load  # noqa: E402
from vertical.nn.networks import OptimizerSpec, build_split_network  # noqa: E402
from vertical.nn.protection import LabelProtection  # noqa: E402
from vertical.nn.simulate import predict_proba, simulate  # noqa: E402
from vertical.partition import random_blocks  # noqa: E402


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Small layers: one intra-op thread (two spin-waiting threads crawl on a loaded 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _train(ds, bottom, top, *, epochs, batch_size, protection=None, rows=None, seed=0):
    X, y_pm = ds.X_train[:rows], ds.y_train[:rows]
    columns = random_blocks(X.shape[1], 3, seed=seed)
    bottoms, head = build_split_network(X, columns, bottom, top, 2, optimizer=OptimizerSpec("adam", 3e-3),
                                        seed=seed)
    result = simulate(bottoms, head, (y_pm > 0).astype(int), epochs=epochs, batch_size=batch_size,
                      max_staleness=2, seed=seed, protection=protection, record=True)
    accuracy = np.mean(predict_proba(bottoms, head, [ds.X_test[:, c] for c in columns]).argmax(axis=1)
                       == (ds.y_test > 0))
    return result, y_pm, accuracy, bottoms, columns


def test_the_direction_attack_recovers_the_labels_of_an_unprotected_split_network(tmp_path):
    """k = 4, a top with a hidden layer: the passive party's transcript alone, with 5 known labels to
    orient it, gives ≥ 95 % of the labels it saw (the leak the protected mode exists for)."""
    ds = load("breast-cancer", seed=0)
    result, y, _, bottoms, columns = _train(ds, "*-8-4", "4-6-*", epochs=3, batch_size=32)
    path = write_simulated_audit(tmp_path / "audit-1.npz", result.dispatched, rank=1)
    transcript = Transcript.load(path)
    assert set(transcript.tags.tolist()) == {TAG_THETA} and len(transcript.messages) == result.steps
    known = (np.arange(5), y[:5])
    found = attack_all(path, y, known=known)
    assert found["theta_direction"]["coverage"] == 1.0
    assert found["theta_direction"]["accuracy"] >= 0.95, found["theta_direction"]
    assert np.isnan(found["theta_sign"]["accuracy"])     # a k-wide ϑ has no sign to read
    # the model-completion attack: a head on the party's own embeddings of 20 labelled rows
    own = ds.X_train[:, columns[1]]
    known_rows = np.random.default_rng(0).choice(y.size, 20, replace=False)
    completion = judge(model_completion(bottoms[1].embed(own), known_rows, y[known_rows]), y)
    assert completion["auc"] > 0.8


@requires_dataset("a9a")
def test_under_protection_the_gradient_attacks_on_a9a_are_at_chance(tmp_path):
    """a9a (8000 training rows), (ε = 1.5, δ = 1e-5) over 2 passes: the norm and the direction attack
    (with 1 % of the labels known) score AUC ≤ 0.60 either way round, where the same run unprotected
    gives ≥ 95 % of the labels; and the protected model still learns (above the majority class)."""
    full = load("a9a", seed=0)
    ds = dataclasses.replace(full, X_train=full.X_train[:8000], y_train=full.y_train[:8000])
    plain, y, plain_accuracy, _, _ = _train(ds, "*-16-1", "1", epochs=2, batch_size=64)
    protection = LabelProtection.calibrated(1.5, 1e-5, 2, clip=0.5, seed=1)
    noisy, _, noisy_accuracy, _, _ = _train(ds, "*-16-1", "1", epochs=2, batch_size=64,
                                            protection=protection)
    known_rows = np.random.default_rng(0).choice(y.size, y.size // 100, replace=False)
    known = (known_rows, y[known_rows])
    majority = max(np.mean(ds.y_test > 0), np.mean(ds.y_test < 0))
    for result, protected in ((plain, False), (noisy, True)):
        path = write_simulated_audit(tmp_path / f"audit-{protected}.npz", result.dispatched, rank=2)
        found = attack_all(path, y, known=known)
        if protected:
            for attack in ("theta_norm", "theta_direction"):
                auc = found[attack]["auc"]
                assert max(auc, 1 - auc) <= 0.60, (attack, found[attack])
        else:
            assert found["theta_direction"]["accuracy"] >= 0.95
    assert plain_accuracy > majority + 0.05 and noisy_accuracy > majority + 0.01
    assert protection.epsilon(1e-5, 2) <= 1.5


def test_the_direction_attack_orients_itself_without_known_labels_on_a_scalar_theta():
    """k = 1 messages (today's layout) read by the direction attack: the cosine is ±1, and the length
    heuristic turns it the right way on unbalanced labels."""
    rng = np.random.default_rng(0)
    y = np.where(rng.random(400) < 0.2, 1.0, -1.0)
    from vertical.nn.messages import pack

    messages = []
    for seq, batch in enumerate(np.array_split(rng.permutation(400), 10)):
        p = np.where(y[batch] > 0, 0.3, 0.1)               # the minority is fitted worse
        messages.append(pack(seq, batch, (p - (y[batch] > 0)).reshape(-1, 1)))

    class Fake(Transcript):
        def __init__(self):
            pass

        def theta_messages(self):
            return messages

    scores = theta_direction(Fake(), 400)
    assert judge(scores, y)["accuracy"] == 1.0


def test_averaging_the_projections_reads_noisy_one_logit_theta_better_than_the_cosines_vote():
    """Fresh Gaussian noise on a one-logit ϑ = p − y over 6 passes: the cosine keeps each release's sign
    only, so a row's passes vote; the projection attack averages them, as the accountant assumes the
    attacker does, and so reads the labels clearly better. An evaluation with the cosine attack alone
    would overstate the protection."""
    from vertical.nn.messages import pack

    rng = np.random.default_rng(1)
    n = 4000
    y01 = (rng.random(n) < 0.3).astype(float)
    messages, seq = [], 0
    for _ in range(6):
        for batch in np.array_split(rng.permutation(n), 8):
            theta = 0.3 - y01[batch] + rng.normal(0, 3.0, batch.size)
            messages.append(pack(seq, batch, theta.reshape(-1, 1)))
            seq += 1

    class Fake(Transcript):
        def __init__(self):
            pass

        def theta_messages(self):
            return messages

    y = np.where(y01 > 0, 1.0, -1.0)
    known = (np.arange(40), y[:40])
    auc = {attack.__name__: judge(attack(Fake(), n, known), y)["auc"]  # oriented by the known labels
           for attack in (theta_direction, theta_projection)}
    assert auc["theta_projection"] > auc["theta_direction"] + 0.02, auc
    assert auc["theta_projection"] > 0.6, auc
