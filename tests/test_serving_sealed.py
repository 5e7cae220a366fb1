"""``vfl serve`` of a run trained with ``--secure-channels``: served sealed, and a forged frame is named.

The served scores must be ``vfl predict``'s; the frames between parties are sealed under the run's keys
on planes of the service's own (``parties/serving/sealing.py``), so a tampered request or
acknowledgement ends the service naming its sender (``tests/mpi_scripts/serve_federation.py``).
"""

from __future__ import annotations

import signal

import numpy as np
import pytest

from tests.conftest import run_mpi
from tests.test_export import ok
from tests.test_serving import Service, vfl

pytestmark = pytest.mark.mpi


def test_a_sealed_run_is_served_sealed_with_vfl_predicts_scores(tmp_path):
    out = tmp_path / "run"
    vfl("train", "--out", str(out), "--no-progress", "-n", "3", "-m", "1", "--algorithm", "svrg",
        "--secure-channels", "--party-dir", str(tmp_path / "org{rank}" / "model"), "--epochs", "1",
        "--dataset", "breast-cancer", "--problem", "logistic", "--lam", "0.1", "--gamma", "0.02",
        timeout=240)
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
