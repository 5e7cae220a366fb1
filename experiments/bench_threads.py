"""Threads per rank (``parties/threads.py``): an HFL job over MPI with this host's share of the CPUs per rank
(the default) against every core per rank (``--compute-threads <cores>``, what torch and OpenBLAS take
by themselves), alternating run by run.

The job: FedAvg, MLP 784-256-128-10 on Fashion-MNIST, N = 200 clients, S = 20, K = 10, B = 32 (the
setting of ``hfl_quick``), one server rank and P = 2 client processes. Each run's number is the median of
its rounds' ``round_seconds`` (the first round left out: it warms the caches).

    python -m experiments threads [--repeats 3] [--rounds 6]

Outputs: ``experiments/results/threads.{csv,md}`` (every run with the load average before and after it).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments._machine import cpu_model
from parties.threads import available_cpus, per_rank

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
PROCESSES = 2
JOB = ["--algorithm", "fedavg", "--dataset", "fashion-mnist", "--model", "mlp", "--clients", "200",
       "--per-round", "20", "--local-steps", "10", "--batch-size", "32", "--eval-every", "100000",
       "-P", str(PROCESSES), "--no-progress"]


def seconds_per_round(rounds: int, threads: int | None) -> float:
    """One job: the median seconds of its rounds after the first."""
    with tempfile.TemporaryDirectory(prefix="threads-") as work:
        extra = [] if threads is None else ["--compute-threads", str(threads)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        shared = ROOT.parent / "shared" / "data"
        if shared.is_dir() and "VFL_DATA_DIR" not in env:
            env["VFL_DATA_DIR"] = str(shared)
        subprocess.run([sys.executable, "-m", "parties.hfl", *JOB, "--rounds", str(rounds), "--out", work,
                        *extra], env=env, check=True, capture_output=True, text=True, timeout=1200)
        records = [json.loads(line) for line in Path(work, "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["round_seconds"] for r in records[1:])


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m experiments threads", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--out", type=Path, default=RESULTS / "threads", help="stem of the .csv and .md")
    args = p.parse_args(argv)
    cores = available_cpus()
    variants = {f"this host's share ({per_rank(cores, PROCESSES + 1)})": None,
                f"every core ({cores}, --compute-threads {cores})": cores}
    runs = []
    for rep in range(args.repeats):
        for name in list(variants) if rep % 2 == 0 else list(reversed(variants)):
            load = os.getloadavg()[0]
            started = time.time()
            seconds = seconds_per_round(args.rounds, variants[name])
            runs.append({"threads": name, "repeat": rep, "seconds_per_round": seconds, "load_before": load,
                         "load_after": os.getloadavg()[0], "job_seconds": time.time() - started})
            print(f"  {name} #{rep}: {seconds:.3f} s per round (load {load:.2f})", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.with_suffix(".csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(runs[0]))
        writer.writeheader()
        writer.writerows(runs)
    rows = ["| threads per rank (3 ranks) | s per FedAvg round, median of runs (min–max) |", "|---|---:|"]
    for name in variants:
        values = [r["seconds_per_round"] for r in runs if r["threads"] == name]
        rows.append(f"| {name} | {statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f}) |")
    loads = [r["load_before"] for r in runs]
    command = "python -m experiments threads " + " ".join(sys.argv[2:] if argv is None else argv)
    rows.append(f"\n{cpu_model()}; 1-min load average {min(loads):.2f}–{max(loads):.2f} before the runs (a "
                f"shared machine). Command: `{command}`; the job: `python -m parties.hfl {' '.join(JOB)} "
                f"--rounds {args.rounds}`.")
    args.out.with_suffix(".md").write_text("\n".join(rows) + "\n")
    print(args.out.with_suffix(".md").read_text())
    return runs


if __name__ == "__main__":
    main()
