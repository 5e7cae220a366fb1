"""Threads per rank: the CPUs a process really has (affinity, cgroup quota), shared by the ranks on its host.

The rule and its inputs are checked on made-up affinity masks and cgroup trees, the affinity also for real
(a process pinned to one CPU); then real ranks under ``mpiexec`` show that what the launcher decided is
what their environment, torch and the BLAS pool hold, with and without ``--compute-threads``, and when
no launcher decided (a rank across hosts takes its own host's share); and a real ``vfl train`` job
reports the threads its leader ran with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parties import threads
from parties.launch import rank_threads
from tests.conftest import REPO_ROOT, run_mpi

PROBE = "tests/mpi_scripts/threads_probe.py"


@pytest.mark.parametrize(("cpus", "ranks", "expected"),
                         [(2, 4, 1), (8, 4, 2), (8, 3, 2), (1, 1, 1), (16, 1, 16), (4, 0, 4), (3, 5, 1)])
def test_threads_per_rank_never_exceed_the_cpus_shared(cpus, ranks, expected):
    assert threads.per_rank(cpus, ranks) == expected


def _cgroup_v2(tmp_path: Path, limits: dict[str, str]) -> tuple[Path, Path]:
    """A cgroup v2 tree with ``cpu.max`` files at the given paths, and a /proc/self/cgroup naming
    the deepest of them as this process's."""
    root = tmp_path / "cgroup"
    for path, text in limits.items():
        folder = root / path.strip("/")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "cpu.max").write_text(text + "\n")
    membership = tmp_path / "self-cgroup"
    membership.write_text(f"0::{max(limits, key=len)}\n")
    return root, membership


def test_available_cpus_is_the_affinity_cut_to_the_cgroup_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    none = tmp_path / "absent"
    assert threads.available_cpus(none, none) == 8  # no cgroup to read: the affinity alone
    root, membership = _cgroup_v2(tmp_path / "a", {"/": "max 100000", "/job": "250000 100000"})
    assert threads.cgroup_cpu_limit(root, membership) == 2.5
    assert threads.available_cpus(root, membership) == 2  # whole CPUs: 2.5 would be throttled at 3
    root, membership = _cgroup_v2(tmp_path / "b", {"/": "150000 100000", "/job": "max 100000"})
    assert threads.available_cpus(root, membership) == 1  # a container's limit at its root counts
    root, membership = _cgroup_v2(tmp_path / "c", {"/job": "50000 100000"})
    assert threads.available_cpus(root, membership) == 1  # half a CPU: still one thread
    root, membership = _cgroup_v2(tmp_path / "d", {"/job": "max 100000"})
    assert threads.available_cpus(root, membership) == 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    root, membership = _cgroup_v2(tmp_path / "e", {"/job": "400000 100000"})
    assert threads.available_cpus(root, membership) == 1  # pinned to one CPU: the quota cannot add any


def test_cgroup_v1_quota_is_read_too(tmp_path):
    folder = tmp_path / "cgroup" / "cpu,cpuacct" / "slurm" / "job_7"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text("300000\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    membership = tmp_path / "self-cgroup"
    membership.write_text("4:memory:/slurm/job_7\n3:cpu,cpuacct:/slurm/job_7\n")
    assert threads.cgroup_cpu_limit(tmp_path / "cgroup", membership) == 3.0
    (folder / "cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert threads.cgroup_cpu_limit(tmp_path / "cgroup", membership) is None


def test_a_process_pinned_to_one_cpu_counts_one():
    """Real affinity, not a stand-in: a child pins itself to its first CPU (``taskset`` does the same)."""
    code = ("import os; from parties.threads import available_cpus; "
            "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); print(available_cpus())")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                          capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.strip() == "1"


def test_the_launchers_decide_this_hosts_share_or_the_override():
    share = threads.per_rank(threads.available_cpus(), 3)
    env = rank_threads(3, None)
    assert {env[v] for v in threads.POOL_VARIABLES} == {str(share)} and env[threads.DECIDED] == str(share)
    assert rank_threads(3, 5)[threads.DECIDED] == "5"  # --compute-threads N: the user's to choose
    across = {"HYDRA_HOST_FILE": "/somewhere/hosts"}
    assert rank_threads(3, None, across) == {}  # other hosts' CPUs: each rank decides on its own host
    assert rank_threads(3, 2, across)["OMP_NUM_THREADS"] == "2"
    with pytest.raises(ValueError, match="at least 1"):
        threads.pool_environment(0)


def _probe(tmp_path: Path, env: dict[str, str], *torch: str) -> list[dict]:
    run_mpi(3, [PROBE, "--out", str(tmp_path), *torch], env=env, timeout=180)
    return [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(3)]


@pytest.mark.mpi
@pytest.mark.parametrize("override", [None, 2])
def test_real_ranks_hold_the_threads_the_launcher_decided(tmp_path, monkeypatch, override):
    """Three ranks with the environment ``vfl train`` and ``python -m parties.hfl`` give them: torch's
    intra-op threads, the BLAS pool and every pool variable are the decided number."""
    pytest.importorskip("torch")
    for variable in (*threads.POOL_VARIABLES, threads.DECIDED):
        monkeypatch.delenv(variable, raising=False)
    decided = override or threads.per_rank(threads.available_cpus(), 3)
    for report in _probe(tmp_path, rank_threads(3, override), "--torch"):
        assert report["decided"] == decided and report["torch"] == decided
        assert report["blas"] == [decided]
        assert set(report["env"].values()) == {str(decided)}


@pytest.mark.mpi
def test_a_rank_no_launcher_sized_takes_its_own_hosts_share(tmp_path, monkeypatch):
    """Across hosts the launcher leaves the pools alone; each rank divides its host's CPUs by the ranks
    Hydra says share that host, and shrinks the BLAS pool already loaded to that."""
    for variable in (*threads.POOL_VARIABLES, threads.DECIDED):
        monkeypatch.delenv(variable, raising=False)
    share = threads.per_rank(threads.available_cpus(), 3)
    for report in _probe(tmp_path, {}):
        assert report["decided"] == share and report["blas"] == [share]


@pytest.mark.mpi
def test_a_vfl_job_reports_the_threads_its_leader_ran_with(tmp_path):
    """``vfl train`` as a user runs it (q = 3 on this host): ``result.json`` says the threads its ranks
    were given, this host's share; ``--compute-threads`` sets them."""
    from tests.test_runtime import CANCER, train

    train(tmp_path / "default", "-n", "3", "-m", "1", "--epochs", "0.2", "--eval-every", "0.2", *CANCER)
    result = json.loads((tmp_path / "default" / "result.json").read_text())
    assert result["compute_threads"] == threads.per_rank(threads.available_cpus(), 3)
    train(tmp_path / "two", "-n", "3", "-m", "1", "--epochs", "0.2", "--eval-every", "0.2",
          "--compute-threads", "2", *CANCER)
    assert json.loads((tmp_path / "two" / "result.json").read_text())["compute_threads"] == 2
