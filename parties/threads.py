"""How many threads each process's numerical pools get: the CPUs it may really use, shared by the ranks
on its host, never more.

Why: every pool sizes itself from the machine's cores by default (torch's intra-op threads, numpy's
OpenBLAS, OpenMP, numba), as if its process were alone. With several MPI ranks on a host each pool then
fights the other ranks for the same cores, and the pools' threads spin against one another: an HFL
FedAvg round took 1.25 s with torch's 2 intra-op threads beside the MPI ranks and 0.216 s with one
(2-core machine); the NonF solve of breast-cancer took 0.04–2.8 s with OpenBLAS's 2 threads on a loaded
machine and 0.03–0.1 s with one (``python -m experiments startup``).

The rule: ``threads per rank = max(1, available CPUs // ranks on this host)``, where the available CPUs
are this process's affinity mask, cut to its cgroup's CPU quota (:func:`available_cpus`). A launcher
decides it for the ranks it starts on its own host (:func:`launcher_environment`) and hands it to them in
the environment: OpenBLAS, MKL and OpenMP read their variables once, when their library loads, and numba
reads ``NUMBA_NUM_THREADS`` when it is imported, so only the environment of a new process can size them.
Each rank then applies it to what must be set in the process (:func:`configure_rank`): torch's intra-op
threads; and, in a rank started without those variables (across hosts, where the launcher cannot see the
other hosts' CPUs, or by hand), the BLAS/OpenMP pools already loaded, from its own host's CPUs and ranks.
``--compute-threads N`` (``vfl train``, ``python -m parties.hfl``) overrides the rule.

``numba.set_num_threads`` is not called: it starts numba's own thread pool, which the VFB² kernels never
use (they run in the party's worker threads, without ``parallel=True``); ``NUMBA_NUM_THREADS`` bounds
that pool should a kernel ever use it.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path

#: The decided threads per rank, from the launcher to its ranks (what :func:`configure_rank` applies).
DECIDED = "VFL_COMPUTE_THREADS"
#: What the pools read when they load: OpenMP (torch's intra-op pool too), OpenBLAS, MKL, numba.
POOL_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
#: Hydra (MPICH's mpiexec) tells each rank how many ranks share its host.
LOCAL_RANKS = "MPI_LOCALNRANKS"

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, membership: Path = PROC_CGROUP) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (``quota / period``), the smallest along its path up
    to ``root`` (a container's own limit may sit at its root); None when there is none or it cannot be
    read. cgroup v2 (``cpu.max``: ``max 100000`` or ``150000 100000``) and v1 (``cpu.cfs_quota_us``,
    ``-1`` for none, over ``cpu.cfs_period_us``)."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "":  # v2: one unified hierarchy
            limits += [_v2_limit(folder) for folder in _up_to(root, path)]
        elif "cpu" in controllers.split(","):
            for mount in (root / "cpu", root / "cpu,cpuacct", root / controllers):
                limits += [_v1_limit(folder) for folder in _up_to(mount, path)]
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def _up_to(root: Path, path: str) -> list[Path]:
    """``root/path`` and each folder above it, up to ``root`` itself."""
    parts = [p for p in path.strip("/").split("/") if p and p != ".."]
    return [root.joinpath(*parts[:k]) for k in range(len(parts), -1, -1)]


def _v2_limit(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_limit(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def available_cpus(root: Path = CGROUP_ROOT, membership: Path = PROC_CGROUP) -> int:
    """The CPUs this process may run on: its affinity mask (``taskset``, a batch system's binding), cut to
    its cgroup's CPU quota (whole CPUs, at least one)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_limit(root, membership)
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return max(1, cpus)


def per_rank(cpus: int, ranks: int) -> int:
    """Threads for each of ``ranks`` processes sharing ``cpus``: ``max(1, cpus // ranks)``."""
    return max(1, cpus // max(1, ranks))


def pool_environment(threads: int) -> dict[str, str]:
    """The variables that size every pool of a new process to ``threads``, and :data:`DECIDED`."""
    if threads < 1:
        raise ValueError(f"threads must be at least 1 (got {threads})")
    return {**dict.fromkeys(POOL_VARIABLES, str(threads)), DECIDED: str(threads)}


def launcher_environment(ranks_here: int, override: int | None = None) -> dict[str, str]:
    """What a launcher adds to the environment of the ``ranks_here`` ranks it starts on its own host:
    :func:`pool_environment` of ``override``, else of :func:`per_rank` of this host's CPUs."""
    return pool_environment(override if override is not None else per_rank(available_cpus(), ranks_here))


def configure_rank(environ: Mapping[str, str] = os.environ) -> int:
    """In a rank, early (before any pool does work): the threads its launcher decided (:data:`DECIDED`),
    or, when it decided none, this host's share (:func:`per_rank` of :func:`available_cpus` over
    Hydra's :data:`LOCAL_RANKS`); applied to torch if it is loaded, and to the BLAS/OpenMP pools already
    loaded when the environment did not size them. Returns the threads."""
    decided, local = environ.get(DECIDED, ""), environ.get(LOCAL_RANKS, "")
    if decided.isdigit() and int(decided) > 0:
        threads = int(decided)
    else:
        threads = per_rank(available_cpus(), int(local) if local.isdigit() else 1)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    if environ.get("OPENBLAS_NUM_THREADS") != str(threads) and "numpy" in sys.modules:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=threads)  # kept for the life of the process
    global _configured
    _configured = threads
    return threads


_configured: int | None = None


def configured() -> int | None:
    """The threads :func:`configure_rank` gave this process's pools (None: it was not called): what a
    run reports with its results (``result.json``'s ``compute_threads``)."""
    return _configured


#: Below this many matrix entries a BLAS call takes well under a millisecond on one core, less than a
#: second thread costs to wake and join, and far less when the machine is busy (the NonF solve above).
SMALL_WORK = 1 << 20


def pools_for(entries: int):
    """A context in which the BLAS/OpenMP pools work on a matrix of ``entries``: one thread below
    :data:`SMALL_WORK`, as they are otherwise (the launcher's NonF solve)."""
    if entries >= SMALL_WORK:
        return contextlib.nullcontext()
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1)
