"""Time per dominated update in real ``vfl train`` jobs against the block width d_l (issue 11).

``update_cost`` times the update kernels alone; this benchmark times what a user waits for: whole
q = 4 jobs (``mpiexec``, secure aggregation, dispatch, every party's update), one per block width,
with everything else held fixed. Synthetic data, one fixed seed: ``--rows`` rows, and in every
party's block exactly ``--nnz`` nonzeros a row at uniform random columns of that block (values
N(0, 1/(q·nnz)), so rows have about unit norm; labels from a planted ±1 model). The blocks are the
contiguous column ranges of width d_l, so every party holds the same nonzeros per row at every width.

Each width is written once into memory-mapped ``party-<p>/`` folders; then, ``--repeats`` times, every
(algorithm, width) job runs once, widths alternating, so that all widths see the same machine. The
figure per job is the job's own training time (evaluation excluded) over its dominated updates;
the table gives the median and min-max over the repeats and the max/min ratio of the medians across
widths, with the CPU model and the load average before and after.

    python -m experiments update_width [--widths 100 10000 1000000 4000000] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from experiments._machine import cpu_model
from parties.config import RunConfig
from parties.launch import launch
from parties.outcomes import EXIT_CODES
from vertical.datasets import Dataset, split_to_party_files

OUT = Path(__file__).resolve().parent / "results" / "update_width"
Q = 4
WIDTHS = (100, 10_000, 1_000_000, 4_000_000)
ALGORITHMS = ("sgd", "svrg", "saga-scalar")
COLOURS = {"sgd": "tab:blue", "svrg": "tab:orange", "saga-scalar": "tab:green"}


def make_data(rows: int, width: int, nnz: int, seed: int) -> Dataset:
    """rows × (Q·width): in party p's columns [p·width, (p+1)·width), ``nnz`` distinct uniform columns a
    row; an 80/20 train/test split."""
    rng = np.random.default_rng(seed)
    blocks = []
    for p in range(Q):
        cols = np.sort(rng.integers(0, width, size=(rows, nnz)), axis=1)
        while (bad := np.flatnonzero((np.diff(cols, axis=1) == 0).any(axis=1))).size:
            cols[bad] = np.sort(rng.integers(0, width, size=(bad.size, nnz)), axis=1)
        blocks.append(cols + p * width)
    cols = np.concatenate(blocks, axis=1)
    values = rng.normal(scale=1.0 / np.sqrt(Q * nnz), size=cols.shape)
    planted = 1.0 - 2.0 * ((cols * 2654435761) >> 7 & 1)  # a ±1 weight per column, without a d-vector
    y = np.where((values * planted).sum(axis=1) >= 0, 1.0, -1.0)
    X = sp.csr_matrix((values.ravel(), cols.ravel(), np.arange(0, cols.size + 1, Q * nnz)),
                      shape=(rows, Q * width))
    test = np.sort(rng.permutation(rows)[: rows // 5])
    train = np.setdiff1d(np.arange(rows), test)
    return Dataset(f"width-{width}", "binary", X[train], y[train], X[test], y[test], train, test, seed)


def run_one(folder: Path, algorithm: str, epochs: float, gamma: float, active: int, work: Path) -> dict:
    run = work / "run"
    shutil.rmtree(run, ignore_errors=True)
    config = RunConfig(parties=Q, active=active, party_files=str(folder), problem="logistic",
                       algorithm=algorithm, gamma=gamma, epochs=epochs, eval_every=epochs,
                       snapshot_every=epochs, out=str(run),
                       overwrite=True, progress=False, seed=0)
    started = time.perf_counter()
    code = launch(config, echo=False)
    wall = time.perf_counter() - started
    if code != EXIT_CODES["ok"]:
        raise RuntimeError(f"job on {folder} ({algorithm}) failed with exit code {code}")
    result = json.loads((run / "result.json").read_text())
    return {"ms_per_update": 1e3 * result["train_time"] / result["updates"], "updates": result["updates"],
            "train_s": result["train_time"], "wall_s": wall, "loss": result["record"]["loss"]}


def spread(values: list[float], digits: int = 3) -> str:
    return (f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}–{max(values):.{digits}f}]"
            if len(values) > 1 else f"{values[0]:.{digits}f}")


def write(out: Path, meta: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=1) + "\n")
    with open(out / "results.csv", "w") as fh:
        fh.write("algorithm,width,repeat,ms_per_update,updates,train_s,wall_s,loss\n")
        for r in rows:
            fh.write(f"{r['algorithm']},{r['width']},{r['repeat']},{r['ms_per_update']:.5f},{r['updates']},"
                     f"{r['train_s']:.3f},{r['wall_s']:.2f},{r['loss']:.6g}\n")
    widths, algorithms = meta["widths"], meta["algorithms"]
    before, after = meta["loadavg_before"][0], meta["loadavg_after"][0]
    lines = [f"ms per dominated update, whole `vfl train` jobs: q = {Q}, m = {meta['active']}, B = 1, "
             f"{meta['rows']:,} rows ({meta['nnz']} nonzeros a row in every block), 1 epoch per job; "
             f"{meta['cpu']}, load {before:.2f} → {after:.2f}; median [min–max] over {meta['repeats']} "
             f"repeats, widths alternating", "",
             "| algorithm | " + " | ".join(f"d_l = {w:,}" for w in widths) + " | max/min of medians |",
             "|---|" + "---|" * (len(widths) + 1)]
    for alg in algorithms:
        meds, cells = [], []
        for w in widths:
            got = [r["ms_per_update"] for r in rows if r["algorithm"] == alg and r["width"] == w]
            meds.append(statistics.median(got))
            cells.append(spread(got))
        lines.append(f"| VFB²-{alg} | " + " | ".join(cells) + f" | {max(meds) / min(meds):.2f} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    plot(out, rows, widths, algorithms, f"whole vfl train jobs: q = {Q}, m = {meta['active']}, B = 1, "
         f"{meta['rows']:,} rows, {meta['nnz']} nonzeros a row per block")
    print("\n".join(lines))


def plot(out: Path, rows: list[dict], widths: list[int], algorithms: list[str], title: str) -> None:
    from experiments._plotting import check_labelled, figure_legend, pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
    for alg in algorithms:
        med = [statistics.median(r["ms_per_update"] for r in rows
                                 if r["algorithm"] == alg and r["width"] == w) for w in widths]
        ax.plot(widths, med, "-o", color=COLOURS[alg], label=f"VFB²-{alg}")
        for w in widths:
            pts = [r["ms_per_update"] for r in rows if r["algorithm"] == alg and r["width"] == w]
            ax.plot([w] * len(pts), pts, ".", color=COLOURS[alg], ms=3)
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("block width d_l (features per party)")
    ax.set_ylabel("ms per dominated update (dots: single jobs)")
    ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    figure_legend(fig)
    check_labelled(fig)
    save(fig, out / "update_width.png")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments update_width", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", nargs="+", type=int, default=list(WIDTHS))
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--nnz", type=int, default=10, help="nonzeros a row in every party's block")
    parser.add_argument("--active", type=int, default=Q, help="label holders = dominators (default: all)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.05)
    parser.add_argument("--quick", action="store_true", help="widths 1e2 and 1e4, 1,000 rows, 1 repeat, sgd")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--replot", action="store_true", help="re-render table and plot from results.json")
    args = parser.parse_args(argv)
    if args.replot:
        saved = json.loads((args.out / "results.json").read_text())
        write(args.out, saved["meta"], saved["runs"])
        return
    if args.quick:
        args.widths, args.rows, args.repeats, args.algorithms = [100, 10_000], 1_000, 1, ["sgd"]
    if min(args.widths) < args.nnz:
        parser.error(f"every width must hold --nnz {args.nnz} distinct columns")
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="update-width-"))
    rows: list[dict] = []
    try:
        folders = {}
        for width in args.widths:
            ds = make_data(args.rows, width, args.nnz, seed=0)
            folders[width] = work / f"w{width}"
            blocks = [np.arange(p * width, (p + 1) * width) for p in range(Q)]
            split_to_party_files(ds, blocks, list(range(args.active)), folders[width], partition_seed=0,
                                 layout="folder")
        for repeat in range(args.repeats):
            for alg in args.algorithms:
                for width in args.widths:
                    row = {"algorithm": alg, "width": width, "repeat": repeat,
                           **run_one(folders[width], alg, args.epochs, args.gamma, args.active, work)}
                    rows.append(row)
                    print(f"d_l={width:>9,} {alg:>11} #{repeat}: {row['ms_per_update']:.3f} ms/update "
                          f"({row['updates']:,} updates, load {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    meta = {"widths": args.widths, "algorithms": args.algorithms, "rows": args.rows, "nnz": args.nnz,
            "active": args.active, "repeats": args.repeats, "epochs": args.epochs, "gamma": args.gamma,
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "cpu": cpu_model()}
    write(args.out, meta, rows)


if __name__ == "__main__":
    main()
