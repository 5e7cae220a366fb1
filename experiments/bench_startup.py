"""Start-up of a small job: the wall time of the quickstart's ``vfl train`` beyond its training, and where it
goes, in this tree against an earlier commit.

The job is the quickstart's (``./mpirun.sh`` bare: q = 4, m = 2, breast-cancer, SVRG, 10 epochs), with
``--no-progress``. Each run is one ``vfl train`` (``python -m vfl.cli train``) through
``experiments/_startup_probe.py``, which puts clocks on the launcher's steps and on each rank's, so one run
gives both the total and its parts:

* launcher: interpreter and imports; options checked against the data (``resolve``); the NonF solve for
  f*; party files and ``config.json``;
* job: ``mpiexec`` and the ranks' interpreters, the ranks' imports, their data (and numba's import where it
  is lazy), their runtime (numba's kernels loaded, threads started, every party ready); training (the
  run's ``train_time``) and what the segments do besides (evaluations, checkpoints, barriers); the ranks'
  exit and ``mpiexec``'s; the launcher's own exit.

A rank's milestones are taken at the slowest rank (each one waits for all at the next barrier), so the
parts add up to the wall time. Start-up = wall − ``train_time``. Both trees run here alternately, run by
run (load on this shared machine moves everything), the earlier commit from a temporary
``git worktree`` (removed at the end); each tree runs one unmeasured job first (numba compiles and caches
its kernels per checkout).

    python -m experiments startup --base REV [--repeats 5]

Outputs in ``experiments/results/startup.{csv,md}`` and ``startup.png``: every run (load average before
and after), the medians side by side, the CPU model and the command.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments._machine import cpu_model
from experiments._plotting import figure_legend, pyplot, save

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
PROBE = Path(__file__).resolve().with_name("_startup_probe.py")
JOB = ["train", "-n", "4", "--dataset", "breast-cancer", "--no-progress"]
#: the parts of a run's wall time, in order; they add up to it
PHASES = {
    "launcher_imports": "launcher: interpreter + imports",
    "resolve": "launcher: options checked against the data",
    "reference": "launcher: NonF solve for f*",
    "prepare_rest": "launcher: party files, config.json",
    "mpiexec": "mpiexec + ranks' interpreters, mpi4py",
    "rank_imports": "ranks: imports",
    "rank_data": "ranks: data (+ numba import if lazy)",
    "rank_runtime": "ranks: runtime (numba kernels, threads, barrier)",
    "training": "training (train_time)",
    "segments": "evaluations, checkpoints, barriers",
    "rank_exit": "ranks' exit + mpiexec's",
    "launcher_exit": "launcher: exit",
}
#: tree -> colour
COLOURS = {"base": "tab:gray", "head": "tab:blue"}


def _env(tree: Path) -> dict[str, str]:
    """The tree's own packages first; the data where this checkout finds it."""
    shared = ROOT.parent / "shared" / "data"
    data = {"VFL_DATA_DIR": str(shared)} if shared.is_dir() and "VFL_DATA_DIR" not in os.environ else {}
    return {**os.environ, **data, "PYTHONPATH": str(tree),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def one_run(tree: Path, work: Path) -> dict[str, float]:
    """One job in ``tree``: its wall time, ``train_time`` and the parts (:data:`PHASES`), in seconds."""
    out, marks_path = work / "run", work / "marks.json"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.time()
    command = [sys.executable, str(PROBE), repr(t0), str(marks_path), "--", *JOB, "--out", str(out)]
    proc = subprocess.run(command, cwd=work, env=_env(tree), capture_output=True, text=True, timeout=900,
                          check=False)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"vfl train in {tree} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    probe = json.loads(marks_path.read_text())
    marks, durations = probe["marks"], probe["durations"]
    ranks = [json.loads(p.read_text()) for p in sorted(work.glob("marks-rank*.json"))]
    for p in work.glob("marks-rank*.json"):
        p.unlink()
    train_time = json.loads((out / "result.json").read_text())["train_time"]
    slowest = {k: max(r[k] for r in ranks) for k in ("exec", "imported", "loaded", "ready", "trained")}
    parts = {
        "launcher_imports": marks["imported"],
        "resolve": durations.get("resolve", 0.0),
        "reference": durations.get("reference_f_star", 0.0),
        "prepare_rest": marks["mpiexec"] - marks["imported"] - durations.get("resolve", 0.0)
        - durations.get("reference_f_star", 0.0),
        "mpiexec": slowest["exec"] - marks["mpiexec"],
        "rank_imports": slowest["imported"] - slowest["exec"],
        "rank_data": slowest["loaded"] - slowest["imported"],
        "rank_runtime": slowest["ready"] - slowest["loaded"],
        "training": train_time,
        "segments": slowest["trained"] - slowest["ready"] - train_time,
        "rank_exit": marks["job_end"] - slowest["trained"],
        "launcher_exit": wall - marks["job_end"],
    }
    return {"wall": wall, "train_time": train_time, "startup": wall - train_time, **parts}


def checkout(rev: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(into), rev],
                   check=True, capture_output=True)
    return into


def measure(trees: dict[str, Path], repeats: int, work: Path) -> list[dict]:
    """Every run, the trees alternating within each repetition (their order flips each time)."""
    for tree in trees.values():  # warm-up: numba's cache in the checkout, the OS's file cache
        one_run(tree, work)
    runs = []
    for rep in range(repeats):
        for name in list(trees) if rep % 2 == 0 else list(reversed(trees)):
            load = os.getloadavg()[0]
            run = one_run(trees[name], work)
            runs.append({"tree": name, "repeat": rep, "load_before": load, "load_after": os.getloadavg()[0],
                         **run})
            print(f"  {name} #{rep}: {run['wall']:.2f} s wall, {run['train_time']:.2f} s training, start-up "
                  f"{run['startup']:.2f} s (load {load:.2f})", flush=True)
    return runs


def write_outputs(runs: list[dict], meta: dict, stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    columns = ["tree", "repeat", "load_before", "load_after", "wall", "train_time", "startup", *PHASES]
    with stem.with_suffix(".csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in r.items()} for r in runs)
    trees = list(dict.fromkeys(r["tree"] for r in runs))
    median = {t: {k: statistics.median(r[k] for r in runs if r["tree"] == t)
                  for k in ("wall", "train_time", "startup", *PHASES)} for t in trees}
    spread = {t: [r["startup"] for r in runs if r["tree"] == t] for t in trees}
    head = " | ".join(f"{t} `{meta['commits'][t]}`" for t in trees)
    rows = [f"| seconds (median of {meta['repeats']}) | {head} |", "|---|" + "---:|" * len(trees)]
    rows.append("| **start-up: wall − training** | " + " | ".join(
        f"**{median[t]['startup']:.2f}** ({min(spread[t]):.2f}–{max(spread[t]):.2f})" for t in trees) + " |")
    rows.append("| wall | " + " | ".join(f"{median[t]['wall']:.2f}" for t in trees) + " |")
    for key, label in PHASES.items():
        rows.append(f"| {label} | " + " | ".join(f"{median[t][key]:.2f}" for t in trees) + " |")
    loads = [r["load_before"] for r in runs]
    rows.append(f"\n{meta['cpu']}; 1-min load average {min(loads):.2f}–{max(loads):.2f} before the runs "
                f"(a shared machine); the parts are medians each, so they need not add up to the median "
                f"wall exactly. Command: `{meta['command']}`; the job: `vfl {' '.join(JOB)}`.")
    stem.with_suffix(".md").write_text("\n".join(rows) + "\n")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.4), layout="constrained")
    for i, tree in enumerate(trees):
        left = 0.0
        for j, (key, label) in enumerate(PHASES.items()):
            if key == "training":
                ax.barh(i, median[tree][key], left=left, color="white", edgecolor="black", hatch="//",
                        label=label if i == 0 else None)
            else:
                ax.barh(i, median[tree][key], left=left, color=pyplot().cm.tab20(j),
                        label=label if i == 0 else None)
            left += median[tree][key]
    ax.set_yticks(range(len(trees)), [f"{t} ({meta['commits'][t]})" for t in trees])
    ax.set_xlabel("seconds of wall time (medians)")
    ax.set_ylabel("tree")
    ax.set_title(f"vfl {' '.join(JOB)}", fontsize=9)
    figure_legend(fig, ncol=2)
    save(fig, stem.with_suffix(".png"))


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m experiments startup", description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the earlier commit (any git revision)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS / "startup", help="stem of the .csv, .md and .png")
    args = p.parse_args(argv)
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    commits = {"base": _git("rev-parse", "--short", args.base),
               "head": _git("rev-parse", "--short", "HEAD") + ("+" if dirty else "")}
    temp = Path(tempfile.mkdtemp(prefix="startup-"))
    try:
        trees = {"base": checkout(args.base, temp / "tree"), "head": ROOT}
        (temp / "work").mkdir()
        runs = measure(trees, args.repeats, temp / "work")
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(temp / "tree")],
                       check=False, capture_output=True)
        shutil.rmtree(temp, ignore_errors=True)
    meta = {"cpu": cpu_model(), "commits": commits, "repeats": args.repeats,
            "command": "python -m experiments startup " + " ".join(sys.argv[2:] if argv is None else argv)}
    write_outputs(runs, meta, args.out)
    print(args.out.with_suffix(".md").read_text())
    return runs


if __name__ == "__main__":
    main()
