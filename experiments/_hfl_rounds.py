"""One process's FedAvg rounds in ``hfl_quick``'s setting, timed, for ``bench_hfl_busy``: each
configuration runs in a process of its own, because OpenMP reads its environment (``OMP_WAIT_POLICY``,
``OMP_NUM_THREADS``) once, when torch loads.

    python -m experiments._hfl_rounds [--rounds 5] [--compute-threads N]

Prints one JSON line: the seconds of each timed round (after one warm-up round), their median and torch's
threads (set as ``hfl_quick`` sets them, ``apply_threads``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments._hfl_rounds", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="rounds timed after the warm-up round")
    p.add_argument("--compute-threads", type=int, default=None, metavar="N",
                   help="as hfl_quick's (default: every CPU this process may use)")
    args = p.parse_args(argv)
    import numpy as np
    import torch

    from experiments import hfl_quick as q
    from horizontal import MLP, FederatedData, FederatedSimulation, FLConfig, make_algorithm, shard_partition
    from vertical.datasets import load

    q.apply_threads(args.compute_threads)
    ds = load("fashion-mnist")
    parts = shard_partition(ds.y_train, q.N_CLIENTS, 2, np.random.default_rng(0))
    data = FederatedData.from_partition(ds.X_train, ds.y_train, parts)
    config = FLConfig(q.N_CLIENTS, q.CLIENTS_PER_ROUND, q.LOCAL_STEPS, q.LR_LOCAL, q.LR_GLOBAL)
    sim = FederatedSimulation(make_algorithm("fedavg"), MLP(ds.n_features, (256, 128), 10), data, config,
                              batch_size=q.BATCH, seed=0)
    sim.step()                                                   # warm-up
    seconds = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        sim.step()
        seconds.append(time.perf_counter() - started)
    result = {"seconds": seconds, "median": statistics.median(seconds), "threads": torch.get_num_threads()}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
