"""Parties on one host (shared memory) vs one network namespace each (TCP over a bridge), side by side.

Each repeat runs, in turn for both placements, the same VFB² job (per dominated update: training
time / updates) and a ping-pong of one float64 between ranks 0 and 1, timed from each end. Placements
alternate within a repeat so a change in the machine's load hits both; every row records the load
average and the CPU model. Needs root and ``ip netns`` (``parties/netns.py``); the namespaces are
removed at the end, also on failure.

    python -m experiments multihost [--dataset breast-cancer] [--algorithm sgd] [--epochs 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from experiments._machine import cpu_model
from experiments._plotting import colours, figure_legend, pyplot, save
from experiments._vfb2_runner import markdown_table, say, write_rows
from parties import netns
from parties.config import RunConfig
from parties.launch import launch, mpiexec_path, reference_f_star

OUT = Path(__file__).resolve().parent / "results" / "multihost"
REPO_ROOT = Path(__file__).resolve().parents[1]
PROBE = REPO_ROOT / "tests" / "mpi_scripts" / "host_probe.py"
PLACEMENTS = ("one host", "one namespace per party")
COLOURS = colours(PLACEMENTS)


def train_once(config: RunConfig, env: dict[str, str]) -> dict:
    """One job; its training time, dominated updates and time per update."""
    with tempfile.TemporaryDirectory(prefix="multihost-") as work:
        code = launch(replace(config, out=work, overwrite=True), extra_env=env, echo=False)
        if code != 0:
            raise RuntimeError(f"the job failed with exit code {code}")
        result = json.loads(Path(work, "result.json").read_text())
    return {"train_seconds": result["train_time"], "updates": result["updates"],
            "ms_per_update": 1e3 * result["train_time"] / result["updates"]}


def pingpong_once(parties: int, trips: int, env: dict[str, str]) -> dict:
    """Median round trip of one float64 between ranks 0 and 1, started from each end (µs)."""
    with tempfile.TemporaryDirectory(prefix="pingpong-") as work:
        cmd = [mpiexec_path(), "-n", str(parties), sys.executable, "-m", "mpi4py", str(PROBE), "--out", work,
               "--pingpong", str(trips)]
        subprocess.run(cmd, check=True, timeout=300, capture_output=True, cwd=REPO_ROOT,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **env})
        reports = [json.loads(Path(work, f"rank-{r}.json").read_text()) for r in (0, 1)]
    return {"rtt_us_0_to_1": 1e6 * float(np.median(reports[0]["rtt_from_0"])),
            "rtt_us_1_to_0": 1e6 * float(np.median(reports[1]["rtt_from_1"]))}


def summarise(rows: list[dict]) -> dict:
    """Per placement and measure: median, min, max over the repeats."""
    out: dict = {}
    for place in PLACEMENTS:
        mine = [r for r in rows if r["placement"] == place]
        out[place] = {key: {"median": float(np.median(v)), "min": float(np.min(v)), "max": float(np.max(v))}
                      for key in ("ms_per_update", "rtt_us_0_to_1", "rtt_us_1_to_0")
                      for v in [[r[key] for r in mine]]}
    return out


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), layout="constrained")
    panels = (("time per dominated update (ms)", ["ms_per_update"], "linear"),
              ("round trip, one float64 (µs, log scale)", ["rtt_us_0_to_1", "rtt_us_1_to_0"], "log"))
    for ax, (ylabel, keys, scale) in zip(axes, panels, strict=True):
        for x, key in enumerate(keys):
            for k, place in enumerate(PLACEMENTS):
                values = [r[key] for r in rows if r["placement"] == place]
                xs = np.full(len(values), x + (k - 0.5) * 0.3)
                ax.scatter(xs, values, color=COLOURS[place], s=18, label=place, alpha=0.8)
                ax.hlines(np.median(values), xs[0] - 0.1, xs[0] + 0.1, color=COLOURS[place], lw=2)
        ticks = {"ms_per_update": "VFB² job", "rtt_us_0_to_1": "from rank 0", "rtt_us_1_to_0": "from rank 1"}
        ax.set_xticks(range(len(keys)), [ticks[k] for k in keys])
        ax.set_xlabel("one point a repeat; bar: median")
        ax.set_ylabel(ylabel)
        ax.set_yscale(scale)
        if scale == "linear":
            ax.set_ylim(bottom=0)
    figure_legend(fig)
    save(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments multihost",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="breast-cancer")
    parser.add_argument("--algorithm", default="sgd")
    parser.add_argument("-n", "--parties", type=int, default=4)
    parser.add_argument("-m", "--active", type=int, default=2)
    parser.add_argument("--epochs", type=float, default=4.0)
    parser.add_argument("--gamma", type=float, default=0.05)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pingpong", type=int, default=2000, help="round trips per ping-pong, each way")
    parser.add_argument("--subnet", default="10.215.0.0/24")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from multihost.csv")
    args = parser.parse_args(argv)
    if args.plot_only:
        import csv

        with (OUT / "multihost.csv").open() as fh:
            rows = [{k: (v if k in ("placement", "cpu") else float(v)) for k, v in r.items()}
                    for r in csv.DictReader(fh)]
        plot(rows, OUT / "multihost.png")
        return
    reason = netns.unavailable()
    if reason is not None:
        raise SystemExit(f"experiments multihost: {reason}")

    config = RunConfig(parties=args.parties, active=args.active, dataset=args.dataset,
                       algorithm=args.algorithm, gamma=args.gamma, epochs=args.epochs, progress=False)
    config = replace(config, f_star=reference_f_star(config))  # once, not in every job
    cpu, rows = cpu_model(), []
    with netns.emulated_hosts(args.parties, prefix="vflbench", subnet=args.subnet) as hosts:
        envs = {"one host": {}, "one namespace per party": hosts.mpiexec_env()}
        for repeat in range(args.repeats):
            for place in PLACEMENTS:
                load = os.getloadavg()[0]
                row = {"repeat": repeat, "placement": place,
                       **train_once(config, envs[place]),
                       **pingpong_once(args.parties, args.pingpong, envs[place]),
                       "load_1min": round(load, 2), "load_1min_after": round(os.getloadavg()[0], 2),
                       "cpu": cpu}
                say(f"repeat {repeat} {place}: {row['ms_per_update']:.3f} ms/update, RTT "
                    f"{row['rtt_us_0_to_1']:.0f}/{row['rtt_us_1_to_0']:.0f} µs (load {load:.1f})")
                rows.append(row)
    OUT.mkdir(parents=True, exist_ok=True)
    write_rows(OUT / "multihost.csv", rows)
    summary = summarise(rows)
    command = "python -m experiments multihost " + shlex.join(argv if argv is not None else sys.argv[2:])
    record = {"command": command.strip(), "cpu": cpu, "settings": vars(args), "summary": summary}
    (OUT / "multihost.json").write_text(json.dumps(record, indent=2) + "\n")
    plot(rows, OUT / "multihost.png")
    loads = [r["load_1min"] for r in rows]

    def cell(place: str, key: str, digits: int) -> str:
        s = summary[place][key]
        return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"

    table = markdown_table(
        ["placement", "ms per dominated update", "RTT 0→1→0 (µs)", "RTT 1→0→1 (µs)"],
        [[p, cell(p, "ms_per_update", 3), cell(p, "rtt_us_0_to_1", 0), cell(p, "rtt_us_1_to_0", 0)]
         for p in PLACEMENTS])
    medians = [summary[p]["ms_per_update"]["median"] for p in PLACEMENTS]
    ratio = medians[1] / medians[0]
    text = (f"VFB²-{args.algorithm} on {args.dataset}, q = {args.parties}, m = {args.active}, "
            f"{args.epochs:g} epochs a job; {args.repeats} repeats, placements alternating; "
            f"median (min–max). "
            f"Ping-pong: {args.pingpong} round trips of one float64 each way after 50 warm-up trips. "
            f"CPU: {cpu} (cores); 1-min load average {min(loads):.1f}–{max(loads):.1f} "
            f"during the runs. Command: `{command.strip()}`.\n\n{table}\n"
            f"Per-update time, namespaces / one host: **{ratio:.2f}×** (medians).\n")
    (OUT / "multihost.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
