"""Where a B = 1 dominated update's time goes: parties against cores, and the CPU of each thread.

The issue's goal is 0.2 ms per dominated update (a9a, q = 4, B = 1). The serial rules take 0.04 ms, so
the rest is the runtime. This script measures how that cost depends on the number of ranks sharing
this machine's cores, and which thread of a party burns the CPU:

* real ``vfl train`` jobs, every party active (m = q, one worker each), SGD, B = 1, for q = 2, 3, 4, on
  the Python runtime (``--engine python``: the default ``auto`` would take the compiled loop);
* for each q a short and a long job; a sampler reads every rank thread's CPU time from ``/proc``
  (the runtime names its threads ``p<rank>-main``, ``-comm``, ``-worker-k``, ``-heartbeat``), and the
  difference long − short, divided by the difference in dominated updates, is the CPU per update of
  each thread role, summed over the ranks, with start-up and data loading cancelled out;
* the same SGD rules serially in one process, per update.

    python -m experiments update_profile [--dataset a9a] [--parties 2 3 4] [--repeats 2]

Outputs in ``experiments/results/update_profile/``: ``results.json`` (every job, load, CPU model),
``table.md`` and ``profile.png``. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
from collections import defaultdict
from pathlib import Path

import numpy as np

from experiments._machine import cpu_model
from experiments._vfb2_runner import run_job
from experiments.bench_piggyback import serial_ms_per_update
from parties.config import RunConfig

OUT = Path(__file__).resolve().parent / "results" / "update_profile"
#: p<rank>-<role>[-<k>]: main, comm, worker-k, heartbeat, link-delay (parties/runtime.py)
THREAD_NAME = re.compile(r"p\d+-([a-z]+)(?:-[a-z0-9]+)?")
#: thread role -> colour, fixed in every figure
ROLES = {"main": "tab:blue", "comm": "tab:red", "worker": "tab:green", "heartbeat": "tab:gray",
         "link": "tab:purple"}
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _parent(pid: str) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return None


class ThreadSampler:
    """Polls ``/proc/*/task/*/stat`` for threads named ``p<rank>-<role>`` of this process's descendants
    (the ranks under our ``mpiexec``, not another job's) and keeps, per thread, the last CPU time seen
    (user + system): a rank's threads are read until its process is gone. A main thread's CPU counts
    from the first sample that sees its rank's comm thread, which starts after data loading and the
    kernels' compilation: that start-up varies from job to job more than a run's training costs."""

    def __init__(self, period: float = 0.05) -> None:
        self.period = period
        self.last: dict[tuple[str, str], tuple[str, float]] = {}
        self._ours: dict[str, bool] = {str(os.getpid()): True}
        self._main_start: dict[str, float] = {}  # pid -> its main thread's CPU when training began
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ThreadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period)

    def sample(self) -> None:
        seen: dict[str, dict[str, float]] = defaultdict(dict)  # pid -> role -> CPU, this sample
        for task in Path("/proc").glob("[0-9]*/task/[0-9]*/stat"):
            try:
                head, tail = task.read_text().rsplit(")", 1)
            except OSError:  # the thread ended between the listing and the read
                continue
            match = THREAD_NAME.fullmatch(head.split("(", 1)[1])
            if match and self._descends(task.parts[2]):
                fields = tail.split()
                cpu = (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
                self.last[(task.parts[2], task.parts[4])] = (match.group(1), cpu)
                seen[task.parts[2]][match.group(1)] = cpu
        for pid, roles in seen.items():
            if pid not in self._main_start and "comm" in roles and "main" in roles:
                self._main_start[pid] = roles["main"]

    def _descends(self, pid: str) -> bool:
        chain = []
        while pid not in self._ours:
            chain.append(pid)
            parent = _parent(pid)
            if parent is None or parent == "0" or parent == pid:
                self._ours.update(dict.fromkeys(chain, False))
                return False
            pid = parent
        verdict = self._ours[pid]
        self._ours.update(dict.fromkeys(chain, verdict))
        return verdict

    def by_role(self) -> dict[str, float]:
        roles: dict[str, float] = defaultdict(float)
        for (pid, _), (role, cpu) in self.last.items():
            roles[role] += cpu - (self._main_start.get(pid, 0.0) if role == "main" else 0.0)
        return dict(roles)


def one_job(q: int, epochs: float, rep: int, args: argparse.Namespace) -> dict:
    config = RunConfig(parties=q, active=q, threads=1, dataset=args.dataset, data_dir=args.data_dir,
                       algorithm="sgd", gamma=args.gamma, epochs=epochs, eval_every=epochs, seed=rep,
                       reference=False, allow_two_parties=q == 2, engine=args.engine)
    load_now = os.getloadavg()[0]
    with ThreadSampler() as sampler:
        result = run_job(config, f"q{q}-{epochs:g}-{rep}")
    return {"parties": q, "epochs": epochs, "repetition": rep, "updates": result.updates,
            "train_time": result.train_time, "cpu_by_role": sampler.by_role(), "load": load_now,
            "ms_per_update": 1e3 * result.train_time / result.updates}


def per_update(short: dict, long: dict) -> dict:
    """CPU ms per dominated update of each role, from the difference of a long and a short job."""
    updates = long["updates"] - short["updates"]
    roles = sorted(set(short["cpu_by_role"]) | set(long["cpu_by_role"]))
    cpu = {role: 1e3 * (long["cpu_by_role"].get(role, 0.0) - short["cpu_by_role"].get(role, 0.0)) / updates
           for role in roles}
    wall = 1e3 * (long["train_time"] - short["train_time"]) / updates
    return {"parties": long["parties"], "repetition": long["repetition"],
            "ms_per_update": long["ms_per_update"], "wall_ms_per_update_diff": wall, "cpu_ms_per_update": cpu,
            "cores_busy": sum(cpu.values()) / wall if wall > 0 else float("nan")}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments update_profile",
                                description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="a9a")
    p.add_argument("--parties", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--gamma", type=float, default=0.05)
    p.add_argument("--short", type=float, default=0.2, help="epochs of the short job")
    p.add_argument("--long", type=float, default=0.6, help="epochs of the long job")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--engine", default="python", choices=["python", "compiled"],
                   help="python (default): the reference runtime, whose threads split the work by role; the "
                        "compiled pump does it all in the comm thread, yielding the core while it waits, so "
                        "long − short reads its waiting as much as its work")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)

    load_before = os.getloadavg()
    jobs, profiles = [], []
    for rep in range(args.repeats):
        for q in (args.parties if rep % 2 == 0 else args.parties[::-1]):  # alternate the order
            short, long = one_job(q, args.short, rep, args), one_job(q, args.long, rep, args)
            jobs += [short, long]
            profiles.append(per_update(short, long))
            shown = ", ".join(f"{k} {v:.3f}" for k, v in profiles[-1]["cpu_ms_per_update"].items())
            print(f"[update_profile] rep {rep} q={q}: {long['ms_per_update']:.3f} ms per update; CPU ms per "
                  f"update: {shown}; cores busy {profiles[-1]['cores_busy']:.2f}", flush=True)
    serial = serial_ms_per_update(args.dataset, max(args.parties), args.gamma, 1.0, 1, args.data_dir)
    summary = {"command": "python -m experiments update_profile " + " ".join(argv or []),
               "load_before": load_before, "load_after": os.getloadavg(), "cpu": cpu_model(),
               "cores": len(os.sched_getaffinity(0)), "dataset": args.dataset, "jobs": jobs,
               "profiles": profiles, "serial_ms_per_update": serial}
    write(summary, args.out)
    return summary


def write(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    qs = sorted({r["parties"] for r in summary["profiles"]})
    roles = [r for r in ROLES if any(r in p["cpu_ms_per_update"] for p in summary["profiles"])]
    mean = lambda values: float(np.mean(values)) if values else 0.0  # noqa: E731
    lines = [f"`{summary['command'].strip()}` — {summary['dataset']}, every party active, one worker each, "
             f"SGD, B = 1; {summary['cpu']}, load {summary['load_before'][0]:.1f} → "
             f"{summary['load_after'][0]:.1f}", "",
             "| q (ranks on " + str(summary["cores"]) + " cores) | ms per dominated update (runs) | "
             + " | ".join(f"CPU ms/update, {r}" for r in roles) + " | cores busy |",
             "|---" * (3 + len(roles)) + "|"]
    for q in qs:
        mine = [r for r in summary["profiles"] if r["parties"] == q]
        runs = ", ".join(f"{r['ms_per_update']:.3f}" for r in mine)
        cells = " | ".join(f"{mean([r['cpu_ms_per_update'].get(role, 0.0) for r in mine]):.3f}"
                           for role in roles)
        lines.append(f"| {q} | {runs} | {cells} | {mean([r['cores_busy'] for r in mine]):.2f} |")
    lines += ["", f"Serial, one process, the same rules over {max(qs)} blocks: "
              f"{summary['serial_ms_per_update']:.4f} ms per update. CPU per role is summed over the ranks "
              "and taken from the difference of a long and a short job (start-up cancels)."]
    (out / "table.md").write_text("\n".join(lines) + "\n")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    bottom = np.zeros(len(qs))
    for role in roles:
        heights = np.array([mean([r["cpu_ms_per_update"].get(role, 0.0) for r in summary["profiles"]
                                  if r["parties"] == q]) for q in qs])
        ax.bar([str(q) for q in qs], heights, bottom=bottom, color=ROLES[role], label=f"CPU: {role} threads")
        bottom += heights
    walls = [mean([r["ms_per_update"] for r in summary["profiles"] if r["parties"] == q]) for q in qs]
    ax.plot([str(q) for q in qs], walls, "ko-", label="wall time per update")
    ax.axhline(summary["serial_ms_per_update"], color="black", ls=":", label="serial, one process")
    ax.set_ylim(0, 1.15 * max(*bottom, *walls))
    ax.set_xlabel(f"parties q (ranks on {summary['cores']} cores)")
    ax.set_ylabel("ms per dominated update")
    ax.set_title(f"Where a B = 1 update goes ({summary['dataset']}, all parties active)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "profile.png", dpi=120)
    plt.close(fig)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
