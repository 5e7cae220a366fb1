"""What a rank's pools were given: its environment, torch's intra-op threads, the BLAS pool's threads.

Each rank does what ``parties.rank`` and ``parties.hfl``'s ranks do first (``parties.threads.configure_rank``,
after ``import torch`` with ``--torch``, as an HFL rank has it) and writes ``<out>/rank-<r>.json``.

    mpiexec -n 3 python -m mpi4py tests/mpi_scripts/threads_probe.py --out DIR [--torch]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np  # the BLAS pool is loaded, as in every rank
from mpi4py import MPI

from parties.threads import POOL_VARIABLES, configure_rank


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--torch", action="store_true")
    args = parser.parse_args()
    if args.torch:
        import torch  # loaded before the rank configures its pools, as in parties.hfl's ranks
    decided = configure_rank()
    from threadpoolctl import threadpool_info

    blas = sorted({pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"})
    report = {"decided": decided, "env": {v: os.environ.get(v) for v in POOL_VARIABLES}, "blas": blas}
    if args.torch:
        report["torch"] = torch.get_num_threads()
    np.dot(np.ones(4), np.ones(4))
    rank = MPI.COMM_WORLD.Get_rank()
    Path(args.out, f"rank-{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
