"""Joined parties (``vfl party``, one command per organisation) against one ``mpiexec``, side by side.

Two measurements on one machine, every party on loopback:

* **the join** of q parties started at once: the leader's own account (``joined q parties in T s``),
  split into the wait for the last hello (the other parties' start-up: imports, loading their data)
  and the MPI join proper (q − 1 rounds of ``Accept``/``Connect``/``Merge``, then ``Split``);
* **the time per dominated update** of the same a9a job, joined, and under one ``mpiexec -n q`` (its
  default shared-memory transport) and one ``mpiexec`` on the joined parties' transport (MPICH's OFI
  netmod over TCP), alternating within each repeat so that the machine's load hits all three.

Every row records the 1-min load average and the CPU model.

    python -m experiments join [--dataset a9a] [-n 4] [--epochs 0.5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments._machine import cpu_model
from experiments._plotting import colours, figure_legend, pyplot, save
from experiments._vfb2_runner import markdown_table, say, write_rows
from parties.launch import write_private_key
from parties.netns import TCP_TRANSPORT
from protocols.channels import generate_key_pair

OUT = Path(__file__).resolve().parent / "results" / "join"
REPO_ROOT = Path(__file__).resolve().parents[1]
PLACEMENTS = ("one mpiexec (shared memory)", "one mpiexec (OFI/tcp)", "joined (vfl party, OFI/tcp)")
COLOURS = colours(PLACEMENTS)
_JOINED = re.compile(r"joined (\d+) parties in ([\d.]+) s \(the last hello ([\d.]+) s after this party "
                     r"listened, then the MPI join ([\d.]+) s\)")


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(extra or {})}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def organisations(work: Path, split: Path, q: int, job: dict) -> list[list[str]]:
    """q organisations' folders (key, job file, run folder) and each one's ``vfl party`` command."""
    names = [f"org-{p}" for p in range(q)]
    keys = {}
    for name in names:
        private, keys[name] = generate_key_pair()
        write_private_key(work / name / "party.key", private)
    lines = ["[job]", *(f"{k} = {json.dumps(v)}" for k, v in job.items())]
    for p, name in enumerate(names):
        lines += ["", "[[party]]", f'name = "{name}"', f'role = "{"active" if p == 0 else "passive"}"',
                  *([f'address = "127.0.0.1:{_free_port()}"'] if p == 0 else []),
                  f'public_key = "{keys[name].hex()}"']
    text = "\n".join(lines) + "\n"
    commands = []
    for p, name in enumerate(names):
        (work / name / "job.toml").write_text(text)
        folder = work / name
        commands.append([sys.executable, "-m", "vfl.cli", "party", str(folder / "job.toml"), "--as", name,
                         "--key", str(folder / "party.key"), "--data", str(split / f"party-{p}"),
                         "--folder", str(folder / "run"), "--no-progress", "--overwrite"])
    return commands


def run_joined(commands: list[list[str]], leader_run: Path) -> dict:
    procs = [subprocess.Popen(c, cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for c in commands]
    outputs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("a joined party failed:\n" + "\n".join(o[-2000:] for o in outputs))
    found = _JOINED.search(outputs[0])
    assert found, outputs[0][-2000:]
    result = json.loads((leader_run / "result.json").read_text())
    return {"join_s": float(found.group(2)), "last_hello_s": float(found.group(3)),
            "mpi_join_s": float(found.group(4)), **_per_update(result)}


def run_one_mpiexec(split: Path, q: int, job: dict, env: dict[str, str], out: Path) -> dict:
    flags = []
    for key, value in job.items():
        flags += [f"--{key}", str(value)]
    cmd = [sys.executable, "-m", "vfl.cli", "train", "-n", str(q), "-m", "1", "--party-files", str(split),
           *flags, "--secure-channels", "--no-reference", "--no-progress", "--out", str(out), "--overwrite"]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=_env(env), capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"vfl train failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return _per_update(json.loads((out / "result.json").read_text()))


def _per_update(result: dict) -> dict:
    return {"updates": result["updates"], "train_seconds": result["train_time"],
            "ms_per_update": 1e3 * result["train_time"] / result["updates"],
            "test_accuracy": result["record"].get("test_accuracy")}


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.6), layout="constrained")
    for k, place in enumerate(PLACEMENTS):
        values = [r["ms_per_update"] for r in rows if r["placement"] == place]
        ax.scatter(np.full(len(values), k), values, color=COLOURS[place], s=22, label=place, alpha=0.85)
        ax.hlines(np.median(values), k - 0.15, k + 0.15, color=COLOURS[place], lw=2)
    ax.set_xticks(range(len(PLACEMENTS)), ["shm", "OFI/tcp", "joined"])
    ax.set_xlabel("placement (one point a repeat; bar: median)")
    ax.set_ylabel("time per dominated update (ms)")
    ax.set_ylim(bottom=0)
    figure_legend(fig)
    save(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments join", description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="a9a")
    parser.add_argument("-n", "--parties", type=int, default=4)
    parser.add_argument("--algorithm", default="sgd")
    parser.add_argument("--epochs", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from vfl.cli import main as vfl

    cpu, rows = cpu_model(), []
    job = {"algorithm": args.algorithm, "epochs": args.epochs, "seed": 0}
    with tempfile.TemporaryDirectory(prefix="bench-join-") as tmp:
        work = Path(tmp)
        split = work / "split"
        if vfl(["split", args.dataset, "-n", str(args.parties), "-m", "1", "--out", str(split)]) != 0:
            raise SystemExit("experiments join: vfl split failed")
        commands = organisations(work, split, args.parties, job)
        envs = {PLACEMENTS[0]: {}, PLACEMENTS[1]: dict(TCP_TRANSPORT)}
        for repeat in range(args.repeats):
            for place in PLACEMENTS:
                load = os.getloadavg()[0]
                started = time.monotonic()
                if place in envs:
                    row = run_one_mpiexec(split, args.parties, job, envs[place], work / "one")
                else:
                    row = run_joined(commands, work / "org-0" / "run")
                row = {"repeat": repeat, "placement": place, **row,
                       "wall_seconds": round(time.monotonic() - started, 2),
                       "load_1min": round(load, 2), "load_1min_after": round(os.getloadavg()[0], 2),
                       "cpu": cpu}
                say(f"repeat {repeat} {place}: {row['ms_per_update']:.3f} ms/update"
                    + (f", join {row['join_s']:.2f} s (MPI part {row['mpi_join_s']:.2f} s)" if "join_s" in row
                       else "") + f" (load {load:.1f})")
                rows.append(row)
    OUT.mkdir(parents=True, exist_ok=True)
    write_rows(OUT / "join.csv", rows)
    command = ("python -m experiments join " + shlex.join(argv if argv is not None else sys.argv[2:])).strip()
    summary = {place: {"ms_per_update_median": float(np.median([r["ms_per_update"] for r in rows
                                                                 if r["placement"] == place]))}
               for place in PLACEMENTS}
    joins = [r for r in rows if "join_s" in r]
    for key in ("join_s", "last_hello_s", "mpi_join_s"):
        summary["join"] = {**summary.get("join", {}), key: [r[key] for r in joins]}
    (OUT / "join.json").write_text(json.dumps({"command": command, "cpu": cpu, "settings": vars(args),
                                               "summary": summary}, indent=2) + "\n")
    plot(rows, OUT / "join.png")
    loads = [r["load_1min"] for r in rows]

    def cell(place: str) -> str:
        v = [r["ms_per_update"] for r in rows if r["placement"] == place]
        return f"{np.median(v):.3f} ({min(v):.3f}–{max(v):.3f})"

    base = summary[PLACEMENTS[0]]["ms_per_update_median"]
    table = markdown_table(["placement", "ms per dominated update", "× one mpiexec (shm)"],
                           [[p, cell(p), f"{summary[p]['ms_per_update_median'] / base:.2f}"]
                            for p in PLACEMENTS])
    join_table = markdown_table(
        ["repeat", "join, leader's account (s)", "waiting for the last hello (s)", "MPI join (s)", "load"],
        [[r["repeat"], f"{r['join_s']:.2f}", f"{r['last_hello_s']:.2f}", f"{r['mpi_join_s']:.2f}",
          f"{r['load_1min']:.1f}"] for r in joins])
    text = (f"VFB²-{args.algorithm} (async) on {args.dataset}, q = {args.parties}, m = 1, "
            f"{args.epochs:g} epochs a job, sealed channels in every placement ('joined' has them on by "
            f"default; the one-mpiexec jobs take `--secure-channels`); {args.repeats} repeats, placements "
            f"alternating; median (min–max). CPU: {cpu}; 1-min load average "
            f"{min(loads):.1f}–{max(loads):.1f} during the runs. "
            f"Command: `{command}`.\n\n{table}\nThe join of {args.parties} parties started at once, each "
            f"repeat (the leader's log line):\n\n{join_table}")
    (OUT / "join.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
