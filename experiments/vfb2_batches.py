"""Mini-batches × requests in flight × link delay: updates/s, time to f − f* ≤ target, federation cost.

For each batch size B, in-flight count P and one-way link delay (``--link-delay``), one real
``vfl train`` job (VFB²-SVRG, q = 4, m = 2) runs to the target or its time limit; beside it, the same
algorithm and B run serially in one process (``run_serial``) give the federation cost
(federated time to target / serial time to target).

Step size: a mini-batch step averages B gradients, so the single-sample γ is too small for large B
and B·γ diverges. For each B, γ is the best of ``γ₁·√B × {¼, ½, 1}`` (γ₁ the single-sample sweep's
value) by the serial run's sub-optimality after two epochs, and federated and serial runs use that
same γ: the comparison is between ways of running one algorithm, not between tunings.

    python -m experiments vfb2_batches [--datasets a9a d1] [--batches 1 8 64 512] [--inflight 1 4 16]
                                       [--delays 0 1 10] [--time-limit 90] [--quick]
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

from experiments._machine import cpu_model
from experiments._vfb2_runner import (
    base_parser,
    command_line,
    gamma_for,
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
from parties.outcomes import EXIT_CODES
from vertical.algorithms.serial import run_serial
from vertical.datasets import get_spec, load
from vertical.partition import random_blocks
from vertical.problems import get_problem

NAME = "vfb2_batches"
PARTIES, ACTIVE, LAM = 4, 2, 1e-4
#: one colour per link delay (ms), one line style per P: fixed across every figure
DELAY_COLOURS = {0.0: "tab:blue", 1.0: "tab:orange", 10.0: "tab:red", 100.0: "tab:purple"}
INFLIGHT_STYLES = {1: "-", 2: "--", 4: "--", 16: ":"}
#: γ halvings tried after a divergence (see run_cell)
RETRIES = 2


def serial_curve(ds, blocks, batch: int, gamma: float, epochs: int, f_star: float) -> list[dict]:
    """Serial SVRG with mini-batches: one record per epoch (time excludes nothing but start-up)."""
    problem = get_problem("logistic", lam=LAM)
    stamps = [time.perf_counter()]
    result = run_serial(problem, ds.X_train, ds.y_train, blocks, "svrg", gamma, epochs, seed=0,
                        batch_size=batch, on_epoch=lambda epoch, w: stamps.append(time.perf_counter()))
    return [{"epoch": e, "time": stamps[e] - stamps[0], "suboptimality": value - f_star}
            for e, value in enumerate(result.objective)]


def pick_gamma(ds, blocks, batch: int, base: float, f_star: float) -> float:
    """The best of base·√B × {¼, ½, 1} by the serial gap after two epochs (see the module docstring)."""
    best, best_gap = base, math.inf
    for factor in (0.25, 0.5, 1.0):
        gamma = base * math.sqrt(batch) * factor
        gap = serial_curve(ds, blocks, batch, gamma, 2, f_star)[-1]["suboptimality"]
        if math.isfinite(gap) and gap < best_gap:
            best, best_gap = gamma, gap
    return best


def run_cell(dataset: str, name: str, batch: int, p_inflight: int, delay: float, gamma: float,
             serial_time: float | None, *, f_star: float, target: float, epochs: float, time_limit: float,
             data_dir: str | None, parties: int = PARTIES, active: int = ACTIVE) -> dict:
    """One (B, P, delay) job. A run that diverges is retried at γ/2, at most ``RETRIES`` times: P
    requests in flight per dominator add staleness, which the serial run's γ does not allow for. The
    row records the γ that ran and how many halvings it took."""
    base = {"dataset": name, "batch": batch, "inflight": p_inflight, "delay_ms": delay,
            "serial_time_to_target": serial_time}
    for halvings in range(RETRIES + 1):
        step = gamma / 2 ** halvings
        config = job_config(dataset, "logistic", "svrg", step, f_star=f_star, parties=parties, active=active,
                            allow_two_parties=parties == 2, lam=LAM, batch_size=batch, inflight=p_inflight,
                            link_delay_ms=delay, epochs=epochs, eval_every=0.25, target_suboptimality=target,
                            time_limit=time_limit, data_dir=data_dir)
        load_now = os.getloadavg()[0]
        row = {**base, "gamma": step, "halvings": halvings, "load": load_now}
        try:
            result = run_job(config, f"{name}-B{batch}-P{p_inflight}-d{delay:g}-h{halvings}")
        except RuntimeError as error:  # diverged or failed: a result too, said as such
            say(f"{name} B={batch} P={p_inflight} delay={delay:g} γ={step:.3g}: {error}")
            if f"exit code {EXIT_CODES['diverged']}" in str(error):
                row["status"] = "diverged"
                continue
            return {**row, "status": "failed"}
        reached = result.time_to(target)
        row.update({
            "status": "reached" if reached is not None else "not reached",
            "updates_per_s": result.updates_per_second, "samples_per_s": result.updates_per_second * batch,
            "time_to_target": reached, "final_gap": result.final["suboptimality"],
            "train_time": result.train_time,
            "federation_cost": reached / serial_time if reached is not None and serial_time else None})
        say(f"{name} B={batch} P={p_inflight} delay={delay:g} ms γ={step:.3g}: "
            f"{row['updates_per_s']:,.0f} updates/s, to target {seconds(reached)}, "
            f"cost {row['federation_cost']}")
        return row
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    p = base_parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", default=None, help="default: a9a d1 (quick: breast-cancer)")
    p.add_argument("--batches", nargs="+", type=int, default=None, help="default: 1 8 64 512")
    p.add_argument("--inflight", nargs="+", type=int, default=None, help="default: 1 4 16")
    p.add_argument("--delays", nargs="+", type=float, default=None, help="one-way ms; default: 0 1 10")
    p.add_argument("--target", type=float, default=None, help="sub-optimality (default 1e-3)")
    p.add_argument("--time-limit", type=float, default=None, help="seconds of training per job (90)")
    p.add_argument("--epochs", type=float, default=None, help="epoch budget per job (default 20)")
    p.add_argument("--parties", type=int, default=PARTIES,
                   help=f"q (default {PARTIES}; 2 puts one rank on each core of a 2-core machine)")
    p.add_argument("--active", type=int, default=ACTIVE, help=f"m (default {ACTIVE})")
    args = p.parse_args(argv)
    out = output_dir(args, NAME)
    quick = args.quick
    datasets = args.datasets or (["breast-cancer"] if quick else ["a9a", "d1"])
    batches = args.batches or ([1, 8] if quick else [1, 8, 64, 512])
    inflight = args.inflight or ([1, 4] if quick else [1, 4, 16])
    delays = args.delays if args.delays is not None else ([0.0] if quick else [0.0, 1.0, 10.0])
    target = args.target or (3e-2 if quick else 1e-3)
    time_limit = args.time_limit or (20.0 if quick else 90.0)
    epochs = args.epochs or (3.0 if quick else 20.0)
    meta = {"command": command_line(NAME, argv), "cpu": cpu_model(), "load_before": os.getloadavg(),
            "target": target, "time_limit": time_limit, "parties": args.parties, "active": args.active}
    rows: list[dict] = []
    for dataset in datasets:
        name = get_spec(dataset).name
        ds = load(dataset, seed=0, data_dir=args.data_dir)
        f_star = nonf(dataset, "logistic", LAM, 0, data_dir=args.data_dir, cache=nonf_cache(args, out)).f_star
        blocks = random_blocks(ds.n_features, args.parties, seed=0)
        base = gamma_for(name, "svrg", default=0.05)
        for batch in batches:
            gamma = pick_gamma(ds, blocks, batch, base, f_star)
            serial = serial_curve(ds, blocks, batch, gamma, max(2, int(epochs)), f_star)
            serial_time = time_to_target(serial, target)
            say(f"{name} B={batch}: γ={gamma:.3g}, serial time to {target:g}: {seconds(serial_time)}")
            for p_inflight in inflight:
                for delay in delays:
                    rows.append(run_cell(dataset, name, batch, p_inflight, delay, gamma, serial_time,
                                         f_star=f_star, target=target, epochs=epochs, time_limit=time_limit,
                                         data_dir=args.data_dir, parties=args.parties, active=args.active))
    meta["load_after"] = os.getloadavg()
    write(rows, meta, out)
    return rows


def best_cells(rows: list[dict], meta: dict) -> str:
    """The summary experiments/results/README.md shows: per data set, B and delay, the fastest P to the
    target (its time, and the federation cost at no delay), and the issue's two ratios."""
    lines = []
    for dataset in sorted({r["dataset"] for r in rows}):
        delays = sorted({r["delay_ms"] for r in rows if r["dataset"] == dataset})
        lines += [f"**{dataset}**: time to {meta['target']:g} with the best P (P, federation cost)", "",
                  "| B | serial | " + " | ".join(f"delay {d:g} ms" for d in delays) + " |",
                  "|---|---|" + "---|" * len(delays)]
        for batch in sorted({r["batch"] for r in rows if r["dataset"] == dataset}):
            mine = [r for r in rows if r["dataset"] == dataset and r["batch"] == batch]
            cells = []
            for delay in delays:
                reached = [r for r in mine if r["delay_ms"] == delay and r.get("time_to_target") is not None]
                if not reached:
                    cells.append(f"> {meta['time_limit']:g} s")
                    continue
                best = min(reached, key=lambda r: r["time_to_target"])
                cells.append(f"{best['time_to_target']:.2f} s (P = {best['inflight']}, "
                             f"{best['time_to_target'] / best['serial_time_to_target']:.1f}×)")
            serial = mine[0].get("serial_time_to_target")
            lines.append(f"| {batch} | {'—' if serial is None else f'{serial:.2f} s'} | " + " | ".join(cells)
                         + " |")
        lines.append("")
    return "\n".join(lines)


def write(rows: list[dict], meta: dict, out) -> None:
    import json

    from experiments._plotting import pyplot, save

    plt = pyplot()

    write_rows(out / "results.csv", rows)
    (out / "results.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    fmt = lambda v, d=2: "—" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.{d}f}"  # noqa: E731
    table = markdown_table(
        ["data", "B", "P", "delay (ms)", "γ", "updates/s", "samples/s", f"time to {meta['target']:g}",
         "serial time", "federation cost"],
        [[r["dataset"], r["batch"], r["inflight"], f"{r['delay_ms']:g}", f"{r['gamma']:.3g}",
          fmt(r.get("updates_per_s"), 0), fmt(r.get("samples_per_s"), 0),
          (seconds(r.get("time_to_target"), meta["time_limit"])
           if r["status"] in ("reached", "not reached") else r["status"]),
          seconds(r.get("serial_time_to_target")), fmt(r.get("federation_cost"))] for r in rows])
    header = (f"`{meta['command']}` — VFB²-SVRG, q = {meta.get('parties', PARTIES)}, "
              f"m = {meta.get('active', ACTIVE)}, λ = {LAM:g}; {meta['cpu']}, "
              f"load {meta['load_before'][0]:.1f} → {meta['load_after'][0]:.1f} (per job: results.csv)\n\n")
    (out / "table.md").write_text(header + table + "\n\n" + best_cells(rows, meta))
    datasets = sorted({r["dataset"] for r in rows})
    fig, axes = plt.subplots(1, len(datasets), figsize=(max(8.0, 5.5 * len(datasets)), 5), squeeze=False)
    for ax, dataset in zip(axes[0], datasets, strict=True):
        mine = [r for r in rows if r["dataset"] == dataset and r.get("time_to_target") is not None]
        for delay in sorted({r["delay_ms"] for r in mine}):
            for p_inflight in sorted({r["inflight"] for r in mine}):
                line = sorted((r["batch"], r["time_to_target"]) for r in mine
                              if r["delay_ms"] == delay and r["inflight"] == p_inflight)
                if line:
                    ax.plot(*zip(*line, strict=True), marker="o", color=DELAY_COLOURS.get(delay, "grey"),
                            ls=INFLIGHT_STYLES.get(p_inflight, "-."),
                            label=f"delay {delay:g} ms, P = {p_inflight}")
        serial = sorted({(r["batch"], r["serial_time_to_target"]) for r in rows
                         if r["dataset"] == dataset and r.get("serial_time_to_target")})
        if serial:
            ax.plot(*zip(*serial, strict=True), marker="s", color="black", label="serial (one process)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size B")
        ax.set_ylabel(f"training time to f − f* ≤ {meta['target']:g} (s)")
        ax.set_title(dataset)
    handles: dict = {}
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    if handles:
        fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    save(fig, out / "time_to_target.png", dpi=120)
    print(header + table)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
