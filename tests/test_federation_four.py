"""Federation at q = 4 (issue 27's "Done when"): four organisations, each its own ``vfl party`` in its own
network namespace, train the model of the same job under one ``mpiexec``. Kept cheap: breast-cancer,
one epoch, ``--mode sync-global`` (deterministic, so the two runs compare exactly). The helpers are the
q = 3 test's (``tests/test_federation.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT
from tests.test_federation import NAMES_4, free_port, make_orgs, party_hosts, run_parties, write_jobs


@pytest.fixture(scope="module")
def split4(tmp_path_factory):
    """breast-cancer split for four parties (party 0 holds the labels)."""
    from vfl.cli import main

    folder = tmp_path_factory.mktemp("split4")
    assert main(["split", "breast-cancer", "-n", "4", "-m", "1", "--out", str(folder), "--overwrite"]) == 0
    return folder


@pytest.fixture(scope="module")
def hosts4():
    yield from party_hosts(4)


@pytest.mark.mpi
def test_four_organisations_train_the_same_model_as_one_mpiexec(split4, hosts4, tmp_path, record_property):
    places, fallback = hosts4
    if fallback:
        record_property("fallback", fallback)
    orgs = make_orgs(tmp_path, split4, NAMES_4)
    port = 17740 if not fallback else free_port()
    write_jobs(orgs, f"{places[0][1]}:{port}", **{o.name: {"epochs": 1} for o in orgs})
    results = run_parties([org.command("--join-timeout", "60", prefix=place)
                           for org, (place, _) in zip(orgs, places, strict=True)], timeout=240)
    for org, result in zip(orgs, results, strict=True):
        assert result.returncode == 0, f"{org.name}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "joined 4 parties" in results[0].stdout

    out = tmp_path / "one-mpiexec"
    cmd = [sys.executable, "-m", "vfl.cli", "train", "-n", "4", "-m", "1", "--party-files", str(split4),
           "--algorithm", "sgd", "--mode", "sync-global", "--epochs", "1", "-B", "8", "--seed", "0",
           "--secure-channels", "--no-reference", "--no-progress", "--out", str(out)]
    one = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    expected = json.loads((out / "result.json").read_text())
    got = json.loads((orgs[0].run / "result.json").read_text())
    assert got["updates"] == expected["updates"] and got["epochs"] == expected["epochs"] == 1
    assert got["record"]["loss"] == pytest.approx(expected["record"]["loss"], rel=1e-9)
    assert got["record"]["test_accuracy"] == expected["record"]["test_accuracy"] > 0.85
    for org in orgs:   # each folder holds its own block only, and every party got the summary
        blocks = sorted(p.name for p in org.run.glob("party-*.ckpt.npz"))
        assert blocks == [f"party-{org.rank}.ckpt.npz"]
        assert json.loads((org.run / "result.json").read_text())["updates"] == expected["updates"]
