"""A rank that finished leaves quickly (``parties.lifecycle.exit_now``) and the job still exits 0.

Hydra's proxy takes a rank whose process ends in the wrong way after ``MPI_Finalize`` for a crash and
SIGKILLs the others: with ``os._exit`` that happened to 10-30 % of 3-rank jobs here, and CI saw
finished training jobs fail with "Killed (signal 9)". Thirty jobs that do nothing but exchange once
and leave: with the old exit, all thirty passing had a chance under 1 %. They run three at a time (each
job is mostly start-up waits: half the wall time of one after another, and a busier machine for each).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import run_mpi

SCRIPT = """
from mpi4py import MPI
import numpy as np
from parties.lifecycle import exit_now
x = np.ones(4)
MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, x)
print(int(x[0]), flush=True)
exit_now()
"""


@pytest.mark.mpi
def test_thirty_jobs_that_leave_with_exit_now_all_exit_zero(tmp_path):
    script = tmp_path / "leave.py"
    script.write_text(SCRIPT)
    with ThreadPoolExecutor(3) as pool:
        codes = list(pool.map(lambda _: run_mpi(3, [str(script)], check=False), range(30)))
    failed = [(p.returncode, p.stdout[-300:]) for p in codes if p.returncode != 0]
    assert not failed, f"{len(failed)} of 30 finished jobs did not exit 0: {failed[0]}"
    wrong = [p.stdout for p in codes if "".join(p.stdout.split()) != "333"]
    assert not wrong, f"a rank did not report the sum of 3 (lines may interleave): {wrong[0]!r}"


def test_a_ranks_exit_path_loads_no_scipy():
    """``parties.lifecycle`` reaches ``protocols`` only for its errors: ``protocols/__init__.py`` loads
    its public names on first use, so the thirty jobs above start ranks without SciPy (half their
    start-up)."""
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    code = "import sys, parties.lifecycle, protocols; print(sorted(m for m in sys.modules if m == 'scipy'))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=True, env={"PYTHONPATH": str(REPO_ROOT), "PATH": ""})
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr
