"""An a9a HE-SGD epoch per stage and rank, this tree against an earlier commit, side by side (issue 30,
item 3: the encrypted-label epoch).

Each job is ``vfl train`` on a9a, q = 4 parties, m = 1, HE-SGD, OU 2048 bits, γ = 0.5, one epoch (the
command of ``python -m experiments label_he_pack``), at each B, packed and unpacked; the two trees
alternate job by job (the first of each pair swaps from run to run) with the same seed, so load drifts
hit both. The earlier commit is checked out with ``git worktree add --detach`` into a temporary folder.

Every rank of every job runs with the stage timers of ``experiments/_he_stage_timer.py`` (a
``sitecustomize`` this script writes; the measured code is unchanged): wall seconds and the calling
thread's CPU seconds in each HE step (encryption of ϑ, decryption, column sums, masks, waits), and the
rank's CPU seconds from its first HE step on. HEU computes on a thread pool, so the per-stage CPU is the
calling thread's share only; the rank's CPU is the whole.

    python -m experiments label_he_overlap --base REV [--batches 256 1024] [--runs 3] [--out DIR]

Outputs in ``experiments/results/label_he_overlap/`` (or ``--out``): ``results.json`` (every job with
its stages, CPU model, loads, commits), ``results.csv`` and ``table.md``.
"""

from __future__ import annotations

import argparse
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
from experiments._vfb2_runner import write_rows
from experiments.bench_label_he_pack import TRAIN

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "results" / "label_he_overlap"
TIMER = Path(__file__).resolve().parent / "_he_stage_timer.py"
SITE = f'''import importlib.util, os
if os.environ.get("VFL_HE_STAGES"):
    _spec = importlib.util.spec_from_file_location("_he_stage_timer", {str(TIMER)!r})
    _timer = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_timer)
    _timer.install()
'''


def _env(tree: Path, site: Path, stages: Path) -> dict[str, str]:
    shared = ROOT.parent / "shared" / "data"
    data = {"VFL_DATA_DIR": str(shared)} if shared.is_dir() and "VFL_DATA_DIR" not in os.environ else {}
    return {**os.environ, **data, "PYTHONPATH": f"{site}{os.pathsep}{tree}", "VFL_HE_STAGES": str(stages),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def job(tree: Path, site: Path, batch: int, packed: bool, seed: int) -> dict:
    """One epoch in ``tree``: seconds, accuracy, and per rank its CPU and stages."""
    args = [*TRAIN, "-B", str(batch), "--seed", str(seed), "--epochs", "1", "--eval-every", "1",
            *(["--he-pack"] if packed else [])]
    with tempfile.TemporaryDirectory(prefix="label-he-overlap-") as work:
        stages = Path(work) / "stages"
        stages.mkdir()
        proc = subprocess.run([sys.executable, "-c", "import sys; from vfl.cli import main; sys.exit(main())",
                               *args, "--out", f"{work}/run"], cwd=tree, env=_env(tree, site, stages),
                              capture_output=True, text=True, timeout=1800, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"vfl {' '.join(args)} in {tree} exited {proc.returncode}:\n"
                               f"{proc.stderr[-3000:]}")
        result = json.loads((Path(work) / "run" / "result.json").read_text())
        ranks = [json.loads(f.read_text()) for f in sorted(stages.glob("[0-9]*.json"))]
    return {"seconds_per_epoch": result["train_time"] / result["epochs"],
            "test_accuracy": result["record"]["test_accuracy"], "loss": result["record"]["loss"],
            "command": "vfl " + " ".join(args),
            "ranks": [{"rank": r["rank"], "stages": r["stages"],
                       "cpu_s": r["process_cpu_s"] - (r["cpu_before_first_stage_s"] or 0.0)} for r in ranks]}


def _stage_rows(rs: list[dict]) -> list[str]:
    """Median over the runs: the dominator's and the mean passive party's CPU and wall per stage."""
    names = sorted({name for r in rs for rank in r["ranks"] for name in rank["stages"]})
    cells = []
    for role, pick in (("dominator", lambda k: k["rank"] == 0), ("passive (mean)", lambda k: k["rank"] != 0)):
        cpu = statistics.median(statistics.mean(k["cpu_s"] for k in r["ranks"] if pick(k)) for r in rs)
        parts = [f"rank CPU {cpu:.2f}"]
        for name in names:
            walls = [statistics.mean(k["stages"].get(name, {}).get("wall_s", 0.0)
                                     for k in r["ranks"] if pick(k)) for r in rs]
            if statistics.median(walls) >= 0.005:
                parts.append(f"{name} {statistics.median(walls):.2f}")
        cells.append(f"{role}: " + ", ".join(parts))
    return cells


def write(out: Path, meta: dict, runs: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({**meta, "runs": runs}, indent=1) + "\n")
    write_rows(out / "results.csv", [{k: v for k, v in r.items() if k != "ranks"} for r in runs])
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["batch"], r["decryption"], r["tree"]), []).append(r)
    lines = ["| B | decryption | tree | s per epoch: median (each run) | test accuracy: mean (each run) | "
             "load before each run |", "|---|---|---|---|---|---|"]
    stage_lines = ["| B | decryption | tree | seconds per epoch and stage, median of the runs |",
                   "|---|---|---|---|"]
    for (batch, kind, tree), rs in sorted(groups.items()):
        sec, acc = [r["seconds_per_epoch"] for r in rs], [100 * r["test_accuracy"] for r in rs]
        before = ", ".join(f"{r['load_before']:.1f}" for r in rs)
        lines.append(f"| {batch} | {kind} | {tree} ({meta['commits'][tree]}) | {statistics.median(sec):.2f} "
                     f"({', '.join(f'{s:.2f}' for s in sec)}) | {statistics.mean(acc):.2f} % "
                     f"({', '.join(f'{a:.2f}' for a in acc)}) | {before} |")
        stage_lines.append(f"| {batch} | {kind} | {tree} | {'<br>'.join(_stage_rows(rs))} |")
    loads = [r["load_before"] for r in runs] + [r["load_after"] for r in runs]
    lines.append(f"\n{meta['cpu']}; load average {min(loads):.1f}–{max(loads):.1f} over the jobs; command: "
                 f"`{meta['command']}`; each job: `{runs[0]['command']}` (its -B, --seed, --he-pack)\n")
    (out / "table.md").write_text("\n".join(lines + stage_lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments label_he_overlap",
                                description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the earlier commit (any git revision)")
    p.add_argument("--batches", nargs="+", type=int, default=[256, 1024])
    p.add_argument("--decryption", nargs="+", choices=["unpacked", "packed"], default=["unpacked", "packed"])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)

    def rev(name: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", name], check=True,
                              capture_output=True, text=True).stdout.strip()

    temp = Path(tempfile.mkdtemp(prefix="label-he-overlap-"))
    (temp / "site").mkdir()
    (temp / "site" / "sitecustomize.py").write_text(SITE)
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(temp / "base"),
                    args.base], check=True, capture_output=True)
    trees = {"base": temp / "base", "head": ROOT}
    runs: list[dict] = []
    try:
        for run in range(args.runs):
            for batch in args.batches:
                for kind in args.decryption:
                    for tree in (("base", "head") if run % 2 == 0 else ("head", "base")):
                        load = os.getloadavg()[0]
                        found = job(trees[tree], temp / "site", batch, kind == "packed", run)
                        runs.append({"batch": batch, "decryption": kind, "tree": tree, "seed": run, **found,
                                     "load_before": load, "load_after": os.getloadavg()[0]})
                        print(f"[label_he_overlap] B={batch} {kind} {tree} seed={run}: "
                              f"{found['seconds_per_epoch']:.2f} s/epoch, test "
                              f"{100 * found['test_accuracy']:.2f} % (load {load:.1f})", flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(temp / "base")],
                       check=False, capture_output=True)
        shutil.rmtree(temp, ignore_errors=True)
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                check=True, capture_output=True, text=True).stdout.strip())
    meta = {"cpu": cpu_model(), "started": time.time(),
            "commits": {"base": rev(args.base), "head": rev("HEAD") + ("+" if dirty else "")},
            "command": "python -m experiments label_he_overlap " + " ".join(argv or sys.argv[1:])}
    write(args.out, meta, runs)
    print((args.out / "table.md").read_text())


if __name__ == "__main__":
    main()
