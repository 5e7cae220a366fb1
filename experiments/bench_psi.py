"""``python -m experiments psi``: wall time and bytes of ``vfl align``'s PSI at 10k-1M ids per party.

Each configuration is one real ``mpiexec`` job of :mod:`parties.align` on synthetic ids (half of each
party's ids common to all, by default): the time is the slowest rank's, from its ids in memory to its
rows in the common order (hashing included, CSV files excluded), and the bytes are everything the
ranks' buffer sends carried. The machine is shared: each row records the load average and CPU model.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import tempfile
import time
from pathlib import Path

from experiments._machine import cpu_model
from parties.align import run_job

RESULTS = Path(__file__).resolve().parent / "results" / "psi"
FIELDS = ["parties", "ids_per_party", "repeat", "overlap", "intersection", "seconds", "megabytes_sent",
          "load_before", "load_after", "cpu"]


def run_one(q: int, n: int, overlap: float, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        load_before = os.getloadavg()[0]
        proc = run_job(q, ["--bench", str(n), "--overlap", str(overlap), "--seed", str(seed),
                           "--report", str(report)])
        load_after = os.getloadavg()[0]
        if proc.returncode != 0 or not report.exists():
            raise RuntimeError(f"PSI job q={q} n={n} failed:\n{proc.stdout}\n{proc.stderr}")
        info = json.loads(report.read_text())
    return {"parties": q, "ids_per_party": n, "overlap": overlap, "intersection": info["intersection"],
            "seconds": round(info["seconds"], 3), "megabytes_sent": round(sum(info["bytes_sent"]) / 1e6, 3),
            "load_before": round(load_before, 2), "load_after": round(load_after, 2), "cpu": cpu_model()}


def write_outputs(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| parties | ids per party | run | intersection | seconds | MB sent (all ranks) "
             "| load avg before/after |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['parties']} | {r['ids_per_party']:,} | {r['repeat'] + 1} | {r['intersection']:,} | "
              f"{r['seconds']:.1f} | {r['megabytes_sent']:.1f} | {r['load_before']:.2f} / "
              f"{r['load_after']:.2f} |" for r in rows]
    lines += ["", f"CPU: {rows[0]['cpu'] if rows else '?'}; written {time.strftime('%Y-%m-%d %H:%M')}."]
    (out / "table.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for q in sorted({r["parties"] for r in rows}):
        mine = [r for r in rows if r["parties"] == q]
        ax.plot([r["ids_per_party"] for r in mine], [r["seconds"] for r in mine], "o",
                label=f"q = {q} parties")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ids per party")
    ax.set_ylabel("wall time of the PSI (s)")
    ax.set_title("vfl align: X25519 DH-PSI, 50 % overlap")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "psi_time.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments psi", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1k and 3k ids, in seconds")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--parties", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--overlap", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration (the spread)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    sizes = [1_000, 3_000] if args.quick else args.sizes
    rows = []
    for q in args.parties:
        for n, repeat in ((n, r) for n in sizes for r in range(args.repeats)):
            row = {"repeat": repeat, **run_one(q, n, args.overlap, args.seed)}
            print(f"q={q} n={n:>9,}: {row['seconds']:8.2f} s  {row['megabytes_sent']:8.2f} MB  "
                  f"intersection {row['intersection']:,}  load {row['load_before']:.2f}", flush=True)
            rows.append(row)
            write_outputs(rows, args.out)  # after each row: a long run stopped early keeps what it measured
    print(f"results in {args.out}")


if __name__ == "__main__":
    main()
