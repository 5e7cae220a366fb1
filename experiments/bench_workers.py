"""Intra-party parallelism: k = 1 vs k = 2 worker threads applying (ϑ, i) to one shared block.

What the runtime's workers do, without the network: two streams of collaborative updates (as from
two dominators) are applied to the same block ``w`` lock-free, either by one thread (both streams in
turn) or by two threads (one stream each), in batches as the workers drain their queues. The kernels
release the GIL, so two threads can overlap on two cores. Both variants apply the same number of
updates; the ratio of their rates is the figure (design target ≥ 1.6x).

    python -m experiments workers [--dataset a9a] [--updates 400000] [--batch 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import numpy as np

from vertical.algorithms.vfb2 import Block, get_rule
from vertical.datasets import load
from vertical.problems import get_problem

OUT = Path(__file__).resolve().parent / "results" / "workers"


def _streams(n_rows: int, updates: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, n_rows, size=updates // 2), rng.normal(scale=0.1, size=updates // 2))
            for _ in range(2)]


def _apply(rule, w: np.ndarray, rows: np.ndarray, thetas: np.ndarray, batch: int, writer: int = 1) -> None:
    for start in range(0, rows.size, batch):
        rule.apply(w, rows[start:start + batch], thetas[start:start + batch], writer=writer)


def _rate(rule, n_cols: int, streams, batch: int, threads: int) -> float:
    w = np.zeros(n_cols)
    started = time.perf_counter()
    if threads == 1:
        for rows, thetas in streams:
            _apply(rule, w, rows, thetas, batch)
    else:
        workers = [threading.Thread(target=_apply, args=(rule, w, rows, thetas, batch, k + 1))
                   for k, (rows, thetas) in enumerate(streams)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    return sum(r.size for r, _ in streams) / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="a9a")
    parser.add_argument("--algorithm", default="sgd")
    parser.add_argument("--updates", type=int, default=400_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lam", type=float, default=1e-4, help="0: sparse updates only (no dense λ∇g)")
    args = parser.parse_args(argv)

    ds = load(args.dataset, seed=0)
    problem = get_problem("logistic", lam=args.lam)
    block = Block.from_matrix(ds.X_train)  # the whole feature set as one party's block: the heaviest case
    rule = get_rule(args.algorithm)(block, problem.regularizer, problem.lam, gamma=1e-3, writers=3)
    if rule.needs_snapshot:
        rule.snapshot(np.zeros(block.n_rows))
    if rule.needs_initial_pass:
        rule.initialize(np.zeros(block.n_rows), np.zeros(block.n_cols))
    streams = _streams(block.n_rows, args.updates, seed=1)
    _rate(rule, block.n_cols, _streams(block.n_rows, 2048, seed=2), args.batch, 2)  # JIT warm-up
    rates = {1: [], 2: []}
    for _ in range(args.repeats):  # interleaved, so load changes hit both alike
        for k in (1, 2):
            rates[k].append(_rate(rule, block.n_cols, streams, args.batch, k))
    med = {k: float(np.median(v)) for k, v in rates.items()}
    ratio = med[2] / med[1]
    result = {"dataset": args.dataset, "algorithm": args.algorithm, "n_cols": block.n_cols,
              "batch": args.batch, "updates": args.updates, "updates_per_s": rates, "k2_over_k1": ratio}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "workers.json").write_text(json.dumps(result, indent=2) + "\n")
    table = (f"Worker threads applying (ϑ, i) to one shared block ({args.dataset}, all {block.n_cols} "
             f"features, VFB²-{args.algorithm} kernel, λ = {args.lam:g}, batches of {args.batch}, "
             f"{args.updates:,} updates, median of {args.repeats} interleaved repeats). "
             f"Command: `python -m experiments workers --lam {args.lam:g}`.\n\n"
             f"| k | updates/s |\n|---|---|\n| 1 | {med[1]:,.0f} |\n| 2 | {med[2]:,.0f} |\n"
             f"| **k = 2 / k = 1** | **{ratio:.2f}x** |\n")
    (OUT / "workers.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
