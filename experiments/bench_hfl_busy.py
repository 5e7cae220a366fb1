"""An HFL round on the idle machine and beside a busy 4-party ``vfl train`` job: the simulation's torch
thread settings side by side, and ``python -m parties.hfl`` with 4 ranks (issue 30's HFL-round goals).

The round: FedAvg, MLP 784-256-128-10 on Fashion-MNIST, N = 200, S = 20, K = 10, B = 32 (``hfl_quick``'s
setting). Each run is a fresh process (OpenMP reads ``OMP_WAIT_POLICY`` once, when torch loads) and its
number is the median of ``--rounds`` rounds after a warm-up round. Configurations alternate run by run
(the order reversed every other repetition). **beside**: each repetition first starts a 4-party a9a job
(``vfl train -n 4 -m 4 --dataset a9a --algorithm sgd -B 1 --gamma 0.1 --epochs 50``) in a temporary
folder, gives it a few seconds to start training, runs every configuration beside it, then kills it.
``--neighbour-base REV`` adds a setting beside the same job from an earlier commit (a temporary
checkout), alternating with this tree's: what a change to the neighbour does to the round.

    python -m experiments hfl_busy [--repeats 3] [--rounds 5] [--settings idle beside] [--configs ...]
                                   [--neighbour-base REV]

Outputs under ``--out`` (``experiments/results/hfl_busy/``): ``runs.csv`` (every run, with the 1-min
load average before and after it), ``table.md``, ``rounds.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments._machine import cpu_model
from experiments.bench_against_commit import ROOT, _env, base_and_head, ms_per_update
from experiments.bench_hot_path import beside_a_job
from parties.threads import available_cpus

OUT = ROOT / "experiments" / "results" / "hfl_busy"
#: issue 30's goals, seconds per FedAvg round: idle, beside the 4-party job
GOALS = {"idle": 0.13, "beside": 0.4}
#: OpenMP's variables a configuration sets or clears (nothing inherited from the caller's shell)
OMP_VARIABLES = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")
MPI_JOB = ["--algorithm", "fedavg", "--dataset", "fashion-mnist", "--model", "mlp", "--clients", "200",
           "--per-round", "20", "--local-steps", "10", "--batch-size", "32", "--eval-every", "100000",
           "-P", "3", "--no-progress"]


def configurations(cores: int) -> dict[str, dict]:
    """name -> how a run of it starts: ``env`` (OpenMP variables; the caller's are cleared), ``args`` of
    ``experiments._hfl_rounds``, ``torch_first`` (torch loads before ``experiments`` sets its
    OpenMP default: OpenMP's own spinning default, as before), or ``mpi`` for the parties.hfl job. Keys
    in a fixed order: the colours."""
    return {
        f"default: {cores} threads, GOMP_SPINCOUNT=10000": {"env": {}, "args": []},
        f"before: torch's {cores} threads, spinning": {"env": {}, "args": [], "torch_first": True},
        "1 thread": {"env": {}, "args": ["--compute-threads", "1"]},
        "parties.hfl, 4 ranks (P = 3)": {"mpi": True},
        f"{cores} threads, never spinning (OMP_WAIT_POLICY=PASSIVE)": {"env": {"OMP_WAIT_POLICY": "PASSIVE"},
                                                                       "args": []},
        f"{cores} threads, GOMP_SPINCOUNT=100000": {"env": {"GOMP_SPINCOUNT": "100000"}, "args": []},
    }


def simulation_run(config: dict, rounds: int) -> list[float]:
    env = {k: v for k, v in _env(ROOT).items() if k not in OMP_VARIABLES}
    argv = ["--rounds", str(rounds), *config["args"]]
    if config.get("torch_first"):
        start = ["-c", "import runpy, sys, torch; sys.argv[1:] = " + repr(argv) +
                 "; runpy.run_module('experiments._hfl_rounds', run_name='__main__')"]
    else:
        start = ["-m", "experiments._hfl_rounds", *argv]
    out = subprocess.run([sys.executable, *start], env={**env, **config["env"]}, cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def mpi_run(rounds: int) -> list[float]:
    """``python -m parties.hfl`` with a server and 3 client ranks: its rounds after the first."""
    env = {k: v for k, v in _env(ROOT).items() if k not in OMP_VARIABLES}
    with tempfile.TemporaryDirectory(prefix="hfl-busy-") as work:
        subprocess.run([sys.executable, "-m", "parties.hfl", *MPI_JOB, "--rounds", str(rounds + 1),
                        "--out", work], env=env, cwd=ROOT, check=True, capture_output=True, text=True,
                       timeout=900)
        records = [json.loads(line) for line in Path(work, "metrics.jsonl").read_text().splitlines()]
    return [r["round_seconds"] for r in records[1:]]


def one_run(name: str, config: dict, setting: str, repeat: int, rounds: int, neighbour) -> dict:
    load = os.getloadavg()[0]
    seconds = mpi_run(rounds) if config.get("mpi") else simulation_run(config, rounds)
    alive = neighbour is None or neighbour.poll() is None
    if not alive:
        raise RuntimeError(f"the neighbour job ended during {name!r} (exit {neighbour.returncode})")
    run = {"setting": setting, "config": name, "repeat": repeat,
           "seconds_per_round": statistics.median(seconds), "rounds": " ".join(f"{s:.4f}" for s in seconds),
           "load_before": load,
           "load_after": os.getloadavg()[0]}
    print(f"  {setting:6} {name:44} #{repeat}: {run['seconds_per_round']:.3f} s per round "
          f"(load {load:.2f} -> {run['load_after']:.2f})", flush=True)
    return run


def measure(configs: dict[str, dict], settings: list[str], repeats: int, rounds: int,
            neighbours: dict[str, Path] | None = None) -> list[dict]:
    """Every run; ``neighbours``: the tree whose 4-party job each "beside …" setting starts (this one's
    for plain "beside")."""
    runs = []
    for rep in range(repeats):
        for setting in (settings if rep % 2 == 0 else list(reversed(settings))):
            order = list(configs) if rep % 2 == 0 else list(reversed(configs))
            tree = (neighbours or {}).get(setting, ROOT)
            with beside_a_job(setting.split()[0], tree) as neighbour:
                runs += [one_run(name, configs[name], setting, rep, rounds, neighbour) for name in order]
    return runs


def table(runs: list[dict], configs: list[str], command: str) -> str:
    settings = list(dict.fromkeys(r["setting"] for r in runs))
    head = " | ".join(f"{s} (goal ≤ {GOALS[s.split()[0]]} s)" for s in settings)
    lines = [f"| configuration | {head} |", "|---|" + "---:|" * len(settings)]
    for name in configs:
        cells = []
        for setting in settings:
            values = [r["seconds_per_round"] for r in runs if r["config"] == name and r["setting"] == setting]
            cells.append(f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})" if values
                         else "–")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    default = next((n for n in configs if n.startswith("default")), None)
    mpi = next((n for n in configs if n.startswith("parties.hfl")), None)
    if mpi is not None and default is not None:
        pairs = [(_median(runs, mpi, s), _median(runs, default, s)) for s in settings]
        ratios = [f"{a / b:.2f}×" if a and b else "–" for a, b in pairs]
        lines.append(f"| parties.hfl ÷ the simulation's default (goal ≤ 1.5×) | {' | '.join(ratios)} |")
    loads = "; ".join(
        f"{s}: {min(r['load_before'] for r in runs if r['setting'] == s):.2f}–"
        f"{max(r['load_before'] for r in runs if r['setting'] == s):.2f}" for s in settings)
    repeats = max(r["repeat"] for r in runs) + 1
    lines.append(f"\nSeconds per FedAvg round (MLP, N = 200, S = 20, K = 10, B = 32), median of {repeats} "
                 f"runs (min–max), each run the median of its rounds after a warm-up round. {cpu_model()}; "
                 f"1-min load average before the runs: {loads}. Command: `{command}`.")
    return "\n".join(lines) + "\n"


def _median(runs: list[dict], config: str, setting: str) -> float | None:
    values = [r["seconds_per_round"] for r in runs if r["config"] == config and r["setting"] == setting]
    return statistics.median(values) if values else None


def figure(runs: list[dict], configs: list[str], path: Path) -> None:
    from matplotlib.ticker import ScalarFormatter

    from experiments._plotting import colours, figure_legend, pyplot, save

    settings = list(dict.fromkeys(r["setting"] for r in runs))
    colour = colours(configs)
    fig, axes = pyplot().subplots(1, len(settings), figsize=(5 * len(settings), 4), layout="constrained",
                                  squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        for name in configs:
            values = [r["seconds_per_round"] for r in runs if r["config"] == name and r["setting"] == setting]
            ax.plot(range(1, len(values) + 1), values, "o-", color=colour[name], label=name)
        ax.axhline(GOALS[setting.split()[0]], color="black", ls=":", label="issue 30's goal")
        repeats = max(r["repeat"] for r in runs) + 1
        ax.set(yscale="log", xlabel="repetition (configurations alternate)", ylabel="seconds per round",
               xticks=range(1, repeats + 1),
               title={"idle": "no job of ours beside", "beside": "beside a 4-party vfl train job"}.get(
                    setting, setting.replace("'s job", "'s 4-party job")))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(ScalarFormatter())
    figure_legend(fig, ncol=3)
    save(fig, path)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m experiments hfl_busy", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5, help="rounds timed per run, after a warm-up round")
    p.add_argument("--settings", nargs="+", choices=list(GOALS), default=list(GOALS))
    every = configurations(available_cpus())
    listing = "; ".join(f"{i}: {n}" for i, n in enumerate(every))
    p.add_argument("--configs", nargs="+", type=int, metavar="I", default=list(range(len(every))),
                   help=f"which configurations, by index: {listing}")
    p.add_argument("--neighbour-base", metavar="REV",
                   help="also run beside the 4-party job of this earlier commit (a temporary checkout), "
                        "alternating with this tree's job: what a change to the neighbour does to the round")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.rounds < 1 or not set(args.configs) <= set(range(len(every))):
        p.error("--repeats and --rounds must be at least 1, --configs indices from the list")
    names = [n for i, n in enumerate(every) if i in args.configs]
    with contextlib.ExitStack() as stack:
        settings, neighbours = list(args.settings), {}
        if args.neighbour_base:  # the same runs beside the earlier commit's job too, alternating
            trees, commits = stack.enter_context(base_and_head(args.neighbour_base, "hfl-busy-base-"))
            ms_per_update(trees["base"], 0.05, seed=99)  # its numba cache, before it is timed beside
            settings.append(f"beside {commits['base']}'s job")
            neighbours[settings[-1]] = trees["base"]
        runs = measure({n: every[n] for n in names}, settings, args.repeats, args.rounds, neighbours)
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "runs.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(runs[0]))
        writer.writeheader()
        writer.writerows(runs)
    command = "python -m experiments hfl_busy " + " ".join(sys.argv[2:] if argv is None else argv)
    (args.out / "table.md").write_text(table(runs, names, command.strip()))
    figure(runs, names, args.out / "rounds.png")
    print((args.out / "table.md").read_text())
    return runs


if __name__ == "__main__":
    main()
