"""One rank of a ``vfl train`` job with timestamps (``experiments/_startup_probe.py`` starts the ranks with
``-m _startup_rank`` in place of ``-m parties.rank``).

It runs the tree's own ``parties.rank.main`` and notes when this rank's interpreter started, when
``mpi4py``, the rank's modules, its data and its runtime (numba kernels loaded, every party ready) were
there, when training ended, and when ``main`` returned; then it exits as that tree's rank does
(``parties.rank.exit_now`` where the tree has it). Marks: ``$VFL_STARTUP_MARKS-rank<r>.json``, seconds
since ``$VFL_STARTUP_T0``.
"""

from __future__ import annotations

import json
import os
import sys
import time

T0 = float(os.environ["VFL_STARTUP_T0"])
MARKS = {"exec": time.time() - T0}

from mpi4py import MPI  # noqa: E402

MARKS["mpi"] = time.time() - T0

import parties.loading  # noqa: E402
import parties.rank as rank_module  # noqa: E402
import parties.training as training  # noqa: E402


def _after(owner, name: str, mark: str) -> None:
    func = getattr(owner, name)

    def run(*args, **kwargs):
        result = func(*args, **kwargs)
        MARKS[mark] = time.time() - T0
        return result

    setattr(owner, name, run)


def main() -> None:
    MARKS["imported"] = time.time() - T0
    _after(parties.loading, "load_party", "loaded")
    _after(training.PartyRuntime, "__init__", "ready")
    _after(training._Trainer, "run", "trained")
    rank_module.main(sys.argv[1:])
    MARKS["end"] = time.time() - T0
    rank = MPI.COMM_WORLD.Get_rank()
    with open(f"{os.environ['VFL_STARTUP_MARKS']}-rank{rank}.json", "w") as fh:
        json.dump(MARKS, fh)
    if hasattr(rank_module, "exit_now"):
        rank_module.exit_now()


if __name__ == "__main__":
    main()
