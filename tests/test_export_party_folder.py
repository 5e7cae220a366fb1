"""``vfl export`` from the folders of a per-organisation run (``vfl party``): each organisation exports
its own part from its own folder and its own data, and the parts score the test rows as the leader
evaluated the model; a folder that lacks what the part needs is refused in one line naming it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from parties.export import combined_scores, read_parts
from tests.test_export import ok, vfl
from tests.test_federation import breast_cancer_orgs, run_parties

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """Three organisations trained a job under ``standardize = "center"``, each in its own folder."""
    orgs, _ = breast_cancer_orgs(tmp_path_factory.mktemp("party-export"), standardize="center")
    results = run_parties([org.command("--join-timeout", "60") for org in orgs], timeout=180)
    for org, result in zip(orgs, results, strict=True):
        assert result.returncode == 0, f"{org.name}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return orgs


def test_each_organisation_exports_its_part_and_the_parts_score_as_the_leader_evaluated(federation, tmp_path):
    from parties.loading import own_party_file, read_own_party

    for org in federation:
        line = ok("export", str(org.run), "--party", str(org.rank), "--data", str(org.data), "--out",
                  str(tmp_path))
        assert f"party {org.rank}: wrote" in line and "center" in line and "epoch 2" in line
    parts = read_parts(tmp_path)
    data = [read_own_party(own_party_file(o.data, o.rank), o.rank == 0, "logistic") for o in federation]
    z = combined_scores(parts, [d.X_test for d in data])  # each part scales its own raw columns
    accuracy = float(np.mean(np.where(z >= 0, 1, -1) == data[0].y_test))
    leader = json.loads((federation[0].run / "result.json").read_text())
    assert leader["epochs"] == 2 and accuracy == pytest.approx(leader["record"]["test_accuracy"], abs=1e-12)
    assert sum(p.n_features for p in parts) == 30 and all(p.standardize == "center" for p in parts)


def test_a_party_folder_without_what_the_part_needs_is_refused_in_one_line(federation, tmp_path):
    bank_b = federation[1]
    cases = [  # (arguments, what the one line must say)
        (["--party", "1"], "pass --data"),
        (["--party", "2", "--data", str(bank_b.data)], "the folder of party 1 (bank-b), not of party 2"),
        (["--party", "3", "--data", str(bank_b.data)], "0..2"),
    ]
    for args, says in cases:
        proc = vfl("export", str(bank_b.run), *args, "--out", str(tmp_path / "parts"))
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    unfinished = tmp_path / "unfinished"
    shutil.copytree(bank_b.run, unfinished)
    (unfinished / "result.json").unlink()  # a run that never ended: the epoch is the leader's to say
    proc = vfl("export", str(unfinished), "--party", "1", "--data", str(bank_b.data), "--out", str(tmp_path))
    assert proc.returncode == 2 and "no result.json" in proc.stderr and "--resume" in proc.stderr
