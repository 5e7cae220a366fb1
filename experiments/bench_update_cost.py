"""Cost of one applied update against the block width d_l: lazy (O(nnz)) vs eager (O(d_l)) kernels.

Synthetic CSR block (fixed seed): n rows with exactly 10 nonzeros each at uniform random columns,
d_l ∈ {1e2, …, 4e6}. Rules SGD, SVRG (μ from a random ϑ_0) and SAGA-scalar (random initial ϑ table),
L2 with λ = 1e-4, γ = 0.05, B = 1. Two call patterns, as in the runtime: ``worker`` applies queued
pairs in calls of 256, ``dominator`` applies one pair per call (so it includes the ~µs Python→numba
call). The time per applied update is wall time / updates, each measurement capped at ``--cap``
seconds (eager is only run up to d_l = 1e5, where it already costs ~10 µs per update; above that it is
O(d_l) by construction and would dominate the run time). Every measurement is repeated
``--repeats`` times: the table gives the median and the min-max spread of the calling thread's CPU
time (``time.thread_time``; on a shared machine wall time also counts waiting for a core — wall
medians are in results.csv), with the 1-minute load average before/after and the CPU model.

    python -m experiments update_cost [--quick] [--repeats 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from experiments._machine import cpu_model
from vertical.algorithms.vfb2 import Block, get_rule
from vertical.problems import L2

OUT = Path(__file__).resolve().parent / "results" / "update_cost"
RULES = ("sgd", "svrg", "saga-scalar")
#: SGD with λ = 0, eager: the sparse part alone, the floor any kernel pays (cache misses at large d_l)
FLOOR = "sparse-floor"
COLOURS = {"sgd": "tab:blue", "svrg": "tab:orange", "saga-scalar": "tab:green", FLOOR: "tab:gray"}
NNZ_PER_ROW = 10
LAM, GAMMA = 1e-4, 0.05
EAGER_MAX_D = 100_000


def synthetic_block(n_rows: int, d: int, seed: int) -> Block:
    """n_rows × d CSR, exactly NNZ_PER_ROW distinct uniform columns per row (rows with a repeated
    column are redrawn), N(0, 1) values."""
    rng = np.random.default_rng(seed)
    cols = np.sort(rng.integers(0, d, size=(n_rows, NNZ_PER_ROW)), axis=1)
    while (bad := np.flatnonzero((np.diff(cols, axis=1) == 0).any(axis=1))).size:
        cols[bad] = np.sort(rng.integers(0, d, size=(bad.size, NNZ_PER_ROW)), axis=1)
    indptr = np.arange(0, n_rows * NNZ_PER_ROW + 1, NNZ_PER_ROW)
    X = sp.csr_matrix((rng.normal(size=cols.size), cols.ravel(), indptr), shape=(n_rows, d))
    return Block.from_matrix(X)


def make_rule(name: str, block: Block, lazy: bool, seed: int):
    if name == FLOOR:  # no dense part at all: only the sparse part's memory traffic
        return get_rule("sgd")(block, L2(), 0.0, GAMMA, lazy=False), np.zeros(block.n_cols)
    rule = get_rule(name)(block, L2(), LAM, GAMMA, lazy=lazy)
    rng = np.random.default_rng(seed)
    w = np.zeros(block.n_cols)
    if rule.needs_snapshot:
        rule.snapshot(rng.normal(scale=0.1, size=block.n_rows), w)
    if rule.needs_initial_pass:
        rule.initialize(rng.normal(scale=0.1, size=block.n_rows), w)
    return rule, w


def measure(rule, w, rows, thetas, per_call: int, cap_s: float) -> tuple[float, float, int]:
    """(CPU seconds per update, wall seconds per update, updates done), applying ``rows`` in calls of
    ``per_call`` pairs. CPU time of this thread is the primary figure: on a shared machine wall time
    also counts the time the thread waited for a core."""
    done = 0
    started, cpu_started = time.perf_counter(), time.thread_time()
    deadline = started + cap_s
    for s in range(0, rows.size, per_call):
        rule.apply(w, rows[s:s + per_call], thetas[s:s + per_call])
        done += min(per_call, rows.size - s)
        if (done // per_call) % 16 == 0 and time.perf_counter() > deadline:
            break
    return (time.thread_time() - cpu_started) / done, (time.perf_counter() - started) / done, done


def run(dims, updates: int, repeats: int, cap_s: float, n_rows: int) -> list[dict]:
    cpu = cpu_model()
    results = []
    for d in dims:
        block = synthetic_block(n_rows, d, seed=0)
        rng = np.random.default_rng(1)
        rows = rng.integers(0, n_rows, size=updates)
        thetas = rng.normal(scale=0.1, size=updates)
        for name in (*RULES, FLOOR):
            for lazy in (True, False):
                if (not lazy and d > EAGER_MAX_D and name != FLOOR) or (name == FLOOR and lazy):
                    continue
                rule, w = make_rule(name, block, lazy, seed=2)
                kernel_label = "lazy" if lazy else ("none" if name == FLOOR else "eager")
                rule.apply(w.copy(), rows[:1], thetas[:1])  # compile / warm the caches
                for pattern, per_call in (("worker", 256), ("dominator", 1)):
                    times, walls, loads, done = [], [], [], 0
                    for _ in range(repeats):
                        before = os.getloadavg()[0]
                        t, wall, done = measure(rule, w, rows, thetas, per_call, cap_s)
                        loads.append((before, os.getloadavg()[0]))
                        times.append(t * 1e6)
                        walls.append(wall * 1e6)
                    rule.synchronize(w)
                    assert np.all(np.isfinite(w))
                    results.append({
                        "rule": name, "kernel": kernel_label, "pattern": pattern, "d": d,
                        "nnz_per_row": NNZ_PER_ROW, "updates_per_repeat": done, "repeats": repeats,
                        "median_us": float(np.median(times)), "min_us": float(np.min(times)),
                        "max_us": float(np.max(times)), "times_us": times,
                        "wall_median_us": float(np.median(walls)), "wall_us": walls,
                        "load_before": [a for a, _ in loads], "load_after": [b for _, b in loads],
                        "cpu": cpu})
                    print(f"d={d:>8} {name:<11} {results[-1]['kernel']:<5} {pattern:<9} "
                          f"{results[-1]['median_us']:8.3f} µs/update  (load {loads[0][0]:.2f})", flush=True)
    return results


def write_outputs(results: list[dict], out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fields = ["rule", "kernel", "pattern", "d", "nnz_per_row", "updates_per_repeat", "repeats", "median_us",
              "min_us", "max_us", "wall_median_us", "load_before", "load_after", "cpu"]
    with open(out / "results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for r in results:
            writer.writerow({**r, "load_before": " ".join(f"{x:.2f}" for x in r["load_before"]),
                             "load_after": " ".join(f"{x:.2f}" for x in r["load_after"])})
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    dims = sorted({r["d"] for r in results})
    lines = [f"# CPU time per applied update (µs), {NNZ_PER_ROW} nonzeros/row, L2 λ={LAM}, γ={GAMMA}", "",
             f"CPU: {meta['cpu']} ({meta['cpus']} cores, shared); load average (1 min) "
             f"{meta['load_min']:.2f}-{meta['load_max']:.2f} during the run; median of {meta['repeats']} "
             f"repeats [min-max] of the calling thread's CPU time (wall medians: results.csv); eager not run "
             f"above d_l = {EAGER_MAX_D:g} (O(d_l) by construction); sparse-floor = SGD with λ = 0 (sparse "
             "part only: the memory traffic every kernel pays).",
             ""]
    for pattern in ("worker", "dominator"):
        lines += [f"## {pattern} calls ({'256 pairs' if pattern == 'worker' else '1 pair'} per call)", "",
                  "| rule | kernel | " + " | ".join(f"d={d:g}" for d in dims) + " | max/min |",
                  "|---|---|" + "---|" * (len(dims) + 1)]
        for name, kernel in [(r, k) for r in RULES for k in ("lazy", "eager")] + [(FLOOR, "none")]:
            cells, meds = [], []
            for d in dims:
                hit = [r for r in results if (r["rule"], r["kernel"], r["pattern"], r["d"])
                       == (name, kernel, pattern, d)]
                if hit:
                    r = hit[0]
                    meds.append(r["median_us"])
                    cells.append(f"{r['median_us']:.3g} [{r['min_us']:.3g}-{r['max_us']:.3g}]")
                else:
                    cells.append("—")
            ratio = f"{max(meds) / min(meds):.2f}" if meds else "—"
            lines.append(f"| {name} | {kernel} | " + " | ".join(cells) + f" | {ratio} |")
        lines.append("")
    (out / "table.md").write_text("\n".join(lines))
    _plot(results, out / "update_cost.png")


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, pattern in zip(axes, ("worker", "dominator"), strict=True):
        series = [(r, k, st) for r in RULES for k, st in (("lazy", "-o"), ("eager", "--s"))]
        for name, kernel, style in [*series, (FLOOR, "none", ":^")]:
            key = (name, kernel, pattern)
            rs = sorted((r for r in results if (r["rule"], r["kernel"], r["pattern"]) == key),
                        key=lambda r: r["d"])
            if not rs:
                continue
            x = [r["d"] for r in rs]
            y = [r["median_us"] for r in rs]
            err = [[m - r["min_us"] for m, r in zip(y, rs, strict=True)],
                   [r["max_us"] - m for m, r in zip(y, rs, strict=True)]]
            ax.errorbar(x, y, yerr=err, fmt=style, color=COLOURS[name], label=f"{name} {kernel}",
                        capsize=2, ms=4)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("block width d_l (features)")
        ax.set_title(f"{pattern} calls ({'256 pairs' if pattern == 'worker' else '1 pair'} per call)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("CPU time per applied update (µs)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.86))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny version (seconds): d_l ∈ {1e2, 1e4}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--updates", type=int, default=60_000, help="pairs per repeat (before the time cap)")
    parser.add_argument("--cap", type=float, default=0.25, help="seconds per repeat at most")
    parser.add_argument("--rows", type=int, default=20_000, help="rows of the synthetic block")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.quick:
        dims, updates, repeats, cap, n_rows = [100, 10_000], 3_000, 2, 0.05, 2_000
    else:
        dims = [100, 1_000, 10_000, 100_000, 1_000_000, 4_000_000]
        updates, repeats, cap, n_rows = args.updates, args.repeats, args.cap, args.rows
    started = time.perf_counter()
    results = run(dims, updates, repeats, cap, n_rows)
    loads = [x for r in results for x in r["load_before"] + r["load_after"]]
    meta = {"cpu": cpu_model(), "load_min": min(loads), "load_max": max(loads), "repeats": repeats,
            "updates": updates, "cap_s": cap, "rows": n_rows, "lam": LAM, "gamma": GAMMA,
            "nnz_per_row": NNZ_PER_ROW, "eager_max_d": EAGER_MAX_D, "quick": args.quick,
            "wall_s": time.perf_counter() - started, "cpus": os.cpu_count()}
    write_outputs(results, args.out, meta)
    print(f"wrote {args.out} in {meta['wall_s']:.1f} s")
