"""``vfl serve`` of a run trained with ``--secure-channels``: served sealed, and a forged frame is named.

The served scores must be ``vfl predict``'s; the frames between parties are sealed under the run's keys
on planes of the service's own (``parties/serving/sealing.py``), so a tampered request or
acknowledgement ends the service naming its sender (``tests/mpi_scripts/serve_federation.py``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO_ROOT, run_mpi
from tests.test_export import ok
from tests.test_serving import ENV, Service, vfl

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def sealed_run(tmp_path_factory) -> Path:
    """A q = 3 run trained with ``--secure-channels``, each party's key and block in its own folder."""
    base = tmp_path_factory.mktemp("sealed")
    out = base / "run"
    vfl("train", "--out", str(out), "--no-progress", "-n", "3", "-m", "1", "--algorithm", "svrg",
        "--secure-channels", "--party-dir", str(base / "org{rank}" / "model"), "--epochs", "1",
        "--dataset", "breast-cancer", "--problem", "logistic", "--lam", "0.1", "--gamma", "0.02",
        timeout=240)
    return out


def test_a_sealed_run_is_served_sealed_with_vfl_predicts_scores(sealed_run):
    out = sealed_run
    assert "sealed channels" in ok("predict", str(out))  # vfl predict seals its sums too
    table = np.loadtxt(out / "predictions-test.csv", delimiter=",", skiprows=1)
    served = Service(out)
    try:
        assert "sealed channels" in "".join(served.lines)
        assert served.health()["sealed"] is True
        ids = table[:, 0].astype(int).tolist()
        status, body = served.post({"ids": ids, "output": "score"})
        assert status == 200 and [r["id"] for r in body["results"]] == ids
        np.testing.assert_allclose([r["score"] for r in body["results"]], table[:, 1], atol=1e-6)
        served.proc.send_signal(signal.SIGTERM)
        assert served.end() == 0  # the sealed STOP reached every party
    finally:
        if served.proc.poll() is None:
            served.proc.kill()


@pytest.mark.parametrize("scenario, names", [
    ("tampered-request", ["[party 1] party 0 sent an invalid sealed message: authentication failed",
                          "[party 2] party 0 sent an invalid sealed message: authentication failed"]),
    ("tampered-ack", ["[party 0] party 2 sent an invalid sealed message: authentication failed"]),
])
def test_a_tampered_serving_frame_is_refused_naming_its_sender(scenario, names):
    """A flipped bit, or a frame sealed for training's data plane, never opens as a serving frame."""
    proc = run_mpi(3, ["tests/mpi_scripts/serve_federation.py", scenario], timeout=60)
    for line in names:
        assert line in proc.stdout, proc.stdout + proc.stderr


def test_a_party_without_its_channel_key_ends_the_start_in_one_line_naming_it(sealed_run):
    key = sealed_run.parent / "org2" / "model" / "party-2.channel.key"
    hidden = key.rename(key.with_suffix(".away"))
    try:
        proc = subprocess.run([sys.executable, "-m", "vfl.cli", "serve", str(sealed_run), "--port", "0"],
                              cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    finally:
        hidden.rename(key)
    assert proc.returncode == 1 and "listening on" not in proc.stdout
    assert "vfl serve: the service ended: [party 2] cannot load its block, rows or channel key: party 2: " \
           "no private channel key" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
