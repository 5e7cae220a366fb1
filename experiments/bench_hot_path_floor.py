"""The B = 1 exchange compiled (no Python per message) against ``vfl train``, alone and beside a second job.

Issue 30, item 1 asks for ≥ 3× on ``vfl train -n 4 -m 4 --dataset a9a --algorithm sgd -B 1 --gamma 0.1``
and proposes a structural change: the receive–aggregate–reply loop compiled, out of the GIL, one thread per
rank. Before that is built into the runtime, this measures what it can give on this machine:
``experiments/_hot_path_floor_rank.py`` runs the same exchange (requests, both masked trees of the job's tree
pairs, ϑ dispatch, every party's step; checks at each receive) in one numba loop per rank, calling MPI by
name. Its time per update is a floor for that design here (it leaves out liveness, sealing, segments
and evaluation). The two run alternately, job by job, in two settings:

* **alone**: only the measured job (and whatever else the machine runs: the load is recorded);
* **beside**: the benchmark first starts a long 4-party ``vfl train`` job of the same command, waits until
  it trains, runs the measured job, then ends it.

    python -m experiments hot_path_floor [--repeats 5] [--epochs 0.25] [--settings alone beside]

Outputs in ``experiments/results/hot_path_floor/``: ``results.json`` (every run, load average before it,
CPU model), ``table.md`` and ``floor.png``.
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
from experiments.bench_against_commit import ROOT, _env, ms_per_update
from experiments.bench_hot_path import beside_a_job

OUT = ROOT / "experiments" / "results" / "hot_path_floor"
RANK = ROOT / "experiments" / "_hot_path_floor_rank.py"
#: a9a's training rows (the seeded 80/20 split of its 32,561): one epoch of the job is this many updates
A9A_TRAIN_ROWS = 26_049
#: the methods, each with its colour: ``vfl train``, and the compiled loop waiting in MPICH's spinning
#: ``MPI_Recv`` or probing and yielding the core between probes
COLOURS = {"vfl train": "tab:blue", "compiled, spinning": "tab:orange", "compiled, yielding": "tab:green"}


def compiled_ms(epochs: float, *, wait: str = "spin", mode: str = "", dataset: str = "a9a",
                rows: int = A9A_TRAIN_ROWS, gamma: float = 0.1) -> dict:
    """One run of the compiled loop (4 ranks; ``wait`` ``spin`` or ``yield``, ``mode`` ``check`` or
    ``forge``: the rank program's doc): its result (ms per update, accuracy)."""
    per_dominator = max(1, round(epochs * rows / 4))
    from experiments._hot_path_floor_rank import compile_once

    compile_once()
    mpiexec = Path(sys.executable).parent / "mpiexec"
    with tempfile.TemporaryDirectory(prefix="hot-path-floor-") as work:
        out = Path(work) / "result.json"
        cmd = [str(mpiexec), "-n", "4", sys.executable, str(RANK), dataset, str(per_dominator), str(gamma),
               str(out), wait]
        proc = subprocess.run(cmd + ([mode] if mode else []), cwd=ROOT, env=_env(ROOT), text=True,
                              capture_output=True, timeout=600)
        if proc.returncode:
            said = sorted(p.read_text().strip() for p in Path(work).glob("result.json.error-*"))
            raise RuntimeError(f"the compiled loop failed (exit {proc.returncode}): "
                               f"{'; '.join(said) or proc.stderr.strip()[-500:]}")
        return json.loads(out.read_text())


def one_run(method: str, setting: str, epochs: float, repeat: int) -> dict:
    load = os.getloadavg()[0]
    with beside_a_job(setting, ROOT):
        if method == "vfl train":
            ms, extra = ms_per_update(ROOT, epochs, repeat), {}
        else:
            extra = compiled_ms(epochs, wait="yield" if method.endswith("yielding") else "spin")
            ms = extra.pop("ms_per_update")
    print(f"  {setting:6} {method:13} #{repeat}: {ms:.3f} ms per update (load {load:.2f})", flush=True)
    return {"method": method, "setting": setting, "repeat": repeat, "ms_per_update": ms, "load_before": load,
            "load_after": os.getloadavg()[0], **extra}


def measure(settings: list[str], repeats: int, epochs: float) -> list[dict]:
    ms_per_update(ROOT, epochs, seed=99)  # warm-up: numba's cache, the OS's file cache
    for wait in ("spin", "yield"):  # and a check that the masks cancel (γ = 0, z against Σ w·x)
        compiled_ms(0.02, wait=wait, mode="check")
    runs = []
    for rep in range(repeats):
        for setting in settings:
            order = list(COLOURS) if rep % 2 == 0 else list(reversed(COLOURS))
            runs += [one_run(method, setting, epochs, rep) for method in order]
    return runs


def table(meta: dict, runs: list[dict]) -> str:
    lines = ["| setting | method | ms per update, median (min–max) | load before |", "|---|---|---|---|"]
    for setting in dict.fromkeys(r["setting"] for r in runs):
        medians = {}
        for method in COLOURS:
            mine = [r for r in runs if r["method"] == method and r["setting"] == setting]
            ms, loads = [r["ms_per_update"] for r in mine], [r["load_before"] for r in mine]
            medians[method] = statistics.median(ms)
            lines.append(f"| {setting} | {method} | {medians[method]:.3f} ({min(ms):.3f}–{max(ms):.3f}) | "
                         f"{min(loads):.1f}–{max(loads):.1f} |")
        for method in list(COLOURS)[1:]:
            ratio = medians["vfl train"] / medians[method]
            lines.append(f"| {setting} | vfl train / {method} | **{ratio:.1f}×** | |")
    accuracy = [r["test_accuracy"] for r in runs if "test_accuracy" in r]
    if accuracy:
        lines.append(f"\nThe compiled loop's test accuracy: {min(accuracy):.4f}–{max(accuracy):.4f}.")
    lines.append(f"\n{meta['cpu']}; command: `{meta['command']}`")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> None:
    from experiments._plotting import pyplot, save

    settings = list(dict.fromkeys(r["setting"] for r in runs))
    fig, ax = pyplot().subplots(figsize=(6, 3.5), layout="constrained")
    for k, method in enumerate(COLOURS):
        for s, setting in enumerate(settings):
            ms = [r["ms_per_update"] for r in runs if r["method"] == method and r["setting"] == setting]
            ax.scatter([s + (k - 1) * 0.25] * len(ms), ms, color=COLOURS[method], s=18,
                       label=method if s == 0 else None)
    ax.set_xticks(range(len(settings)), settings)
    ax.set_xlim(-0.5, len(settings) - 0.5)
    ax.set_yscale("log")
    ax.set_ylabel("ms per dominated update (log)")
    ax.set_title("B = 1, a9a, q = 4, m = 4: runs alternating")
    ax.legend()
    ax.set_xlabel("setting")
    save(fig, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments hot_path_floor",
                                description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--epochs", type=float, default=0.25, help="epochs of each measured a9a job")
    p.add_argument("--settings", nargs="+", choices=["alone", "beside"], default=["alone", "beside"])
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    started = time.time()
    runs = measure(args.settings, args.repeats, args.epochs)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], text=True,
                            capture_output=True).stdout.strip()
    meta = {"cpu": cpu_model(), "started": started, "commit": commit,
            "command": " ".join(["python -m experiments hot_path_floor", *given])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({**meta, "runs": runs}, indent=2) + "\n")
    (args.out / "table.md").write_text(table(meta, runs))
    plot(runs, args.out / "floor.png")
    print(table(meta, runs))
    return {**meta, "runs": runs}


if __name__ == "__main__":
    main()
