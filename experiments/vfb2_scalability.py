"""VFB² paper Figure 2: q-parties speedup at fixed m, asynchronous VFB² vs synchronous VFB.

``python -m experiments vfb2_scalability [--quick] [--parties 2 4 8] [--dataset a9a]``

The paper (Fig. 2, D4, m = 2, nonconvex LR, precision 1e-3) plots speedup = (run time with 1 party) /
(run time with q parties) and reports near-linear speedup for the asynchronous algorithms. Here, for
each q, one async and one sync VFB²-SVRG job on the nonconvex problem, m = k = 2, the last rank a 40 %
straggler in both modes, run back to back.

Decisions and reductions, stated because they change what the curve means:

* D4 (webspam) is not here. The default is a9a (123 features); ``--dataset webspam-standin`` runs on
  ``vfl synth webspam``'s stand-in at D4's full 16.6M features (rows reduced, see
  docs/large-sparse-data.md). Problem
  (7) has no finite minimiser to speak of on data with n ≪ d that is (nearly) separable, so its NonF
  reference would run for L-BFGS's whole iteration budget: ``--no-reference`` skips it and the table
  gives each job's final loss instead of f − f*.
* The smallest job the runtime allows is q = 2 (``--allow-two-parties``: with two parties the
  aggregate reveals the other's partial product; acceptable for a benchmark, never for real data), so
  the base is q = 2 and speedup(q) = rate(q) / rate(2), ideal linear = q / 2.
* The run time to a fixed precision is replaced by the rate of dominated updates (updates/s over one
  epoch, or the time cap): every q runs the same algorithm with the same γ on the same samples, so
  epochs to a precision are the same up to staleness and the time to it scales as 1 / rate; the
  sub-optimality each job reached is reported next to it to show that.
* This machine has **2 cores**. q = 2 already gives each rank a core; every party beyond that shares
  them (and MPICH busy-polls while waiting), so speedup above 1 is impossible here for reasons of
  hardware, not of the algorithm. What the curve can show is how gracefully each mode degrades.

Outputs in ``experiments/results/vfb2_scalability/``: ``runs.csv``, ``scalability.csv``,
``scalability.md`` and ``fig2_speedup.png``.
"""

from __future__ import annotations

import csv
from pathlib import Path

from experiments._vfb2_runner import (
    GAMMAS,
    RESULTS,
    base_parser,
    command_line,
    job_config,
    markdown_table,
    nonf,
    nonf_cache,
    output_dir,
    run_job,
    say,
    write_rows,
)
from vertical.datasets import get_spec

NAME = "vfb2_scalability"
PROBLEM = "nonconvex-logistic"


#: mode -> (label, colour, marker): the same line on both panels (experiments/_plotting.py)
MODES = {"async": ("VFB²-SVRG (async)", "tab:blue", "o-"), "sync": ("VFB-SVRG (sync)", "tab:orange", "s--")}


def plot(rows: list[dict], path) -> None:
    """Speedup and update rate against q, one line per mode in one colour on both panels, one legend."""
    from experiments._plotting import figure_legend, pyplot, save

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 4.0), layout="constrained")
    qs = sorted({int(r["parties"]) for r in rows})
    for mode, (label, colour, style) in MODES.items():
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: int(r["parties"]))
        if not mine:
            continue
        x = [int(r["parties"]) for r in mine]
        axes[0].plot(x, [float(r["speedup"]) for r in mine], style, color=colour, label=label)
        axes[1].plot(x, [float(r["updates_per_s"]) for r in mine], style, color=colour, label=label)
    axes[0].plot(qs, [q / qs[0] for q in qs], ":", color="grey", label="linear (ideal)")
    axes[0].axvline(2, color="tab:red", lw=0.8, alpha=0.5)
    axes[0].text(2.05, 0.1, "2 cores", color="tab:red", fontsize=8)
    axes[0].set(xlabel="q parties", ylabel=f"speedup vs q = {qs[0]}", title="q-parties speedup (m = 2)",
                xticks=qs)
    axes[1].set(xlabel="q parties", ylabel="dominated updates / s", title="update rate", xticks=qs)
    figure_legend(fig)
    save(fig, path)


def replot(out: Path) -> Path:
    """Redraw ``fig2_speedup.png`` from the ``scalability.csv`` already in ``out`` (no training)."""
    with open(out / "scalability.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    plot(rows, out / "fig2_speedup.png")
    return out / "fig2_speedup.png"


def main(argv: list[str] | None = None) -> list[dict]:
    p = base_parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--parties", nargs="+", type=int, default=None,
                   help="q values (default 2 4 8; quick 2 4, async only)")
    p.add_argument("--dataset", default=None, help="default a9a (quick: breast-cancer)")
    p.add_argument("--time-limit", type=float, default=None, help="cap per job in seconds (default 45)")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the NonF solve (high-dimensional data): report final loss, not f - f*")
    p.add_argument("--replot", action="store_true",
                   help="only redraw the figure from scalability.csv in the output folder (no training)")
    args = p.parse_args(argv)
    if args.replot:
        say(f"redrew {replot(args.out if args.out is not None else RESULTS / NAME)}")
        return []
    out = output_dir(args, NAME)
    quick = args.quick
    dataset = get_spec(args.dataset or ("breast-cancer" if quick else "a9a")).name
    parties = sorted(args.parties or ([2, 4] if quick else [2, 4, 8]))
    time_limit = args.time_limit or (15.0 if quick else 45.0)
    epochs = 1.0
    f_star = None if args.no_reference else nonf(dataset, PROBLEM, 1e-4, 0, data_dir=args.data_dir,
                                                 cache=nonf_cache(args, out)).f_star
    progress = "loss" if f_star is None else "suboptimality"
    gamma = GAMMAS.get((dataset, "svrg"), 0.05)
    runs, rows = [], []
    modes = ["async"] if quick else ["async", "sync"]
    for q in parties:
        for mode in modes:
            config = job_config(dataset, PROBLEM, "svrg", gamma, f_star=f_star, parties=q, active=2,
                                mode=mode, seed=0, epochs=epochs, eval_every=0.5, time_limit=time_limit,
                                snapshot_every=0.5,  # one inner loop per evaluation, as the results ran
                                straggler=q - 1, slowdown=0.4, allow_two_parties=q == 2,
                                data_dir=args.data_dir)
            job = run_job(config, f"q{q}-{mode}")
            runs += job.rows()
            rows.append({"parties": q, "mode": mode, "updates": job.updates, "train_time": job.train_time,
                         "updates_per_s": job.updates_per_second, "final_gap": job.final[progress],
                         **job.extra})
            say(f"{job.tag}: {job.updates_per_second:,.0f} updates/s, {progress} {job.final[progress]:.2e}")
    for r in rows:
        base = next(b for b in rows if b["mode"] == r["mode"] and b["parties"] == parties[0])
        r["speedup"] = r["updates_per_s"] / base["updates_per_s"]
        sync = [b["updates_per_s"] for b in rows if b["mode"] == "sync" and b["parties"] == r["parties"]]
        r["async_over_sync"] = r["updates_per_s"] / sync[0] if sync else None
    write_rows(out / "runs.csv", runs)
    write_rows(out / "scalability.csv", rows)
    plot(rows, out / "fig2_speedup.png")
    caption = (f"VFB²-SVRG on {dataset} ({PROBLEM}, λ = 1e-4, γ = {gamma:g}), m = k = 2, B = 1, last rank a "
               f"40 % straggler in both modes, {epochs:g} epoch or {time_limit:g} s per job. Speedup = "
               f"update rate relative to q = {parties[0]} (ideal: q / {parties[0]}); this machine has 2 "
               f"cores, so every q > 2 oversubscribes it: the flat or falling curve is the hardware's limit, "
               f"not the algorithm's. Paper: D4, near-linear async speedup on 48 cores. "
               f"Command: `{command_line(NAME, argv)}`.\n\n")
    body = [[r["parties"], r["mode"], f"{r['updates_per_s']:,.0f}", f"{r['speedup']:.2f}x",
             "n/a" if r["async_over_sync"] is None else f"{r['async_over_sync']:.2f}x",
             f"{r['final_gap']:.2e}",
             f"{r['job_cpu_seconds'] / r['job_wall_seconds']:.2f}"] for r in rows]
    (out / "scalability.md").write_text(caption + markdown_table(
        ["q", "mode", "updates/s", f"speedup vs q={parties[0]}", "rate / sync rate",
         "f − f* at end" if f_star is not None else "loss at end",
         "CPU s / wall s"], body))
    return rows


if __name__ == "__main__":
    main()
