"""Reproductions and benchmarks: configs in, CSV/JSONL + PNG + Markdown out (``experiments/results``).

Before any experiment loads torch, OpenMP's idle threads are told to spin only briefly before they
sleep (``GOMP_SPINCOUNT=10000``, unless the caller set it or ``OMP_WAIT_POLICY``): OpenMP reads its
environment once, when torch loads, so this package's import is the one place that precedes every
experiment's. An in-process simulation keeps every core for torch. With OpenMP's default 300,000 spins
its threads fought the ranks of any MPI job beside it: a FedAvg round took 1.9 s instead of 0.13. Never
spinning (``OMP_WAIT_POLICY=PASSIVE``) cost 0.16 s on the quiet machine; 10,000 spins keep its 0.13 s
and take 0.7 s beside the job (``experiments/results/hfl_busy/table.md``, ``python -m experiments
hfl_busy``).
"""

import os

if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
