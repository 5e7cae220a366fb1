"""The B = 1 hot path against an earlier commit: alone, and beside a second 4-party job.

Issue 30's first item: ``vfl train -n 4 -m 4 --dataset a9a --algorithm sgd --gamma 0.1`` (B = 1, every
party a dominator), time per dominated update, this tree against an earlier commit, **alternating** run
by run (on this shared machine numbers an hour apart say little), in two settings:

* **alone**: only the measured job (and whatever else the machine runs: the load is recorded);
* **beside**: the benchmark first starts a second, long 4-party job of the same command from the
  *earlier* tree (the same neighbour whichever tree is measured), waits until it trains, runs the
  measured job, then ends the neighbour.

Each tree runs in its own checkout (the earlier one by ``git worktree add --detach``, removed at the
end) and warms up once (numba compiles and caches its kernels per checkout).

    python -m experiments hot_path --base 4f6bb7f [--repeats 5] [--epochs 0.25] [--settings alone beside]

Outputs in ``experiments/results/hot_path/``: ``results.json`` (every run, load average before each,
CPU model) and ``table.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments._machine import cpu_model
from experiments.bench_against_commit import ROOT, TRAIN, _env, base_and_head, ms_per_update

OUT = ROOT / "experiments" / "results" / "hot_path"
#: seconds the neighbour gets to start training before the measured job starts
NEIGHBOUR_START_S = 12.0


def start_neighbour(tree: Path, work: Path) -> subprocess.Popen:
    """A long 4-party job from ``tree`` in its own process group (so that it can be ended whole)."""
    cli = ["-c", "import sys; from vfl.cli import main; sys.exit(main())"]
    return subprocess.Popen([sys.executable, *cli, *TRAIN, "--epochs", "50", "--eval-every", "50",
                             "--out", str(work / "neighbour"), "--no-progress"], cwd=tree, env=_env(tree),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def end(proc: subprocess.Popen) -> None:
    """End the neighbour's whole process group (launcher, mpiexec, ranks)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def beside_a_job(setting: str, tree: Path):
    """For ``setting`` "beside": a long 4-party job from ``tree`` started, training (or an error), for the
    body, then ended; otherwise nothing. Yields the neighbour's process, or None."""
    with tempfile.TemporaryDirectory(prefix="neighbour-") as work:
        neighbour = None
        if setting == "beside":
            neighbour = start_neighbour(tree, Path(work))
            time.sleep(NEIGHBOUR_START_S)
            if neighbour.poll() is not None:
                raise RuntimeError(f"the neighbour job ended early (exit {neighbour.returncode})")
        try:
            yield neighbour
        finally:
            if neighbour is not None:
                end(neighbour)


def one_run(trees: dict[str, Path], name: str, setting: str, epochs: float, seed: int) -> dict:
    load = os.getloadavg()[0]
    with beside_a_job(setting, trees["base"]):
        ms = ms_per_update(trees[name], epochs, seed)
    run = {"tree": name, "setting": setting, "repeat": seed, "ms_per_update": ms, "load_before": load,
           "load_after": os.getloadavg()[0]}
    print(f"  {setting:6} {name} #{seed}: {ms:.3f} ms per update (load {load:.2f})", flush=True)
    return run


def measure(trees: dict[str, Path], settings: list[str], repeats: int, epochs: float) -> list[dict]:
    for tree in trees.values():
        ms_per_update(tree, epochs, seed=99)  # warm-up: numba's cache, the OS's file cache
    runs = []
    for rep in range(repeats):
        for setting in settings:
            order = list(trees) if rep % 2 == 0 else list(reversed(trees))
            runs += [one_run(trees, name, setting, epochs, rep) for name in order]
    return runs


def table(meta: dict, runs: list[dict]) -> str:
    lines = ["| setting | tree | commit | ms per dominated update, median (min–max) | load before |",
             "|---|---|---|---|---|"]
    for setting in dict.fromkeys(r["setting"] for r in runs):
        medians = {}
        for tree in dict.fromkeys(r["tree"] for r in runs):
            mine = [r for r in runs if r["tree"] == tree and r["setting"] == setting]
            ms = [r["ms_per_update"] for r in mine]
            loads = [r["load_before"] for r in mine]
            medians[tree] = statistics.median(ms)
            lines.append(f"| {setting} | {tree} | `{meta['commits'][tree]}` | {medians[tree]:.3f} "
                         f"({min(ms):.3f}–{max(ms):.3f}) | {min(loads):.1f}–{max(loads):.1f} |")
        if "base" in medians and "head" in medians:
            lines.append(f"| {setting} | base / head | | **{medians['base'] / medians['head']:.2f}×** | |")
    lines.append(f"\n{meta['cpu']}; command: `{meta['command']}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments hot_path", description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the earlier commit (any git revision)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--epochs", type=float, default=0.25, help="epochs of each measured a9a job")
    p.add_argument("--settings", nargs="+", choices=["alone", "beside"], default=["alone", "beside"])
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    with base_and_head(args.base, "hot-path-base-") as (trees, commits):
        started = time.time()
        runs = measure(trees, args.settings, args.repeats, args.epochs)
    meta = {"cpu": cpu_model(), "started": started, "commits": commits,
            "command": "python -m experiments hot_path " + " ".join(argv or sys.argv[1:])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({**meta, "runs": runs}, indent=2) + "\n")
    (args.out / "table.md").write_text(table(meta, runs))
    print(table(meta, runs))
    return {**meta, "runs": runs}


if __name__ == "__main__":
    main()
