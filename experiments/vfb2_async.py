"""VFB² paper Figures 3-4: asynchronous VFB² against synchronous VFB with a straggler party.

``python -m experiments vfb2_async [--quick] [--datasets d1 a9a w8a] [--problems logistic ...]``

For every dataset present, problem and optimiser (SGD, SVRG, SAGA) it runs two real ``mpiexec`` jobs
back to back with the *same* γ, seed, feature split and straggler: VFB² (``--mode async``) and its
synchronous counterpart VFB (``--sync-mode``: ``sync-global``, the default, where every dominator takes
each step together and each step waits for every party, as the synchronous baseline is described; or
``sync``, the per-dominator variant the first results used, where only each dominator waits for the
acknowledgements of its own steps). Both stop at the sub-optimality target or at the epoch /
time cap, whichever comes first, and are evaluated every ``eval_every`` epochs (evaluation time is not
training time). Outputs in ``experiments/results/vfb2_async/``:

* ``runs.csv`` - every evaluation of every job (tag, settings, epoch, time, updates, loss, gap, accuracy);
* ``async_vs_sync.md`` - time to 1e-2 and 1e-3 sub-optimality, async vs sync, and their ratio;
* ``fig3_logistic.png`` / ``fig4_nonconvex-logistic.png`` - sub-optimality vs training time and vs
  epochs, one row per dataset (a colour per optimiser and mode; solid: async VFB², dashed: sync VFB);
  ``--replot`` redraws them from ``runs.csv``.

Settings and reductions (the paper: q = 8, m = 3, k = m, a 30-50 % straggler in the sync runs only):
q = 4 parties, m = 2 active (ranks 0, 1), k = m = 2 workers, B = 1, λ = 1e-4, γ per dataset and
optimiser from the serial sweep (``vfb2_lr_sweep``), one seed. The straggler is the last rank (a
passive party), ``--slowdown 0.4``, injected in **both** modes, for a fair comparison.
On 2 cores, 4 ranks share the CPUs: timings are ratios measured side by side, not absolute speeds.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments._plotting import figure_legend, pyplot, save
from experiments._vfb2_runner import (
    RESULTS,
    JobResult,
    base_parser,
    command_line,
    gamma_for,
    job_config,
    markdown_table,
    nonf,
    nonf_cache,
    output_dir,
    present_datasets,
    run_job,
    say,
    seconds,
    write_rows,
)
from vertical.datasets import get_spec

NAME = "vfb2_async"
TARGETS = (1e-2, 1e-3)
FIGURE = {"logistic": "fig3", "nonconvex-logistic": "fig4"}


def compare(dataset: str, problem: str, algorithm: str, *, parties: int, active: int, seed: int,
            gamma: float, epochs: float, time_limit: float, target: float, eval_every: float,
            slowdown: float, data_dir: str | None, cache: Path,
            sync_mode: str = "sync-global") -> list[JobResult]:
    """The async and the sync job of one (dataset, problem, algorithm), run back to back."""
    f_star = nonf(dataset, problem, 1e-4, seed, data_dir=data_dir, cache=cache).f_star
    jobs = []
    for mode in ("async", sync_mode):
        config = job_config(dataset, problem, algorithm, gamma, mode=mode, parties=parties, active=active,
                            seed=seed, f_star=f_star, epochs=epochs, time_limit=time_limit,
                            target_suboptimality=target, eval_every=eval_every, straggler=parties - 1,
                            slowdown=slowdown, data_dir=data_dir,
                            # the committed Figs 3-4 ran SVRG with one evaluation period per inner loop
                            snapshot_every=eval_every)
        jobs.append(run_job(config, f"{dataset}-{problem}-{algorithm}-{mode}"))
        say(f"{jobs[-1].tag}: {jobs[-1].epochs:g} epochs in {jobs[-1].train_time:.1f} s, "
            f"gap {jobs[-1].final['suboptimality']:.2e}")
    return jobs


def summary_rows(pairs: list[list[JobResult]]) -> list[dict]:
    rows = []
    for async_job, sync_job in pairs:
        c = async_job.config
        row = {"dataset": c.dataset, "problem": c.problem, "algorithm": c.algorithm, "gamma": c.gamma,
               "async_updates_per_s": async_job.updates_per_second,
               "sync_updates_per_s": sync_job.updates_per_second,
               "async_final_gap": async_job.final["suboptimality"],
               "sync_final_gap": sync_job.final["suboptimality"],
               "async_time": async_job.train_time, "sync_time": sync_job.train_time}
        for target in TARGETS:
            ta, ts = async_job.time_to(target), sync_job.time_to(target)
            row[f"async_t{target:g}"], row[f"sync_t{target:g}"] = ta, ts
            row[f"ratio_t{target:g}"] = ts / ta if ta and ts else None
        rows.append(row)
    return rows


def _ratio(row: dict, target: float) -> str:
    ta, ts = row[f"async_t{target:g}"], row[f"sync_t{target:g}"]
    if ta is None:
        return "async not reached"
    if ts is None:
        return f"≥ {row['sync_time'] / ta:.2f}x (sync not reached)"
    return f"{ts / ta:.2f}x"


def table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        cells = [get_spec(r["dataset"]).name, r["problem"], r["algorithm"].upper(), f"{r['gamma']:g}"]
        for target in TARGETS:
            cells += [seconds(r[f"async_t{target:g}"], r["async_time"]),
                      seconds(r[f"sync_t{target:g}"], r["sync_time"]), _ratio(r, target)]
        cells += [f"{r['async_updates_per_s']:,.0f}", f"{r['sync_updates_per_s']:,.0f}"]
        body.append(cells)
    header = ["dataset", "problem", "optimiser", "γ"]
    for target in TARGETS:
        header += [f"async t({target:g})", f"sync t({target:g})", f"sync/async t({target:g})"]
    header += ["async upd/s", "sync upd/s"]
    return markdown_table(header, body)


#: (optimiser, mode) -> colour: a hue family per optimiser, dark for async VFB², light for sync VFB, so
#: every line is told apart by colour alone (line style repeats it: solid async, dashed sync)
MODE_COLOURS = {("sgd", "async"): "tab:blue", ("sgd", "sync"): "tab:cyan",
                ("svrg", "async"): "tab:red", ("svrg", "sync"): "tab:orange",
                ("saga", "async"): "tab:green", ("saga", "sync"): "tab:olive"}


@dataclass(frozen=True)
class Curve:
    """One job's evaluations, as the figure needs them (from a live :class:`JobResult` or ``runs.csv``)."""

    dataset: str
    problem: str
    algorithm: str
    mode: str
    records: list[dict]


def plot(pairs: list[list[JobResult]], problem: str, path) -> None:
    curves = [Curve(j.config.dataset, j.config.problem, j.config.algorithm, j.config.mode, j.records)
              for pair in pairs for j in pair]
    save(figure(curves, problem), path)


def _family(mode: str) -> str:
    """The colour family of a mode: async, or one of the synchronous baselines."""
    return "async" if mode == "async" else "sync"


def figure(curves: list[Curve], problem: str):
    """Sub-optimality against training time and epochs, one row per dataset, one legend for all."""
    plt = pyplot()
    mine = [c for c in curves if c.problem == problem]
    datasets = list(dict.fromkeys(c.dataset for c in mine))
    fig, axes = plt.subplots(len(datasets), 2, figsize=(10, 3.3 * len(datasets) + 0.6), squeeze=False,
                             layout="constrained")
    for row, dataset in zip(axes, datasets, strict=True):
        for algorithm, mode in MODE_COLOURS:   # fixed order: the legend lists optimisers together
            for c in (c for c in mine
                      if (c.dataset, c.algorithm, _family(c.mode)) == (dataset, algorithm, mode)):
                gap = np.clip([float(r["suboptimality"]) for r in c.records], 1e-8, None)
                name = "VFB² (async)" if mode == "async" else f"VFB ({c.mode})"
                style = dict(color=MODE_COLOURS[(algorithm, mode)], ls="-" if mode == "async" else "--",
                             marker="o" if mode == "async" else "s", ms=3,
                             label=f"{name}-{algorithm.upper()}")
                row[0].semilogy([float(r["time"]) for r in c.records], gap, **style)
                row[1].semilogy([float(r["epoch"]) for r in c.records], gap, **style)
        name = get_spec(dataset).name
        row[0].set(title=f"{name}, {problem}: vs training time", xlabel="training time (s)",
                   ylabel="sub-optimality f(w) − f*")
        row[1].set(title=f"{name}, {problem}: vs epochs", xlabel="epochs",
                   ylabel="sub-optimality f(w) − f*")
        for ax in row:
            ax.axhline(1e-3, color="grey", lw=0.6, ls=":", label="target 1e-3")
            ax.grid(alpha=0.3)
    figure_legend(fig, ncol=len({(c.algorithm, c.mode) for c in mine}) + 1)   # one row: pairs side by side
    return fig


def replot(out: Path) -> list[Path]:
    """Redraw the figures from a finished run's ``runs.csv`` (no jobs): every evaluation is there."""
    with open(out / "runs.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    by_tag: dict[str, list[dict]] = {}
    for r in rows:
        by_tag.setdefault(r["tag"], []).append(r)
    curves = [Curve(rs[0]["dataset"], rs[0]["problem"], rs[0]["algorithm"], rs[0]["mode"], rs)
              for rs in by_tag.values()]
    written = []
    for problem in dict.fromkeys(c.problem for c in curves):
        path = out / f"{FIGURE.get(problem, 'fig')}_{problem}.png"
        save(figure(curves, problem), path)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> list[dict]:
    p = base_parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", default=None, help="default: d1 a9a w8a (present ones)")
    p.add_argument("--problems", nargs="+", default=None, help="default: logistic nonconvex-logistic")
    p.add_argument("--algorithms", nargs="+", default=["sgd", "svrg", "saga"])
    p.add_argument("--parties", type=int, default=4)
    p.add_argument("--active", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slowdown", type=float, default=0.4, help="straggler's extra time (paper: 0.3-0.5)")
    p.add_argument("--target", type=float, default=1e-3, help="stop criterion (sub-optimality)")
    p.add_argument("--sync-mode", default="sync-global", choices=["sync-global", "sync"],
                   help="the synchronous baseline: all dominators in lockstep, or per dominator")
    p.add_argument("--time-limit", type=float, default=None, help="cap per job, seconds (default 90)")
    p.add_argument("--replot", action="store_true",
                   help="only redraw the figures from runs.csv already in the output folder (no jobs)")
    args = p.parse_args(argv)
    if args.replot:
        out = args.out if args.out is not None else RESULTS / NAME
        say(f"redrew {', '.join(str(p) for p in replot(out))}")
        return []
    out = output_dir(args, NAME)
    quick = args.quick
    datasets = args.datasets or (["breast-cancer"] if quick else ["d1", "a9a", "w8a"])
    problems = args.problems or (["logistic"] if quick else ["logistic", "nonconvex-logistic"])
    algorithms = ["svrg"] if quick and args.algorithms == ["sgd", "svrg", "saga"] else args.algorithms
    time_limit = args.time_limit or (20.0 if quick else 90.0)
    pairs: list[list[JobResult]] = []
    skipped = []
    present = present_datasets(datasets, args.data_dir)
    for dataset in datasets:
        if get_spec(dataset).name not in present:
            skipped.append(get_spec(dataset).name)
            say(f"{dataset}: data file absent, skipped")
            continue
        for problem in problems:
            for algorithm in algorithms:
                epochs = 1.5 if algorithm == "sgd" else 4.0
                pairs.append(compare(dataset, problem, algorithm, parties=args.parties, active=args.active,
                                     seed=args.seed,
                                     gamma=gamma_for(get_spec(dataset).name, algorithm, problem),
                                     epochs=2.0 if quick else epochs, time_limit=time_limit,
                                     target=3e-2 if quick else args.target, eval_every=0.5 if quick else 0.25,
                                     slowdown=args.slowdown, data_dir=args.data_dir,
                                     cache=nonf_cache(args, out), sync_mode=args.sync_mode))
    write_rows(out / "runs.csv", [row for pair in pairs for job in pair for row in job.rows()])
    rows = summary_rows(pairs)
    write_rows(out / "summary.csv", rows)
    for problem in problems:
        if any(p[0].config.problem == problem for p in pairs):
            plot(pairs, problem, out / f"{FIGURE.get(problem, 'fig')}_{problem}.png")
    caption = (f"Async VFB² vs sync VFB (--mode {args.sync_mode}), same γ, straggler = rank "
               f"{args.parties - 1} (passive) with "
               f"--slowdown {args.slowdown} in both modes; q = {args.parties}, m = k = {args.active}, B = 1, "
               f"λ = 1e-4, seed {args.seed}; each job stops at sub-optimality "
               f"{3e-2 if quick else args.target:g} or its cap ({time_limit:g} s of training; 1.5 epochs for "
               f"SGD, 4 for SVRG/SAGA). Times are training time (evaluation excluded), interpolated between "
               f"evaluations; '> x s' = not reached within the x s the job ran. Paper: q = 8, m = 3, "
               f"48 cores, 10 trials.\nCommand: `{command_line(NAME, argv)}`.\n\n")
    if skipped:
        caption += f"Absent here (no data file): {', '.join(skipped)}.\n\n"
    (out / "async_vs_sync.md").write_text(caption + table(rows))
    return rows


if __name__ == "__main__":
    main()

