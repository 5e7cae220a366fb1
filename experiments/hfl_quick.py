"""Smoke experiment for horizontal FL on Fashion-MNIST: round time of the vectorised engine against a
naive per-client loop, then a few rounds of every registered algorithm in the papers' setting.

Setting (the SCAFCOM paper's Section 6): MLP 784-256-128-10, N = 200 clients holding 2 one-class shards
each, S = 20, K = 10, batch 32, float32. The learning rates are fixed, not tuned (η_l = 0.1, η_g = 1), so
the accuracies after a few rounds are a smoke signal, not a reproduction of the papers' figures.

    python -m experiments.hfl_quick [--rounds 5] [--timing-rounds 10] [--compute-threads N]
                                    [--out experiments/results/hfl_quick]

torch's intra-op threads: ``--compute-threads``, else every CPU this process may use (affinity, cgroup
quota), with OpenMP's idle threads spinning only briefly before they sleep (``experiments/__init__.py``):
0.12 s a round on the quiet 2-core machine, and no collapse beside an MPI job (``python -m experiments
hfl_busy``).

Outputs under ``--out``: ``metrics_<algorithm>.{jsonl,csv}``, ``summary.json`` (timing and final metrics).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from horizontal import (
    MLP,
    Algorithm,
    FederatedData,
    FederatedSimulation,
    FLConfig,
    MetricsLog,
    make_algorithm,
    shard_partition,
)
from parties.threads import available_cpus
from protocols.compression import get_compressor
from vertical.datasets import load

N_CLIENTS, CLIENTS_PER_ROUND, LOCAL_STEPS, BATCH = 200, 20, 10, 32
LR_LOCAL, LR_GLOBAL = 0.1, 1.0
#: Seconds per round the engine must stay under, quiet machine (issue 15's goals).
ROUND_TARGET_S = {"fedavg": 0.13, "scaffold": 0.15}


def algorithms() -> dict[str, Callable[[], Algorithm[Any, Any]]]:
    """The paper's comparison, with its reported best α, β and its compressors (Top-1 %, 2-bit dither)."""
    return {
        "fedavg": lambda: make_algorithm("fedavg"),
        "scaffold": lambda: make_algorithm("scaffold"),
        "scaffold-2v": lambda: make_algorithm("scaffold-2v"),
        "scallion": lambda: make_algorithm("scallion", compressor=get_compressor("dithering", bits=2),
                                           alpha=0.1),
        "fedcomgate": lambda: make_algorithm("fedcomgate", compressor=get_compressor("dithering", bits=2)),
        "scafcom": lambda: make_algorithm("scafcom", compressor=get_compressor("top-r", r=0.01), beta=0.2),
        "fed-ef": lambda: make_algorithm("fed-ef", compressor=get_compressor("top-r", r=0.01)),
    }


def apply_threads(override: int | None) -> int:
    """torch's intra-op threads for this one process: ``override``, else the CPUs it may use (its affinity
    cut to its cgroup's quota, ``parties/threads.py``: the rule of a rank alone on its host)."""
    threads = override if override is not None else available_cpus()
    torch.set_num_threads(threads)
    return threads


def positive(text: str) -> int:
    """argparse type: an integer of at least 1 (one line of error otherwise)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer of at least 1 (got {text!r})")
    return int(text)


class NaiveFedAvg:
    """The usual way: one ``torch.nn`` model, clients trained one after another with autograd + SGD."""

    def __init__(self, data: FederatedData, x0: torch.Tensor, seed: int) -> None:
        self.data = data
        self.net = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                                       torch.nn.ReLU(), torch.nn.Linear(128, 10))
        self.x = x0.clone()
        self.generator = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        clients = torch.randperm(N_CLIENTS, generator=self.generator)[:CLIENTS_PER_ROUND]
        deltas = []
        for i in clients.tolist():
            X, y = self.data.client(i)
            torch.nn.utils.vector_to_parameters(self.x, self.net.parameters())
            optimizer = torch.optim.SGD(self.net.parameters(), lr=LR_LOCAL)
            for _ in range(LOCAL_STEPS):
                rows = torch.randint(0, X.shape[0], (BATCH,), generator=self.generator)
                loss = torch.nn.functional.cross_entropy(self.net(X[rows]), y[rows])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            deltas.append(torch.nn.utils.parameters_to_vector(self.net.parameters()).detach() - self.x)
        self.x += LR_GLOBAL * torch.stack(deltas).mean(dim=0)


def time_rounds(steppers: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds per round of each stepper, interleaved round by round so that load from other
    processes on the machine hits all of them alike."""
    for step in steppers.values():
        step()                                                   # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in steppers}
    for _ in range(rounds):
        for name, step in steppers.items():
            started = time.perf_counter()
            step()
            seconds[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in seconds.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5,
                        help="training rounds per algorithm (0: timing only)")
    parser.add_argument("--timing-rounds", type=int, default=10, help="rounds timed per variant (0: skip)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compute-threads", type=positive, default=None, metavar="N",
                        help="torch's intra-op threads (default: every CPU this process may use)")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/hfl_quick"))
    args = parser.parse_args(argv)
    threads = apply_threads(args.compute_threads)

    ds = load("fashion-mnist")
    parts = shard_partition(ds.y_train, N_CLIENTS, 2, np.random.default_rng(args.seed))
    data = FederatedData.from_partition(ds.X_train, ds.y_train, parts)
    test = (torch.as_tensor(ds.X_test), torch.as_tensor(ds.y_test))
    model = MLP(ds.n_features, (256, 128), 10)
    config = FLConfig(N_CLIENTS, CLIENTS_PER_ROUND, LOCAL_STEPS, LR_LOCAL, LR_GLOBAL)
    print(f"Fashion-MNIST {ds.n_train} train / {ds.n_test} test; {model}; N={N_CLIENTS} "
          f"S={CLIENTS_PER_ROUND} K={LOCAL_STEPS} B={BATCH}; torch threads={threads}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '(unset)')}")

    def simulation(name: str) -> FederatedSimulation:
        return FederatedSimulation(algorithms()[name](), model, data, config, batch_size=BATCH,
                                   seed=args.seed, test=test)

    summary: dict[str, Any] = {"setting": {"N": N_CLIENTS, "S": CLIENTS_PER_ROUND, "K": LOCAL_STEPS,
                                           "batch": BATCH, "lr_local": LR_LOCAL, "lr_global": LR_GLOBAL,
                                           "model": repr(model), "seed": args.seed},
                               "torch_threads": threads,
                               "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
                               "gomp_spincount": os.environ.get("GOMP_SPINCOUNT", "")}
    if args.timing_rounds > 0:
        timed = {name: simulation(name) for name in ("fedavg", "scaffold", "scafcom")}
        naive = NaiveFedAvg(data, timed["fedavg"].server.x, args.seed)
        steppers = {f"vectorised {name}": sim.step for name, sim in timed.items()}
        steppers["naive per-client loop fedavg"] = naive.step
        load_before = os.getloadavg()[0]
        seconds = time_rounds(steppers, args.timing_rounds)
        load_after = os.getloadavg()[0]
        summary["seconds_per_round"] = seconds
        summary["load_average_1min"] = {"before": load_before, "after": load_after}
        targets = ", ".join(f"{k} <= {v}" for k, v in ROUND_TARGET_S.items())
        print(f"\nseconds per round (median of {args.timing_rounds}; targets {targets}; "
              f"1-min load average {load_before:.2f} -> {load_after:.2f} on {os.cpu_count()} cores):")
        for name, value in seconds.items():
            print(f"  {name:32s} {value:.3f}")
        speedup = seconds["naive per-client loop fedavg"] / seconds["vectorised fedavg"]
        print(f"  naive / vectorised fedavg: {speedup:.1f}x")

    args.out.mkdir(parents=True, exist_ok=True)
    if args.rounds > 0:
        print(f"\n{args.rounds} rounds each (eta_l={LR_LOCAL}, eta_g={LR_GLOBAL}, untuned):")
        print(f"  {'algorithm':12s} {'train loss':>10s} {'test acc':>9s} {'uplink MB':>10s} {'s/round':>8s}")
        summary["final"] = {}
        for name in algorithms():
            sim = simulation(name)
            with MetricsLog(args.out / f"metrics_{name}.jsonl", args.out / f"metrics_{name}.csv",
                            extra={"algorithm": name}) as log:
                records = sim.run(args.rounds, eval_every=args.rounds, log=log, progress=True)
            last = records[-1]
            seconds_per_round = statistics.median(r["round_seconds"] for r in records)
            summary["final"][name] = {**sim.algorithm.describe(), **last,
                                      "median_round_seconds": seconds_per_round}
            print(f"  {name:12s} {last['train_loss']:10.4f} {last['test_accuracy']:9.4f} "
                  f"{last['uplink_bits'] / 8e6:10.2f} {seconds_per_round:8.3f}")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(f"\nwrote {args.out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
