"""``--piggyback`` against plain dispatch: time per dominated update, side by side with a serial run.

Piggybacking sends each step's (ϑ, i) inside the dominator's next aggregation request, so a step costs
3(q − 1) messages instead of 4(q − 1) (``protocols/dispatch.py``). On one machine a message costs CPU
in both the sender's and the receiver's MPI progress and in the receiver's Python dispatch; the
question is how much of a B = 1 step that is. Measured here, in one script:

* real ``vfl train`` jobs (a9a, q = 4, all parties active as in the per-update figure of
  experiments/results/README.md, SGD, B = 1 by default), plain and piggybacked **alternating**, so
  that a change of load hits both alike; per job: training time / dominated updates;
* the same SGD rules serially in one process (no messages at all), per update, for the federation's
  cost (the issue's B = 1 goal is ≤ 0.2 ms per dominated update).

    python -m experiments piggyback [--dataset a9a] [--repeats 5] [--epochs 0.25] [--batch-size 1]

Outputs in ``experiments/results/piggyback/``: ``results.json`` (every job, load average, CPU model),
``table.md`` and ``per_update.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from experiments._machine import cpu_model
from experiments._plotting import repetitions_figure
from experiments._vfb2_runner import run_job
from parties.config import RunConfig
from vertical.algorithms.serial import run_serial
from vertical.datasets import load
from vertical.partition import random_blocks
from vertical.problems import get_problem

OUT = Path(__file__).resolve().parent / "results" / "piggyback"
#: variant -> (colour, RunConfig options)
VARIANTS = {"plain": ("tab:blue", {}), "piggyback": ("tab:green", {"piggyback": True})}
SERIAL_COLOUR = "tab:gray"


def serial_ms_per_update(dataset: str, parties: int, gamma: float, epochs: float, batch_size: int,
                         data_dir: str | None) -> float:
    """Milliseconds per update of the same SGD rules over the same number of blocks in one process."""
    ds = load(dataset, seed=0, data_dir=data_dir)
    blocks = random_blocks(ds.n_features, parties, seed=0)
    problem = get_problem("logistic", lam=1e-4)
    started = time.perf_counter()
    run_serial(problem, ds.X_train, ds.y_train, blocks, "sgd", gamma, max(1, round(epochs)), seed=0,
               batch_size=batch_size)
    steps = max(1, round(epochs)) * max(1, ds.n_train // batch_size)
    return 1e3 * (time.perf_counter() - started) / steps


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments piggyback", description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="a9a")
    p.add_argument("--parties", type=int, default=4)
    p.add_argument("--active", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--gamma", type=float, default=0.05)
    p.add_argument("--epochs", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)

    load_before = os.getloadavg()
    ms: dict[str, list[float]] = {name: [] for name in VARIANTS}
    jobs = []
    for rep in range(args.repeats):
        for name, (_, options) in VARIANTS.items():
            config = RunConfig(parties=args.parties, active=args.active, dataset=args.dataset,
                               data_dir=args.data_dir, algorithm="sgd", gamma=args.gamma, epochs=args.epochs,
                               eval_every=args.epochs, batch_size=args.batch_size, seed=rep,
                               reference=False, **options)
            result = run_job(config, f"{name}-{rep}")
            ms[name].append(1e3 * result.train_time / result.updates)
            jobs.append({"variant": name, "repetition": rep, "updates": result.updates,
                         "train_time": result.train_time, "ms_per_update": ms[name][-1],
                         "loss": result.final.get("loss"), **result.extra})
            print(f"[piggyback] rep {rep} {name}: {ms[name][-1]:.3f} ms per dominated update", flush=True)
    serial = serial_ms_per_update(args.dataset, args.parties, args.gamma, 1.0, args.batch_size, args.data_dir)
    ratios = [b / a for a, b in zip(ms["plain"], ms["piggyback"], strict=True)]
    summary = {
        "command": "python -m experiments piggyback " + " ".join(argv or []),
        "load_before": load_before, "load_after": os.getloadavg(), "cpu": cpu_model(),
        "dataset": args.dataset, "parties": args.parties, "active": args.active,
        "batch_size": args.batch_size, "epochs": args.epochs, "jobs": jobs,
        "ms_per_update": ms, "median_ms": {k: float(np.median(v)) for k, v in ms.items()},
        "piggyback_over_plain": ratios, "median_ratio": float(np.median(ratios)),
        "serial_ms_per_update": serial,
    }
    write(summary, args.out)
    return summary


def write(summary: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    ms, serial = summary["ms_per_update"], summary["serial_ms_per_update"]
    lines = [f"`{summary['command'].strip()}` — {summary['dataset']}, q = {summary['parties']}, "
             f"m = {summary['active']}, SGD, B = {summary['batch_size']}; load "
             f"{summary['load_before'][0]:.1f} → {summary['load_after'][0]:.1f}, {summary['cpu']}", "",
             "| | ms per dominated update, median (min–max) | / serial |", "|---|---|---|"]
    for name, values in ms.items():
        lines.append(f"| {name} | {np.median(values):.3f} ({min(values):.3f}–{max(values):.3f}) | "
                     f"{np.median(values) / serial:.1f}× |")
    lines += [f"| serial, one process | {serial:.4f} | 1× |", "",
              f"piggyback / plain, per repetition: {summary['median_ratio']:.2f} at the median "
              f"({min(summary['piggyback_over_plain']):.2f}–{max(summary['piggyback_over_plain']):.2f})"]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    series = {name: (VARIANTS[name][0], values) for name, values in ms.items()}
    repetitions_figure(out / "per_update.png", series,
                       title=f"--piggyback on {summary['dataset']}, q = {summary['parties']}, "
                             f"B = {summary['batch_size']}",
                       reference=("serial (one process)", SERIAL_COLOUR, serial))
    print("\n".join(lines))
