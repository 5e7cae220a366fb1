"""The curious passive party: with plain VFB² it recovers the labels from its own transcript.

This is the leak docs/security.md states; a protected mode must make these same attacks fail (chance level).
The audit records every communicator, so the full-pass ϑ₀ on the control plane is in the transcript.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments.label_attacks import Transcript, attack_all, main
from parties.runtime import AUDIT_CONTROL_WORD, AUDIT_CTRL_AGGREGATION, AUDIT_FULL_THETA, TAG_THETA
from tests.test_runtime import CANCER, train
from vertical.datasets import load

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def plain_svrg(tmp_path_factory):
    out = tmp_path_factory.mktemp("attack")
    train(out, "-n", "3", "-m", "1", "--algorithm", "svrg", "--epochs", "2", "--audit", *CANCER)
    return out


def test_the_audit_records_every_communicator(plain_svrg):
    t = Transcript.load(plain_svrg / "audit-2.npz")
    seen = set(t.tags.tolist())
    assert {TAG_THETA, AUDIT_FULL_THETA, AUDIT_CTRL_AGGREGATION, AUDIT_CONTROL_WORD} <= seen


def test_a_passive_party_recovers_the_labels_of_plain_vfb2(plain_svrg):
    y = load("breast-cancer", seed=0).y_train
    for passive in (1, 2):
        found = attack_all(plain_svrg / f"audit-{passive}.npz", y)
        assert found["full_theta"]["coverage"] == 1.0 and found["full_theta"]["accuracy"] == 1.0
        assert found["theta_sign"]["coverage"] > 0.8 and found["theta_sign"]["accuracy"] == 1.0
        assert found["theta_sign"]["auc"] == 1.0
        assert found["full_theta"]["accuracy"] > found["full_theta"]["majority"] + 0.3
    # the leader itself holds the labels; its transcript has no ϑ from anyone
    assert np.isnan(attack_all(plain_svrg / "audit-0.npz", y)["theta_sign"]["accuracy"])


def test_piggybacked_thetas_leak_the_labels_the_same_way(tmp_path):
    """--piggyback changes how ϑ travels, not what a passive party learns: the sign attack reads it
    out of the requests (an attack that looked only at plain (ϑ, i) messages would see nothing)."""
    train(tmp_path, "-n", "3", "-m", "1", "--algorithm", "sgd", "--epochs", "1", "--piggyback", "--audit",
          *CANCER)
    y = load("breast-cancer", seed=0).y_train
    assert len(Transcript.load(tmp_path / "audit-1.npz").of_tag(TAG_THETA)) <= 1
    found = attack_all(tmp_path / "audit-1.npz", y)
    assert found["theta_sign"]["coverage"] > 0.5 and found["theta_sign"]["accuracy"] == 1.0


def test_the_experiment_leaves_no_run_folder_behind(tmp_path, monkeypatch):
    """Its runs' folders (checkpoints, transcripts) are scratch: only the results stay, in --out."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    out = tmp_path / "results"
    main(["--datasets", "breast-cancer", "--modes", "plain", "--epochs", "1", "--out", str(out)])
    assert list(scratch.iterdir()) == []
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    assert row["mode"] == "plain" and row["full_theta_accuracy"] == 1.0   # the attack ran on a real run
    assert (out / "privacy_utility.png").exists()
