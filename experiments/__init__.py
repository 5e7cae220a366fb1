"""Reproductions and benchmarks: configs in, CSV/JSONL + PNG + Markdown out (``experiments/results``).

Before any experiment loads torch, OpenMP's idle threads are told to sleep rather than spin
(``OMP_WAIT_POLICY=PASSIVE``, unless the caller set it): OpenMP reads its environment once, when torch
loads, so this package's import is the one place that precedes every experiment's. An in-process
simulation keeps every core for torch; with OpenMP's default spinning, its threads fought the ranks of
any MPI job beside it and a FedAvg round went from 0.1 s to 1.25-5 s
(``experiments/results/hfl_busy/table.md``, ``python -m experiments hfl_busy``).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
