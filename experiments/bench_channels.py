"""The cost of ``--secure-channels``: time per dominated update with and without sealed links.

Two things are measured, side by side in one script:

* **per message**: CPU microseconds to seal and open one small message (the B = 1 (ϑ, i) and request
  messages are a few words), best of several repetitions of 20,000;
* **per update**: real ``vfl train`` jobs on the same data, alternating plain and sealed so that load
  changes hit both alike; the figure is the ratio of their median milliseconds per dominated update
  (the issue's goal: sealed ≤ 1.3 × plain).

    python -m experiments channels [--dataset a9a] [--repeats 5] [--epochs 0.25]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

from experiments._machine import cpu_model
from experiments._plotting import repetitions_figure
from experiments._vfb2_runner import run_job
from parties.config import RunConfig

OUT = Path(__file__).resolve().parent / "results" / "channels"
COLOURS = {"plain": "tab:blue", "sealed": "tab:red"}


def seal_open_microseconds(words: int = 4, count: int = 20_000, repeats: int = 5) -> float:
    """Best-of CPU µs for one seal plus one open of a ``words``-word message (process time, so
    other processes on the machine do not count)."""
    from protocols.channels import ChannelKeys, public_key

    privates = [hashlib.sha256(f"bench key {r}".encode()).digest() for r in range(2)]
    publics = tuple(public_key(p) for p in privates)
    sender = ChannelKeys(privates[0], publics, b"bench").channels(0, b"data")
    receiver = ChannelKeys(privates[1], publics, b"bench").channels(1, b"data")
    message = np.arange(words, dtype=np.uint64)
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        for _ in range(count):
            receiver.open(0, 5, sender.seal(1, 5, message))
        best = min(best, (time.process_time() - started) / count * 1e6)
    return best


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments channels", description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="a9a")
    p.add_argument("--parties", type=int, default=4)
    p.add_argument("--active", type=int, default=2)
    p.add_argument("--algorithm", default="sgd")
    p.add_argument("--epochs", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)

    load_before = os.getloadavg()
    micro = {w: seal_open_microseconds(w) for w in (4, 64, 4096)}
    ms: dict[str, list[float]] = {"plain": [], "sealed": []}
    for rep in range(args.repeats):  # alternating: a load change hits both variants alike
        for variant in ("plain", "sealed"):
            config = RunConfig(parties=args.parties, active=args.active, dataset=args.dataset,
                               data_dir=args.data_dir, algorithm=args.algorithm, epochs=args.epochs,
                               eval_every=args.epochs, gamma=0.05,  # the step the published timings used
                               snapshot_every=args.epochs, seed=rep, secure_channels=variant == "sealed")
            result = run_job(config, f"{variant}-{rep}")
            ms[variant].append(1e3 * result.train_time / result.updates)
            print(f"[channels] rep {rep} {variant}: {ms[variant][-1]:.3f} ms per update", flush=True)
    ratios = [s / p for s, p in zip(ms["sealed"], ms["plain"], strict=True)]
    summary = {
        "command": "python -m experiments channels " + " ".join(argv or []),
        "load_before": load_before, "load_after": os.getloadavg(), "cpu": cpu_model(),
        "dataset": args.dataset, "parties": args.parties, "active": args.active,
        "algorithm": args.algorithm, "epochs": args.epochs,
        "seal_open_cpu_us": {str(w): round(v, 2) for w, v in micro.items()},
        "ms_per_update": ms, "ratio_per_repetition": ratios,
        "median_ms": {k: float(np.median(v)) for k, v in ms.items()},
        "median_ratio": float(np.median(ratios)),
    }
    write(summary, args.out)
    return summary


def write(summary: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    ms = summary["ms_per_update"]
    lines = [f"`{summary['command'].strip()}` — {summary['dataset']}, q = {summary['parties']}, "
             f"m = {summary['active']}, {summary['algorithm']}; load {summary['load_before'][0]:.1f} → "
             f"{summary['load_after'][0]:.1f}, {summary['cpu']}", "",
             "| | plain | sealed | sealed / plain |", "|---|---|---|---|",
             f"| ms per dominated update, median (min–max) | {summary['median_ms']['plain']:.3f} "
             f"({min(ms['plain']):.3f}–{max(ms['plain']):.3f}) | {summary['median_ms']['sealed']:.3f} "
             f"({min(ms['sealed']):.3f}–{max(ms['sealed']):.3f}) | {summary['median_ratio']:.2f} "
             f"({min(summary['ratio_per_repetition']):.2f}–{max(summary['ratio_per_repetition']):.2f}) |",
             "", "| message size (words) | seal + open, CPU µs |", "|---|---|"]
    lines += [f"| {w} | {v:.2f} |" for w, v in summary["seal_open_cpu_us"].items()]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    repetitions_figure(out / "per_update.png", {name: (COLOURS[name], values) for name, values in ms.items()},
                       title=f"--secure-channels on {summary['dataset']}, q = {summary['parties']}")
    print("\n".join(lines))
