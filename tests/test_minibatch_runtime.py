"""The runtime with lazy updates, mini-batches and pipelined requests: still VFB², still exactly once.

Lazy kernels are the default only from 10,000 columns a party, so these small jobs ask for them.
"""

from __future__ import annotations

import numpy as np
import pytest

from parties.runtime import TAG_THETA
from tests.test_runtime import CANCER, metrics, train

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize(("algorithm", "gap"), [("svrg", 1e-5), ("saga-scalar", 1e-4)])
def test_lazy_updates_with_two_workers_reach_the_nonf_optimum(algorithm, gap, tmp_path):
    """Eager kernels reach 1e-9 (SVRG) and 2e-5 (SAGA-scalar) on this job in 8 epochs."""
    train(tmp_path, "-n", "3", "-m", "2", "-k", "2", "--algorithm", algorithm, "--epochs", "8", "--updates",
          "lazy", *CANCER)
    assert metrics(tmp_path)[-1]["suboptimality"] < gap


def test_mini_batches_in_flight_are_each_applied_exactly_once(tmp_path):
    batch = 8
    train(tmp_path, "-n", "3", "-m", "2", "--algorithm", "svrg", "--epochs", "8", "--batch-size", str(batch),
          "--inflight", "4", "--updates", "lazy", "--audit", *CANCER[:-2], "--gamma", "0.1")
    assert metrics(tmp_path)[-1]["suboptimality"] < 1e-5
    records = [dict(np.load(tmp_path / f"audit-{r}.npz")) for r in range(3)]
    for collaborator, rec in enumerate(records):
        bounds = np.concatenate([[0], np.cumsum(rec["lengths"])])
        for dominator in (0, 1):
            if dominator == collaborator:
                continue
            mine = np.flatnonzero((rec["sources"] == dominator) & (rec["tags"] == TAG_THETA))
            assert mine.size == int(records[dominator]["sent"]) == rec["applied"][dominator] > 100
            words = [rec["words"][bounds[k]:bounds[k + 1]].view(np.float64) for k in mine]
            assert [int(w[0]) for w in words] == list(range(mine.size))  # in order, none twice
            assert all(int(w[1]) == batch and w.size == 2 + 2 * batch for w in words)
