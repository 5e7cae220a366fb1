"""Learning-rate sweep over the VFB² paper's grid {5e-1, 1e-1, 5e-2, 1e-2, 5e-3, 1e-3}.

``python -m experiments vfb2_lr_sweep [--datasets a9a w8a d1] [--problem logistic] [--quick]``

The paper picks "the optimal γ from {5e-1, 1e-1, 5e-2, 1e-2, ...}" and uses it for both the async
VFB² run and its synchronous VFB counterpart. Decision: the sweep runs the *same update rules* in one
process (:func:`vertical.algorithms.serial.run_serial`, the feature blocks of a q-party split, no
federation): a full sweep through MPI would cost ~20 jobs per dataset on this 2-core machine, while the
runtime's extra staleness at q = 4 is a few updates, far too little to move the best grid point. The
chosen γ is the one with the lowest sub-optimality after the epoch budget among runs that did not
diverge; the reproductions take their γ from this table (``GAMMAS`` in
:mod:`experiments._vfb2_runner`).

Outputs in ``experiments/results/vfb2_lr_sweep/``: ``sweep.csv`` (objective gap per epoch for every
γ and algorithm), ``sweep.md`` (final gap, best γ marked) and ``sweep_<dataset>.png``.
"""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path

import numpy as np

from experiments._vfb2_runner import (
    RESULTS,
    base_parser,
    command_line,
    markdown_table,
    nonf,
    nonf_cache,
    output_dir,
    present_datasets,
    say,
    write_rows,
)
from vertical.algorithms.serial import run_serial
from vertical.datasets import get_spec, load
from vertical.partition import random_blocks
from vertical.problems import get_problem

NAME = "vfb2_lr_sweep"
GRID = (5e-1, 1e-1, 5e-2, 1e-2, 5e-3, 1e-3)


def sweep(dataset: str, problem: str, algorithms: list[str], grid: tuple[float, ...], epochs: int, *,
          cache: Path, parties: int = 4, lam: float = 1e-4, seed: int = 0,
          data_dir: str | None = None) -> list[dict]:
    """One row per (algorithm, γ, epoch): ``f(w) − f*`` of the serial run after that epoch."""
    ds = load(dataset, seed=seed, data_dir=data_dir)
    prob = get_problem(problem, lam=lam)
    f_star = nonf(dataset, problem, lam, seed, data_dir=data_dir, cache=cache).f_star
    blocks = random_blocks(ds.n_features, parties, seed=seed)
    rows = []
    for algorithm in algorithms:
        for gamma in grid:
            started = time.perf_counter()
            with np.errstate(all="ignore"):
                result = run_serial(prob, ds.X_train, ds.y_train, blocks, algorithm, gamma, epochs, seed=seed)
            spent = time.perf_counter() - started
            for epoch, value in enumerate(result.objective):
                rows.append({"dataset": dataset, "problem": problem, "algorithm": algorithm, "gamma": gamma,
                             "epoch": epoch, "suboptimality": value - f_star if math.isfinite(value)
                             else math.inf, "seconds": round(spent, 3)})
    return rows


def best_gamma(rows: list[dict], algorithm: str) -> float:
    """γ with the smallest final gap among runs that stayed finite and ended below where they began."""
    final: dict[float, float] = {}
    start: dict[float, float] = {}
    for r in rows:
        if r["algorithm"] == algorithm:
            final[r["gamma"]] = r["suboptimality"]
            start.setdefault(r["gamma"], r["suboptimality"])
    ok = {g: v for g, v in final.items() if math.isfinite(v) and v < start[g]}
    if not ok:
        raise RuntimeError(f"every γ diverged for {algorithm}; extend the grid downwards")
    return min(ok, key=ok.__getitem__)


def _plot(rows: list[dict], dataset: str, algorithms: list[str], path) -> None:
    """One panel per optimiser; a fixed colour per γ of the paper's grid on every panel, one legend."""
    from experiments._plotting import colours, figure_legend, pyplot, save

    plt = pyplot()
    colour = colours(sorted({*GRID, *(float(r["gamma"]) for r in rows)}, reverse=True))
    fig, axes = plt.subplots(1, len(algorithms), figsize=(4.2 * len(algorithms), 3.9), squeeze=False,
                             layout="constrained")
    for ax, algorithm in zip(axes[0], algorithms, strict=True):
        for gamma in colour:
            pts = [(float(r["epoch"]), float(r["suboptimality"])) for r in rows
                   if r["algorithm"] == algorithm and float(r["gamma"]) == gamma and r["dataset"] == dataset]
            if not pts:
                continue
            x, y = zip(*pts, strict=True)
            ax.semilogy(x, np.clip(np.asarray(y, dtype=float), 1e-12, 1e3), marker="o", ms=3,
                        color=colour[gamma], label=f"γ={gamma:g}")
        ax.set(title=f"{dataset}: VFB²-{algorithm.upper()} (serial)", xlabel="epochs",
               ylabel="sub-optimality f(w) − f*")
        ax.grid(alpha=0.3)
    figure_legend(fig, title="step size")
    save(fig, path)


def replot(out: Path) -> list[Path]:
    """Redraw ``sweep_<dataset>.png`` from the ``sweep.csv`` already in ``out`` (no training)."""
    with open(out / "sweep.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    written = []
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        algorithms = list(dict.fromkeys(r["algorithm"] for r in rows if r["dataset"] == dataset))
        _plot(rows, dataset, algorithms, out / f"sweep_{dataset}.png")
        written.append(out / f"sweep_{dataset}.png")
    return written


def main(argv: list[str] | None = None) -> dict[tuple[str, str], float]:
    p = base_parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", default=None, help="default: d1 a9a w8a (present ones)")
    p.add_argument("--problem", default="logistic")
    p.add_argument("--algorithms", nargs="+", default=["sgd", "svrg", "saga"])
    p.add_argument("--epochs", type=int, default=None, help="default 5 (1 with --quick)")
    p.add_argument("--replot", action="store_true",
                   help="only redraw the figures from sweep.csv already in the output folder (no training)")
    args = p.parse_args(argv)
    if args.replot:
        written = replot(args.out if args.out is not None else RESULTS / NAME)
        say(f"redrew {', '.join(str(path) for path in written)}")
        return {}
    out = output_dir(args, NAME)
    names = args.datasets or (["breast-cancer"] if args.quick else ["d1", "a9a", "w8a"])
    epochs = args.epochs or (2 if args.quick else 5)
    grid = GRID[:3] if args.quick else GRID
    rows: list[dict] = []
    best: dict[tuple[str, str], float] = {}
    table = []
    present = present_datasets(names, args.data_dir)
    for dataset in (get_spec(n).name for n in names):
        if dataset not in present:
            say(f"{dataset}: data file absent, skipped")
            continue
        say(f"sweeping γ on {dataset} ({args.problem}, {epochs} epochs)")
        these = sweep(dataset, args.problem, args.algorithms, grid, epochs, data_dir=args.data_dir,
                      cache=nonf_cache(args, out))
        rows += these
        _plot(these, dataset, args.algorithms, out / f"sweep_{dataset}.png")
        for algorithm in args.algorithms:
            best[(dataset, algorithm)] = g = best_gamma(these, algorithm)
            finals = {r["gamma"]: r["suboptimality"] for r in these if r["algorithm"] == algorithm}
            cells = [f"**{finals[gm]:.2e}**" if gm == g else f"{finals[gm]:.2e}" for gm in grid]
            table.append([dataset, algorithm, *cells, f"{g:g}"])
    write_rows(out / "sweep.csv", rows)
    caption = (f"Final f(w) − f* after {epochs} epochs of the serial VFB² rules (q = 4 blocks, λ = 1e-4, "
               f"{args.problem}, seed 0); best γ in bold. Command: `{command_line(NAME, argv)}`.\n\n")
    (out / "sweep.md").write_text(caption + markdown_table(
        ["dataset", "algorithm", *[f"γ={g:g}" for g in grid], "best γ"], table))
    return best
