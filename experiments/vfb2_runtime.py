"""Benchmarks of the VFB² runtime (issue 4): async vs sync, the cost of federation, k threads, latency.

``python -m experiments vfb2_runtime [--quick] [--reps 2]``

All on a9a (``--quick``: breast-cancer) with q = 4 parties, λ = 1e-4, B = 1. Each repetition runs these
jobs back to back, so every ratio compares runs that saw the same state of this shared machine:

1. **async vs sync with a straggler** - VFB²-SVRG (``--mode async``) against synchronous VFB
   (``--mode sync``), m = k = 2, the same γ (0.1, the sweep's best), rank 3 (passive) as a 40 % straggler
   (``--straggler 3 --slowdown 0.4``) in *both*; each stops at sub-optimality 1e-3 (quick: 3e-2).
   Result: training time to the target and sync/async.
2. **cost of federation** - the same VFB²-SVRG without a straggler (async, m = k = 2) against the same
   update rules in one process (:func:`vertical.algorithms.serial.run_serial`, the same four feature blocks,
   no messages, no masks): time per epoch and time to 1e-3, federated/serial.
3. **k = 1 vs k = 2 worker threads** - VFB²-SGD, all four parties active (m = 4), ``--threads 1`` vs
   ``--threads 2``, half an epoch each: dominated updates per second.
4. **wall time per dominated update** at q = 4, all active, B = 1, SGD (the same two jobs):
   ``training time / dominated updates`` (the whole system's rate; the design target is ≤ 0.2 ms) and
   ``m × training time / updates`` (one dominator's latency, four running concurrently).

Every job also reports its CPU seconds (all ranks, from ``getrusage`` of the finished ``mpiexec``):
MPICH busy-polls in blocking receives, so with 4 ranks on 2 cores the CPU time is ≈ 2 × wall time even
when the parties mostly wait (see the results note). Outputs in ``experiments/results/vfb2_runtime/``:
``jobs.csv`` (one row per job and repetition), ``runs.csv`` (every evaluation), ``runtime.md``.
"""

from __future__ import annotations

import statistics
import time

from experiments._vfb2_runner import (
    GAMMAS,
    JobResult,
    base_parser,
    command_line,
    job_config,
    markdown_table,
    nonf,
    nonf_cache,
    output_dir,
    run_job,
    say,
    seconds,
    time_to_target,
    write_rows,
)
from vertical.algorithms.serial import run_serial
from vertical.datasets import load
from vertical.partition import random_blocks
from vertical.problems import get_problem

NAME = "vfb2_runtime"
PARTIES = 4


def serial_svrg(dataset: str, gamma: float, epochs: int, f_star: float, data_dir: str | None) -> list[dict]:
    """The same SVRG rules in one process; records shaped like the runtime's (time excludes evaluation)."""
    ds = load(dataset, seed=0, data_dir=data_dir)
    problem = get_problem("logistic", lam=1e-4)
    blocks = random_blocks(ds.n_features, PARTIES, seed=0)
    stamps = [time.perf_counter()]
    result = run_serial(problem, ds.X_train, ds.y_train, blocks, "svrg", gamma, epochs, seed=0,
                        on_epoch=lambda epoch, w: stamps.append(time.perf_counter()))
    # run_serial evaluates f after each epoch before calling on_epoch: that cost (one X·w) is included,
    # a few ms per epoch against the seconds of n single-sample updates.
    return [{"epoch": e, "time": stamps[e] - stamps[0], "updates": e * ds.n_train,
             "suboptimality": value - f_star} for e, value in enumerate(result.objective)]


def one_repetition(dataset: str, rep: int, *, gamma: float, f_star: float, target: float, epochs: float,
                   short: float, time_limit: float, data_dir: str | None) -> dict[str, JobResult]:
    def job(tag: str, **options) -> JobResult:
        base = dict(parties=PARTIES, seed=0, f_star=f_star, data_dir=data_dir, time_limit=time_limit)
        result = run_job(job_config(dataset, "logistic", **base, **options), f"{tag}-rep{rep}")
        say(f"{result.tag}: {result.updates} updates in {result.train_time:.2f} s "
            f"({result.updates_per_second:,.0f}/s), gap {result.final['suboptimality']:.2e}")
        return result

    # snapshot_every: the committed results ran with a quarter-epoch inner loop (one per evaluation)
    svrg = dict(algorithm="svrg", gamma=gamma, active=2, epochs=epochs, target_suboptimality=target,
                eval_every=0.25, snapshot_every=0.25)
    straggler = dict(straggler=PARTIES - 1, slowdown=0.4)
    sgd = dict(algorithm="sgd", gamma=gamma, active=PARTIES, epochs=short, eval_every=short)
    return {"async": job("svrg-async-straggler", mode="async", **svrg, **straggler),
            "sync": job("svrg-sync-straggler", mode="sync", **svrg, **straggler),
            "federated": job("svrg-async", mode="async", **svrg),
            "k1": job("sgd-k1", threads=1, **sgd),
            "k2": job("sgd-k2", threads=2, **sgd)}


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=None, help="repetitions of the job set (default 2; quick 1)")
    p.add_argument("--gamma", type=float, default=None, help="default: the sweep's best for SVRG (a9a: 0.1)")
    args = p.parse_args(argv)
    out = output_dir(args, NAME)
    quick = args.quick
    dataset = "breast-cancer" if quick else "a9a"
    reps = args.reps or (1 if quick else 2)
    gamma = args.gamma or GAMMAS.get((dataset, "svrg"), 0.1)
    target = 3e-2 if quick else 1e-3
    epochs, short, time_limit = (3.0, 0.5, 20.0) if quick else (5.0, 0.5, 120.0)
    f_star = nonf(dataset, "logistic", 1e-4, 0, data_dir=args.data_dir, cache=nonf_cache(args, out)).f_star
    jobs: list[dict] = []
    runs: list[dict] = []
    serial_runs: list[list[dict]] = []
    for rep in range(reps):
        results = one_repetition(dataset, rep, gamma=gamma, f_star=f_star, target=target, epochs=epochs,
                                 short=short, time_limit=time_limit, data_dir=args.data_dir)
        serial_runs.append(serial_svrg(dataset, gamma, int(epochs), f_star, args.data_dir))
        for role, r in results.items():
            runs += r.rows()
            jobs.append({"rep": rep, "role": role, "tag": r.tag, "mode": r.config.mode,
                         "algorithm": r.config.algorithm, "active": r.config.active,
                         "threads": r.config.worker_threads, "straggler": r.config.straggler,
                         "updates": r.updates, "train_time": r.train_time, "epochs": r.epochs,
                         "updates_per_s": r.updates_per_second, "time_to_target": r.time_to(target),
                         "final_gap": r.final["suboptimality"], **r.extra})
        serial = serial_runs[-1]
        jobs.append({"rep": rep, "role": "serial", "tag": f"serial-svrg-rep{rep}", "mode": "serial",
                     "algorithm": "svrg", "active": PARTIES, "threads": 1, "straggler": None,
                     "updates": serial[-1]["updates"], "train_time": serial[-1]["time"],
                     "epochs": serial[-1]["epoch"],
                     "updates_per_s": serial[-1]["updates"] / serial[-1]["time"],
                     "time_to_target": time_to_target(serial, target),
                     "final_gap": serial[-1]["suboptimality"]})
    write_rows(out / "jobs.csv", jobs)
    write_rows(out / "runs.csv", runs)
    summary = summarise(jobs, target, load(dataset, seed=0, data_dir=args.data_dir).n_train)
    (out / "runtime.md").write_text(report(summary, jobs, dataset, gamma, target, reps,
                                                 command_line(NAME, argv)))
    return summary


def _per_rep(jobs: list[dict], role: str, key: str) -> list:
    return [j[key] for j in sorted(jobs, key=lambda j: j["rep"]) if j["role"] == role]


def _ratio(num: list, den: list) -> list[float | None]:
    return [a / b if a is not None and b else None for a, b in zip(num, den, strict=True)]


def _median(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summarise(jobs: list[dict], target: float, n_train: int) -> dict:
    """Ratios per repetition (side by side), from the job table."""
    t = {role: _per_rep(jobs, role, "time_to_target") for role in ("async", "sync", "federated", "serial")}
    epoch_time = {role: [j["train_time"] / j["updates"] * n_train for j in jobs if j["role"] == role]
                  for role in ("federated", "serial")}
    rate = {role: _per_rep(jobs, role, "updates_per_s") for role in ("k1", "k2", "async", "sync")}
    per_update_ms = {role: [1e3 / r for r in rate[role]] for role in ("k1", "k2")}
    return {
        "target": target,
        "time_to_target": t,
        "sync_over_async": _ratio(t["sync"], t["async"]),
        "federated_over_serial_time_to_target": _ratio(t["federated"], t["serial"]),
        "federated_over_serial_epoch_time": _ratio(epoch_time["federated"], epoch_time["serial"]),
        "epoch_time": epoch_time,
        "updates_per_s": rate,
        "k2_over_k1": _ratio(rate["k2"], rate["k1"]),
        "ms_per_update": per_update_ms,
        "ms_per_update_per_dominator": {k: [PARTIES * v for v in vs] for k, vs in per_update_ms.items()},
        "cpu_per_wall": {role: [j["job_cpu_seconds"] / j["job_wall_seconds"] for j in jobs
                                if j["role"] == role] for role in ("async", "sync", "k1", "k2")},
    }


def _fmt(values: list, unit: str = "", digits: int = 2) -> str:
    shown = ", ".join("n/a" if v is None else f"{v:.{digits}f}" for v in values)
    med = _median(values)
    return f"{med:.{digits}f}{unit} (runs: {shown})" if med is not None else f"n/a (runs: {shown})"


def report(s: dict, jobs: list[dict], dataset: str, gamma: float, target: float, reps: int,
           command: str) -> str:
    t = s["time_to_target"]
    cap = {role: _per_rep(jobs, role, "train_time") for role in ("async", "sync")}
    rows = [
        [f"1. time to f − f* ≤ {target:g}, async VFB²-SVRG, 40 % straggler",
         ", ".join(seconds(v, c) for v, c in zip(t["async"], cap["async"], strict=True))],
        ["1. same, sync VFB-SVRG, same straggler, same γ",
         ", ".join(seconds(v, c) for v, c in zip(t["sync"], cap["sync"], strict=True))],
        ["1. **sync / async** (time to target)", _fmt(s["sync_over_async"], "x")],
        ["2. time per epoch, federated async SVRG (no straggler)", _fmt(s["epoch_time"]["federated"], " s")],
        ["2. time per epoch, same rules in one process (run_serial)", _fmt(s["epoch_time"]["serial"], " s")],
        ["2. **federated / serial**, time per epoch", _fmt(s["federated_over_serial_epoch_time"], "x", 1)],
        [f"2. **federated / serial**, time to {target:g}",
         _fmt(s["federated_over_serial_time_to_target"], "x", 1)],
        ["3. updates/s, SGD, m = 4, k = 1", _fmt(s["updates_per_s"]["k1"], "", 0)],
        ["3. updates/s, SGD, m = 4, k = 2", _fmt(s["updates_per_s"]["k2"], "", 0)],
        ["3. **k = 2 / k = 1**", _fmt(s["k2_over_k1"], "x")],
        ["4. **wall time per dominated update** (system rate), k = 1",
         _fmt(s["ms_per_update"]["k1"], " ms", 3)],
        ["4. **wall time per dominated update** (system rate), k = 2",
         _fmt(s["ms_per_update"]["k2"], " ms", 3)],
        ["4. one dominator's latency (4 concurrent), k = 2",
         _fmt(s["ms_per_update_per_dominator"]["k2"], " ms", 3)],
        ["CPU s per wall s (all ranks), async / sync / k1 / k2",
         " / ".join(_fmt(s["cpu_per_wall"][r], "", 2).split(" (")[0] for r in ("async", "sync", "k1", "k2"))],
    ]
    caption = (f"VFB² runtime on {dataset}, q = {PARTIES}, λ = 1e-4, B = 1, γ = {gamma:g}, seed 0; {reps} "
               f"repetition(s) of the whole job set, run back to back; medians with every run listed. Times "
               f"are training time (evaluation excluded). Command: `{command}`.\n\n")
    return caption + markdown_table(["measure", "value"], rows)


if __name__ == "__main__":
    main()
