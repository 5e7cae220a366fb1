"""``--label-privacy he`` in whole jobs: OU against Paillier, and the label-DP noise on ϑ (this tree)
against the noise on the decrypted batch gradients (an earlier commit), side by side.

Each job is ``vfl train`` on a9a, q = 4 parties, m = 1, HE-SGD with B = 256 and γ = 0.5 (the setting of
``experiments/results/README.md``, "HE with label-DP noise"), run as its own command line in its own
checkout: ``new`` is this tree, ``old`` the ``--base`` commit checked out with ``git worktree add
--detach`` into a temporary folder (removed at the end), where ``--epsilon`` added N(0, (σC)²) to each
decrypted batch gradient coordinate. The two alternate job by job, so that load drifts hit both. Time
per epoch is the run's training time over its epochs (``result.json``: key generation and loading not
included); accuracy is the last evaluation's test accuracy. The noise comes from OS entropy, so runs
differ by design even with one seed.

    python -m experiments label_he_jobs [--base REV] [--schemes ou paillier] [--noise new old]
        [--epsilons 4 none] [--seeds 0 1] [--epochs 1] [--out DIR]
    python -m experiments label_he_jobs --render DIR     # redraw DIR's table and plot

``none`` among the ε's is HE without noise (the same in both trees: run in ``new`` only). Outputs in
``experiments/results/label_he_jobs/`` (or ``--out``): ``results.json`` (every job, load average before
and after each, CPU model, command), ``results.csv``, ``table.md`` and ``label_he_jobs.png``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments._machine import cpu_model

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "results" / "label_he_jobs"
#: the commit before the noise moved into the ciphertexts
DEFAULT_BASE = "32a3fe1"
TRAIN = ["train", "-n", "4", "-m", "1", "--dataset", "a9a", "--algorithm", "sgd", "-B", "256",
         "--gamma", "0.5", "--label-privacy", "he", "--no-reference", "--no-progress"]
#: (noise, scheme) → colour, fixed across plots
COLOURS = {("new", "ou"): "tab:blue", ("old", "ou"): "tab:gray", ("new", "paillier"): "tab:green",
           ("old", "paillier"): "tab:olive", ("none", "ou"): "tab:purple", ("none", "paillier"): "tab:pink"}


def _env(tree: Path) -> dict[str, str]:
    """The tree's own packages first; the data where this checkout finds it (a temporary checkout has no
    ``../shared/data`` beside it)."""
    shared = ROOT.parent / "shared" / "data"
    data = {"VFL_DATA_DIR": str(shared)} if shared.is_dir() and "VFL_DATA_DIR" not in os.environ else {}
    return {**os.environ, **data, "PYTHONPATH": str(tree),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def job(tree: Path, scheme: str, epsilon: str, seed: int, epochs: float) -> dict:
    """One ``vfl train`` run in ``tree``: seconds per epoch of training and the final test accuracy."""
    noise = [] if epsilon == "none" else ["--epsilon", epsilon]
    with tempfile.TemporaryDirectory(prefix="label-he-jobs-") as work:
        args = [*TRAIN, "--he-scheme", scheme, *noise, "--seed", str(seed), "--epochs", f"{epochs:g}",
                "--eval-every", f"{epochs:g}", "--out", f"{work}/run"]
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", "import sys; from vfl.cli import main; sys.exit(main())",
                               *args], cwd=tree, env=_env(tree), capture_output=True, text=True,
                              timeout=7200, check=False)
        wall = time.monotonic() - started
        if proc.returncode != 0:
            raise RuntimeError(f"vfl {' '.join(args)} in {tree} exited {proc.returncode}:\n"
                               f"{proc.stderr[-3000:]}")
        result = json.loads((Path(work) / "run" / "result.json").read_text())
        config = json.loads((Path(work) / "run" / "config.json").read_text())
    return {"seconds_per_epoch": result["train_time"] / result["epochs"], "wall_s": wall,
            "test_accuracy": result["record"]["test_accuracy"], "epochs": result["epochs"],
            "updates": result["updates"], "noise_multiplier": config.get("noise_multiplier"),
            "command": "vfl " + " ".join(args[:-2])}


def checkout(rev: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(into), rev],
                   check=True, capture_output=True)
    return into


def plan(args) -> list[tuple[str, str, str, int]]:
    """(noise, scheme, ε, seed) of every job, the trees alternating within each (scheme, ε, seed)."""
    jobs = []
    for seed in args.seeds:
        for scheme in args.schemes:
            for epsilon in args.epsilons:
                trees = ["none"] if epsilon == "none" else list(args.noise)
                if len(jobs) % 2:
                    trees.reverse()
                jobs += [(tree, scheme, epsilon, seed) for tree in trees]
    return jobs


def write(out: Path, meta: dict, runs: list[dict]) -> None:
    from experiments._plotting import figure_legend, pyplot, save

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({**meta, "runs": runs}, indent=1) + "\n")
    with open(out / "results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(runs[0]))
        writer.writeheader()
        writer.writerows(runs)
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["scheme"], r["epsilon"], r["noise"]), []).append(r)
    lines = ["| scheme | ε | noise | test accuracy: mean (each run) | s per epoch: median (each run) | σ |",
             "|---|---|---|---|---|---|"]
    for (scheme, epsilon, noise), rs in groups.items():
        acc = [100 * r["test_accuracy"] for r in rs]
        sec = [r["seconds_per_epoch"] for r in rs]
        sigma = rs[0]["noise_multiplier"]
        lines.append(f"| {scheme} | {epsilon} | {noise} | {statistics.mean(acc):.2f} % "
                     f"({', '.join(f'{a:.2f}' for a in acc)}) | {statistics.median(sec):.1f} "
                     f"({', '.join(f'{s:.1f}' for s in sec)}) | {'-' if sigma is None else f'{sigma:.3g}'} |")
    loads = [r["load_before"] for r in runs] + [r["load_after"] for r in runs]
    lines.append(f"\n{meta['cpu']}; load average {min(loads):.1f}–{max(loads):.1f} over the jobs; "
                 f"`old` = commit `{meta['base']}`, `new` = this tree; command: `{meta['command']}`; "
                 f"each job: `{runs[0]['command']}` (with its --he-scheme, --epsilon, --seed, --epochs)")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 4), layout="constrained")
    epsilons = sorted({r["epsilon"] for r in runs}, key=lambda e: float("inf") if e == "none" else float(e))
    for ax, key, label in ((axes[0], "test_accuracy", "test accuracy (%)"),
                           (axes[1], "seconds_per_epoch", "seconds per epoch")):
        kinds = sorted({(noise, scheme) for (scheme, _, noise) in groups})
        for (scheme, epsilon, noise), rs in groups.items():
            x = epsilons.index(epsilon) + 0.12 * (kinds.index((noise, scheme)) - (len(kinds) - 1) / 2)
            ys = [r[key] * (100 if key == "test_accuracy" else 1) for r in rs]
            ax.scatter([x] * len(ys), ys, color=COLOURS[(noise, scheme)], label=f"{scheme}, noise {noise}")
        ax.set_xticks(range(len(epsilons)), [f"ε = {e}" if e != "none" else "no noise" for e in epsilons])
        ax.set_xlabel("label-DP budget")
        ax.set_ylabel(label)
    axes[1].set_yscale("log")
    figure_legend(fig)
    save(fig, out / "label_he_jobs.png")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default=DEFAULT_BASE, help="the commit whose --epsilon noised the decrypted "
                   "gradients (default: the one before this change)")
    p.add_argument("--schemes", nargs="+", default=["ou", "paillier"], choices=["ou", "paillier"])
    p.add_argument("--noise", nargs="+", default=["new", "old"], choices=["new", "old"])
    p.add_argument("--epsilons", nargs="+", default=["4"], help="ε values, or none (HE without noise)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
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
    with tempfile.TemporaryDirectory(prefix="label-he-base-") as tmp:
        trees = {"new": ROOT, "none": ROOT}
        if "old" in args.noise and any(e != "none" for e in args.epsilons):
            trees["old"] = checkout(args.base, Path(tmp) / "base")
        try:
            for noise, scheme, epsilon, seed in plan(args):
                load = os.getloadavg()[0]
                found = job(trees[noise], scheme, epsilon, seed, args.epochs)
                runs.append({"noise": noise, "scheme": scheme, "epsilon": epsilon, "seed": seed, **found,
                             "load_before": load, "load_after": os.getloadavg()[0]})
                print(f"[label_he_jobs] {scheme} ε={epsilon} noise={noise} seed={seed}: test "
                      f"{100 * found['test_accuracy']:.2f} %, {found['seconds_per_epoch']:.1f} s/epoch "
                      f"(load {load:.1f})", flush=True)
        finally:
            if "old" in trees:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(trees["old"])],
                               check=False, capture_output=True)
    given = argv if argv is not None else sys.argv[1:]
    meta = {"cpu": cpu_model(), "base": args.base,
            "command": "python -m experiments label_he_jobs " + " ".join(given)}
    write(args.out, meta, runs)
    print((args.out / "table.md").read_text())


if __name__ == "__main__":
    main()
