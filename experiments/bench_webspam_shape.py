"""webspam's full width, reduced rows: time per epoch and peak memory per rank (issue 11).

Two data sets with the same rows, the same nonzeros per row and the same values, side by side:

* ``wide``: the webspam stand-in's generator (:mod:`vertical.datasets.synth`) at its full 16,609,143
  columns, ``--rows`` rows (default 2,000, ~3,700 nonzeros a row: ~7.4M nonzeros, ~90 MB as CSR; the
  real 350,000 rows would be ~15.6 GB, more than this machine has);
* ``narrow``: each row's nonzeros moved onto 10,000 columns (the same count, distinct, uniform);
* ``wide-freq``: the wide data split with ``column_order="frequency"``: each party numbers its columns
  by how many rows use them, so the busy columns share cache lines (the same model, another numbering).

A row longer than 10,000 nonzeros (the log-normal's tail) is cut to 10,000 in both, so that the
narrow copy can hold it: the realised mean is ~3,450 a row rather than webspam's 3,728.

Both are split (seeded, q = 4, m = 2) into memory-mapped ``party-<p>/`` folders, then each is trained
for ``--epochs`` epoch(s) by real ``vfl train`` jobs (``--updates auto``: lazy at the wide widths),
alternating wide and narrow, ``--repeats`` times. Reported per job: training time per epoch (the
job's own ``train_time``, evaluation excluded), the job's wall time, and each rank's peak RSS
(``VmHWM`` of ``/proc/<pid>/status``, polled every 50 ms while the rank runs, so growth in its last
50 ms may be missed), beside the rank's share of the data and the size of one d_l-long float64 vector.

    python -m experiments webspam_shape [--rows 2000] [--repeats 3] [--algorithms sgd svrg] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from parties.config import RunConfig
from parties.launch import launch
from parties.outcomes import EXIT_CODES
from vertical.datasets import Dataset, split_to_party_files
from vertical.datasets.synth import SHAPES, _Generator
from vertical.partition import random_blocks

OUT = Path(__file__).resolve().parent / "results" / "webspam_shape"
NARROW = 10_000
Q, M = 4, 2
COLOURS = {"narrow": "tab:blue", "wide": "tab:red", "wide-freq": "tab:orange"}
LABELS = {"narrow": "10k features", "wide": "16.6M features, columns by index",
          "wide-freq": "16.6M features, columns by frequency"}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def make_data(rows: int, mean_nnz: float, seed: int) -> tuple[Dataset, Dataset]:
    """(wide, narrow): the same labels, values and nonzeros per row; only the columns differ."""
    shape = SHAPES["webspam"]
    gen = _Generator(shape.n_features, mean_nnz, seed, zipf_exponent=1.0, nnz_sigma=0.8,
                     planted_fraction=0.05, label_noise=0.05)
    rng = np.random.default_rng(seed + 1)
    labels, indptr, wide_cols, narrow_cols, values = [], [0], [], [], []
    for _ in range(rows):
        label, columns, vals, _, _ = gen.row()
        k = min(columns.size, NARROW)
        labels.append(label)
        indptr.append(indptr[-1] + k)
        wide_cols.append(columns[:k])
        narrow_cols.append(np.sort(rng.choice(NARROW, size=k, replace=False)))
        values.append(vals[:k] / np.linalg.norm(vals[:k]))
    data, ptr, y = np.concatenate(values), np.asarray(indptr), np.asarray(labels)
    test = np.sort(np.random.default_rng(seed).permutation(rows)[: rows // 5])
    train = np.setdiff1d(np.arange(rows), test)
    out = []
    for name, cols, width in (("wide", wide_cols, shape.n_features), ("narrow", narrow_cols, NARROW)):
        X = sp.csr_matrix((data, np.concatenate(cols), ptr), shape=(rows, width))
        out.append(Dataset(f"webspam-standin-{name}", "binary", X[train], y[train], X[test], y[test],
                           train, test, seed))
    return out[0], out[1]


class PeakWatcher:
    """Polls each rank's VmHWM (peak resident set) while the job runs."""

    def __init__(self, run: Path, parties: int) -> None:
        self.run, self.parties = run, parties
        self.peak = [0] * parties
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> PeakWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.is_set():
            for rank in range(self.parties):
                try:
                    pid = int((self.run / f"party-{rank}.pid").read_text())
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("VmHWM:"):
                            self.peak[rank] = max(self.peak[rank], int(line.split()[1]) * 1024)
                except (OSError, ValueError):
                    continue
            self._stop.wait(0.05)


def run_one(folder: Path, algorithm: str, epochs: float, gamma: float, work: Path,
            threads: int | None = None) -> dict:
    run = work / "run"
    shutil.rmtree(run, ignore_errors=True)
    config = RunConfig(parties=Q, active=M, party_files=str(folder), problem="logistic", algorithm=algorithm,
                       gamma=gamma, epochs=epochs, eval_every=epochs,
                       snapshot_every=epochs, out=str(run), overwrite=True,
                       progress=False, seed=0, threads=threads)
    started = time.perf_counter()
    with PeakWatcher(run, Q) as watcher:
        code = launch(config, echo=False)
    wall = time.perf_counter() - started
    if code != EXIT_CODES["ok"]:
        raise RuntimeError(f"job on {folder} ({algorithm}) failed with exit code {code}")
    result = json.loads((run / "result.json").read_text())
    return {"epoch_s": result["train_time"] / result["epochs"], "wall_s": wall, "updates": result["updates"],
            "loss": result["record"]["loss"], "peak_rss": watcher.peak}


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*.npy"))


def spread(values: list[float], digits: int = 2) -> str:
    if len(values) < 2:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def plot(rows: list[dict], algorithms: list[str], out: Path, header: str) -> None:
    from experiments._plotting import check_labelled, figure_legend, pyplot, save

    plt = pyplot()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4.4), layout="constrained")
    names = [name for name in COLOURS if any(r["data"] == name for r in rows)]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        for j, alg in enumerate(algorithms):
            times = [r["epoch_s"] for r in rows if r["data"] == name and r["algorithm"] == alg]
            x = j + (i - (len(names) - 1) / 2) * width
            ax_t.bar(x, statistics.median(times), width, color=COLOURS[name],
                     label=LABELS[name] if j == 0 else None)
            ax_t.plot([x] * len(times), times, "k.", ms=4)
            peaks = [max(r["peak_rss"]) / 2**20 for r in rows if r["data"] == name and r["algorithm"] == alg]
            ax_m.bar(x, statistics.median(peaks), width, color=COLOURS[name])
            ax_m.plot([x] * len(peaks), peaks, "k.", ms=4)
    for ax in (ax_t, ax_m):
        ax.set_xticks(range(len(algorithms)), [f"VFB²-{a}" for a in algorithms])
        ax.set_xlabel("algorithm (dots: single runs)")
    ax_t.set_ylabel("training time per epoch (s)")
    ax_m.set_ylabel("largest rank's peak RSS (MiB)")
    fig.suptitle(header, fontsize=9)
    figure_legend(fig)
    check_labelled(fig)
    save(fig, out / "webspam_shape.png")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments webspam_shape", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--mean-nnz", type=float, default=SHAPES["webspam"].mean_nnz)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--algorithms", nargs="+", default=["sgd", "svrg"])
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=None, help="worker threads per party (default: m)")
    parser.add_argument("--data", nargs="+", default=list(COLOURS), choices=list(COLOURS),
                        help="which of the three data sets to time")
    parser.add_argument("--quick", action="store_true", help="200 rows, 1 repeat, sgd only")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--replot", action="store_true", help="re-render table and plot from results.json")
    args = parser.parse_args(argv)
    if args.replot:
        saved = json.loads((args.out / "results.json").read_text())
        write(args.out, saved["meta"], saved["runs"])
        return
    if args.quick:
        args.rows, args.repeats, args.algorithms = 200, 1, ["sgd"]
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="webspam-shape-"))
    try:
        started = time.perf_counter()
        wide, narrow = make_data(args.rows, args.mean_nnz, seed=0)
        nnz = wide.X_train.nnz + wide.X_test.nnz
        print(f"data: {args.rows:,} rows, {nnz:,} nonzeros ({nnz / args.rows:,.0f} a row), "
              f"{time.perf_counter() - started:.0f} s to generate", flush=True)
        folders = {}
        for name, ds, order in (("wide", wide, "index"), ("narrow", narrow, "index"),
                                ("wide-freq", wide, "frequency")):
            folders[name] = work / name
            split_to_party_files(ds, random_blocks(ds.n_features, Q, seed=0), list(range(M)), folders[name],
                                 partition_seed=0, layout="folder", column_order=order)
        share = {name: [folder_bytes(folder / f"party-{p}") for p in range(Q)]
                 for name, folder in folders.items()}
        del wide, narrow
        rows = []
        for repeat in range(args.repeats):
            for alg in args.algorithms:
                for name in args.data:
                    row = {"data": name, "algorithm": alg, "repeat": repeat,
                           **run_one(folders[name], alg, args.epochs, args.gamma, work, args.threads)}
                    rows.append(row)
                    print(f"{name:>6} {alg:>5} #{repeat}: {row['epoch_s']:.2f} s/epoch, "
                          f"wall {row['wall_s']:.1f} s, peak RSS "
                          f"{[round(p / 2**20) for p in row['peak_rss']]} MiB", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    d_l = -(-SHAPES["webspam"].n_features // Q)
    meta = {"rows": args.rows, "train_rows": args.rows - args.rows // 5, "nonzeros": int(nnz),
            "features_wide": SHAPES["webspam"].n_features, "features_narrow": NARROW, "q": Q, "m": M,
            "epochs": args.epochs, "gamma": args.gamma, "repeats": args.repeats, "threads": args.threads,
            "data_bytes_per_rank": share, "d_l_vector_bytes_wide": d_l * 8,
            "loadavg_before": load_before, "loadavg_after": load_after, "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "machine_note": "a 2-core machine shared with other engineers' jobs: wall times include waiting "
                            "for a core", "algorithms": args.algorithms}
    write(args.out, meta, rows)


def write(out: Path, meta: dict, rows: list[dict]) -> None:
    """results.json, results.csv, table.md and the PNG of one run of the benchmark."""
    (out / "results.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=2) + "\n")
    with open(out / "results.csv", "w") as f:
        f.write("data,algorithm,repeat,epoch_s,wall_s,updates,loss," +
                ",".join(f"peak_rss_rank{p}" for p in range(Q)) + "\n")
        for r in rows:
            f.write(f"{r['data']},{r['algorithm']},{r['repeat']},{r['epoch_s']:.4f},{r['wall_s']:.2f},"
                    f"{r['updates']},{r['loss']:.6g}," + ",".join(str(p) for p in r["peak_rss"]) + "\n")
    n, nnz, before, after = meta["rows"], meta["nonzeros"], meta["loadavg_before"], meta["loadavg_after"]
    algorithms = meta.get("algorithms") or sorted({r["algorithm"] for r in rows})
    lines = [f"webspam shape, {n:,} rows ({meta['train_rows']:,} train) × {nnz / n:,.0f} nonzeros a row, "
             f"q = {Q}, m = {M}; {meta['cpu']}, {meta['cores']} cores, load {before[0]:.1f} → {after[0]:.1f} "
             f"(a shared 2-core box)", "",
             "| algorithm | s/epoch, 10k features | s/epoch, 16.6M (by index) | ratio | "
             "s/epoch, 16.6M (by frequency) | ratio | peak RSS per rank, narrow / wide (MiB) |",
             "|---|---|---|---|---|---|---|"]
    for alg in algorithms:
        t = {d: [r["epoch_s"] for r in rows if r["data"] == d and r["algorithm"] == alg] for d in COLOURS}
        if not t["narrow"]:
            continue
        m = {d: [max(r["peak_rss"]) / 2**20 for r in rows if r["data"] == d and r["algorithm"] == alg]
             for d in COLOURS}
        ratio = {d: statistics.median(t[d]) / statistics.median(t["narrow"]) if t[d] else math.nan
                 for d in ("wide", "wide-freq")}
        freq = spread(t["wide-freq"]) if t["wide-freq"] else "—"
        lines.append(f"| VFB²-{alg} | {spread(t['narrow'])} | {spread(t['wide'])} | {ratio['wide']:.2f} | "
                     f"{freq} | {ratio['wide-freq']:.2f} | "
                     f"{spread(m['narrow'], 0)} / {spread(m['wide'], 0)} |")
    share, vector = max(meta["data_bytes_per_rank"]["wide"]) / 2**20, meta["d_l_vector_bytes_wide"] / 2**20
    lines += ["", f"Median (min–max) over {meta['repeats']} run(s). A wide rank's share of the data: "
                  f"{share:.0f} MiB on disk (memory-mapped); one d_l-long float64 vector: {vector:.0f} MiB."]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    plot(rows, algorithms, out, lines[0])
    print("\n".join(lines))
