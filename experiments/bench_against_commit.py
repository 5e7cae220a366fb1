"""This tree against an earlier commit, side by side: a9a's time per dominated update and the HFL round.

A change that should not change behaviour (a redesign, a refactoring) must not change speed either, and
on this shared machine two numbers measured an hour apart say little (load moves them 2-50×). So both
trees run here, **alternating** run by run, each through its own command line, in its own checkout:

* ``vfl train -n 4 -m 4 --dataset a9a --algorithm sgd -B 1`` (the paper's setting, every party a
  dominator): training time / dominated updates, from the run's ``result.json``;
* ``python -m experiments hfl_quick --rounds 0 --timing-rounds R``: FedAvg's seconds per round (N = 200,
  S = 20, K = 10, MLP, Fashion-MNIST).

The earlier commit is checked out with ``git worktree add --detach`` into a temporary folder (removed at
the end) and imported from there through ``PYTHONPATH``; each tree runs one unmeasured warm-up job first
(numba compiles and caches its kernels per checkout).

    python -m experiments against_commit --base REV [--repeats 5] [--epochs 0.25] [--timing-rounds 5]

Outputs in ``experiments/results/against_commit/``: ``results.json`` (every run, load average before and
after each, CPU model), ``table.md`` and ``against_commit.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from experiments._machine import cpu_model
from experiments._plotting import pyplot, save

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "results" / "against_commit"
#: tree -> colour (the same in both panels)
COLOURS = {"base": "tab:gray", "head": "tab:blue"}
TRAIN = ["train", "-n", "4", "-m", "4", "--dataset", "a9a", "--algorithm", "sgd", "-B", "1",
         "--gamma", "0.1", "--no-reference"]


def _env(tree: Path) -> dict[str, str]:
    """The tree's own packages first; the data where this checkout finds it (a temporary checkout has
    no ``../shared/data`` beside it)."""
    shared = ROOT.parent / "shared" / "data"
    data = {"VFL_DATA_DIR": str(shared)} if shared.is_dir() and "VFL_DATA_DIR" not in os.environ else {}
    return {**os.environ, **data, "PYTHONPATH": str(tree),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def _run(tree: Path, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=tree, env=_env(tree), capture_output=True, text=True,
                          timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} in {tree} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return proc


def ms_per_update(tree: Path, epochs: float, seed: int) -> float:
    """One ``vfl train`` job in ``tree``: milliseconds of training per dominated update."""
    with tempfile.TemporaryDirectory(prefix="against-commit-") as work:
        cli = ["-c", "import sys; from vfl.cli import main; sys.exit(main())"]
        _run(tree, [*cli, *TRAIN, "--epochs", f"{epochs:g}", "--eval-every", f"{epochs:g}",
                    "--seed", str(seed), "--out", f"{work}/run", "--no-progress"], timeout=900)
        result = json.loads((Path(work) / "run" / "result.json").read_text())
    return 1e3 * result["train_time"] / result["updates"]


def seconds_per_round(tree: Path, rounds: int) -> float:
    """FedAvg's median seconds per HFL round in ``tree`` (``hfl_quick``'s timing)."""
    with tempfile.TemporaryDirectory(prefix="against-commit-") as work:
        _run(tree, ["-m", "experiments", "hfl_quick", "--rounds", "0", "--timing-rounds", str(rounds),
                    "--out", work], timeout=900)
        summary = json.loads((Path(work) / "summary.json").read_text())
    seconds = summary["seconds_per_round"]
    return float(seconds["vectorised fedavg"])


def checkout(rev: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(into), rev],
                   check=True, capture_output=True)
    return into


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


@contextlib.contextmanager
def base_and_head(base: str, prefix: str) -> Iterator[tuple[dict[str, Path], dict[str, str]]]:
    """The trees to compare, ``{"base": a temporary worktree at base, "head": this tree}``, and their
    commits (``+`` after the head's when it has uncommitted changes); the worktree goes on exit."""
    rev = _git("rev-parse", "--short", base)
    head = _git("rev-parse", "--short", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    temp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield ({"base": checkout(rev, temp / "tree"), "head": ROOT},
               {"base": rev, "head": head + ("+" if dirty else "")})
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(temp / "tree")],
                       check=False, capture_output=True)
        shutil.rmtree(temp, ignore_errors=True)


def measure(trees: dict[str, Path], repeats: int, epochs: float, timing_rounds: int) -> list[dict]:
    """Every measurement, the trees alternating within each repetition (their order flips each time)."""
    for tree in trees.values():  # warm-up: numba's cache, the OS's file cache
        ms_per_update(tree, epochs, seed=99)
    runs = []
    for rep in range(repeats):
        order = list(trees) if rep % 2 == 0 else list(reversed(trees))
        for name in order:
            load = os.getloadavg()[0]
            ms = ms_per_update(trees[name], epochs, seed=rep)
            s = seconds_per_round(trees[name], timing_rounds)
            runs.append({"tree": name, "repeat": rep, "ms_per_update": ms, "seconds_per_round": s,
                         "load_before": load, "load_after": os.getloadavg()[0]})
            print(f"  {name} #{rep}: {ms:.3f} ms per update, {s:.3f} s per HFL round (load {load:.2f})",
                  flush=True)
    return runs


def summarise(runs: list[dict]) -> dict[str, dict[str, list[float]]]:
    trees = dict.fromkeys(r["tree"] for r in runs)
    return {t: {k: [r[k] for r in runs if r["tree"] == t] for k in ("ms_per_update", "seconds_per_round")}
            for t in trees}


def write_outputs(out: Path, meta: dict, runs: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    per_tree = summarise(runs)
    (out / "results.json").write_text(json.dumps({**meta, "runs": runs}, indent=2) + "\n")
    rows = ["| tree | commit | ms per dominated update (median; min–max) "
            "| s per HFL round (median; min–max) |", "|---|---|---|---|"]
    for tree, values in per_tree.items():
        cells = [f"{statistics.median(v):.3f} ({min(v):.3f}–{max(v):.3f})" for v in values.values()]
        rows.append(f"| {tree} | `{meta['commits'][tree]}` | {cells[0]} | {cells[1]} |")
    loads = [r["load_before"] for r in runs]
    rows.append(f"\n{meta['cpu']}; load average {min(loads):.2f}–{max(loads):.2f} before the runs; "
                f"command: `{meta['command']}`")
    (out / "table.md").write_text("\n".join(rows) + "\n")
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), layout="constrained")
    panels = (("ms_per_update", "ms per dominated update", "a9a, q = 4, m = 4, B = 1, SGD"),
              ("seconds_per_round", "s per HFL round", "FedAvg, N = 200, S = 20, K = 10"))
    for ax, (key, label, title) in zip(axes, panels, strict=True):
        for tree, values in per_tree.items():
            ax.plot(range(1, len(values[key]) + 1), values[key], "o-", color=COLOURS[tree],
                    label=f"{tree} ({meta['commits'][tree]})")
        ax.set_xlabel("repetition (trees alternating)")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=9)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylim(bottom=0)
    from experiments._plotting import figure_legend

    figure_legend(fig)
    save(fig, out / "against_commit.png")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments against_commit",
                                description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the earlier commit (any git revision)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--epochs", type=float, default=0.25, help="epochs of each a9a job")
    p.add_argument("--timing-rounds", type=int, default=5, help="HFL rounds timed per run")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    with base_and_head(args.base, "against-commit-base-") as (trees, commits):
        started = time.time()
        runs = measure(trees, args.repeats, args.epochs, args.timing_rounds)
    meta = {"cpu": cpu_model(), "started": started,
            "commits": commits,
            "command": "python -m experiments against_commit " + " ".join(argv or sys.argv[1:])}
    write_outputs(args.out, meta, runs)
    print((args.out / "table.md").read_text())
    return {**meta, "runs": runs}


if __name__ == "__main__":
    main()
