"""``--label-privacy he --he-pack`` against unpacked decryption (issue 30, item 3), side by side.

Each job is ``vfl train`` on a9a, q = 4 parties, m = 1, HE-SGD, OU 2048 bits, γ = 0.5, one epoch, at
B = 256 and B = 1,024; packed and unpacked alternate job by job (the first of each pair swaps from run to
run) with the same seed, so load drifts hit both. Time per epoch is the run's training time over its
epochs (``result.json``: key generation and loading excluded); accuracy is the final test accuracy; the
load average is read before and after every job.

    python -m experiments label_he_pack [--batches 256 1024] [--runs 3] [--epochs 1] [--out DIR]
    python -m experiments label_he_pack --render DIR     # redraw DIR's table and plot

Outputs in ``experiments/results/label_he_pack/`` (or ``--out``): ``results.json`` (every job, CPU
model, loads, command), ``results.csv``, ``table.md`` and ``label_he_pack.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments._machine import cpu_model
from experiments._vfb2_runner import write_rows

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "results" / "label_he_pack"
TRAIN = ["train", "-n", "4", "-m", "1", "--dataset", "a9a", "--algorithm", "sgd", "--gamma", "0.5",
         "--label-privacy", "he", "--he-scheme", "ou", "--no-reference", "--no-progress"]
COLOURS = {"unpacked": "tab:gray", "packed": "tab:blue"}


def _env() -> dict[str, str]:
    shared = ROOT.parent / "shared" / "data"
    data = {"VFL_DATA_DIR": str(shared)} if shared.is_dir() and "VFL_DATA_DIR" not in os.environ else {}
    return {**os.environ, **data, "PYTHONPATH": str(ROOT),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def job(batch: int, packed: bool, seed: int, epochs: float) -> dict:
    """One ``vfl train`` run: seconds per epoch of training, final loss and test accuracy."""
    args = [*TRAIN, "-B", str(batch), "--seed", str(seed), "--epochs", f"{epochs:g}",
            "--eval-every", f"{epochs:g}", *(["--he-pack"] if packed else [])]
    with tempfile.TemporaryDirectory(prefix="label-he-pack-") as work:
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", "import sys; from vfl.cli import main; sys.exit(main())",
                               *args, "--out", f"{work}/run"], cwd=ROOT, env=_env(), capture_output=True,
                              text=True, timeout=3600, check=False)
        wall = time.monotonic() - started
        if proc.returncode != 0:
            raise RuntimeError(f"vfl {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        result = json.loads((Path(work) / "run" / "result.json").read_text())
    return {"seconds_per_epoch": result["train_time"] / result["epochs"], "wall_s": wall,
            "test_accuracy": result["record"]["test_accuracy"], "loss": result["record"]["loss"],
            "updates": result["updates"], "command": "vfl " + " ".join(args)}


def write(out: Path, meta: dict, runs: list[dict]) -> None:
    from experiments._plotting import figure_legend, pyplot, save

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({**meta, "runs": runs}, indent=1) + "\n")
    write_rows(out / "results.csv", runs)
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["batch"], r["decryption"]), []).append(r)
    lines = ["| B | decryption | s per epoch: median (each run) | test accuracy: mean (each run) | "
             "final loss (each run) | load before each run |", "|---|---|---|---|---|---|"]
    for (batch, kind), rs in sorted(groups.items()):
        sec, acc = [r["seconds_per_epoch"] for r in rs], [100 * r["test_accuracy"] for r in rs]
        losses = ", ".join(f"{r['loss']:.5f}" for r in rs)
        before = ", ".join(f"{r['load_before']:.1f}" for r in rs)
        lines.append(f"| {batch} | {kind} | {statistics.median(sec):.2f} "
                     f"({', '.join(f'{s:.2f}' for s in sec)}) | {statistics.mean(acc):.2f} % "
                     f"({', '.join(f'{a:.2f}' for a in acc)}) | {losses} | {before} |")
    loads = [r["load_before"] for r in runs] + [r["load_after"] for r in runs]
    lines.append(f"\n{meta['cpu']}; load average {min(loads):.1f}–{max(loads):.1f} over the jobs; command: "
                 f"`{meta['command']}`; each job: `{runs[0]['command']}` (its -B, --seed, --he-pack)")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), layout="constrained")
    batches = sorted({r["batch"] for r in runs})
    for ax, key, label in ((axes[0], "seconds_per_epoch", "seconds per epoch"),
                           (axes[1], "test_accuracy", "test accuracy (%)")):
        for (batch, kind), rs in groups.items():
            x = batches.index(batch) + (0.1 if kind == "packed" else -0.1)
            ys = [r[key] * (100 if key == "test_accuracy" else 1) for r in rs]
            ax.scatter([x] * len(ys), ys, color=COLOURS[kind], label=kind)
        ax.set_xticks(range(len(batches)), [f"B = {b}" for b in batches])
        ax.set_xlabel("mini-batch size")
        ax.set_ylabel(label)
    figure_legend(fig)
    save(fig, out / "label_he_pack.png")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", nargs="+", type=int, default=[256, 1024])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--render", type=Path, default=None, metavar="DIR",
                   help="only redraw DIR's table and plot from its results.json (no job runs)")
    args = p.parse_args(argv)
    if args.render is not None:
        record = json.loads((args.render / "results.json").read_text())
        runs = record.pop("runs")
        write(args.render, record, runs)
        return
    runs: list[dict] = []
    for run in range(args.runs):
        for batch in args.batches:
            for packed in ((False, True) if run % 2 == 0 else (True, False)):
                load = os.getloadavg()[0]
                found = job(batch, packed, run, args.epochs)
                kind = "packed" if packed else "unpacked"
                runs.append({"batch": batch, "decryption": kind, "seed": run, **found, "load_before": load,
                             "load_after": os.getloadavg()[0]})
                print(f"[label_he_pack] B={batch} {kind} seed={run}: "
                      f"{found['seconds_per_epoch']:.2f} s/epoch, test {100 * found['test_accuracy']:.2f} % "
                      f"(load {load:.1f})", flush=True)
    given = argv if argv is not None else sys.argv[1:]
    write(args.out, {"cpu": cpu_model(), "command": "python -m experiments label_he_pack " + " ".join(given)},
          runs)
    print((args.out / "table.md").read_text())


if __name__ == "__main__":
    main()
