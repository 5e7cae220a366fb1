"""The protected networks' accuracy cost against the direction attack's AUC, over every
``vnn_runtime --part privacy`` table of fresh noise in ``experiments/results/vnn_runtime/``.

Each ``privacy-<dataset>[-<tag>].json`` holds runs of one setting (batch, step, decay: its tag says
which), each seed an unprotected run and protected ones at the same options. This reads them all and
writes one table (per setting and ε: mean and range of the accuracy difference, the AUC range) and
one plot (every protected run: its accuracy difference against its AUC, one colour per setting, the
issue's goal as a box), so the trade-off is seen at once rather than read from a dozen tables.

    python -m experiments vnn_privacy_summary

Outputs: ``experiments/results/vnn_runtime/privacy-summary.{md,png}``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from experiments._plotting import check_labelled, colours, pyplot

OUT = Path(__file__).resolve().parent / "results" / "vnn_runtime"
#: What each table's tag stands for (the options beside q = 4, async, -P 4, top 1; bottoms `*-16-1` and 5
#: epochs unless it says otherwise).
SETTINGS = {
    "": "B 256, γ 1e-2",
    "decay1": "B 256, γ 1e-2, decay 1",
    "B1024": "B 1024, γ 1e-2",
    "exact-decay1": "B 256, γ 1e-2, decay 1",
    "exact-B1024": "B 1024, γ 1e-2",
    "exact-B1024-decay1": "B 1024, γ 2e-2, decay 1",
    "final": "B 1024, γ 2e-2, decay 1",
    "decay3": "B 1024, γ 2e-2, decay 3",
    "projection": "B 1024, γ 2e-2, decay 1",
    "projection-3epochs": "B 1024, γ 2e-2, decay 1, 3 epochs",
    "projection-linear-bottoms": "B 1024, γ 2e-2, decay 1, linear bottoms `*-1`",
    "cap60": "B 1024, γ 2e-2, decay 1",
    "lam1e-2": "B 1024, γ 2e-2, decay 1, --lam 1e-2",
    "lam1e-3": "B 1024, γ 2e-2, decay 1, --lam 1e-3",
}
#: Tables run before the identity top's exact sensitivity (noise 2σ where it is now σ for one logit).
CLIPPED_BOUND = {"", "decay1", "B1024"}
GOAL_AUC, GOAL_POINTS = 0.60, -1.0


def read(folder: Path = OUT) -> list[dict]:
    """One row per protected run: dataset, setting, calibration, ε, accuracy difference, AUC."""
    runs = []
    for path in sorted(folder.glob("privacy-*.json")):
        if path.stem.endswith(("per-row", "summary")):
            continue
        rows = json.loads(path.read_text())
        dataset = rows[0]["dataset"]
        tag = path.stem[len(f"privacy-{dataset}"):].lstrip("-")
        if tag not in SETTINGS:
            continue
        plain = {r["seed"]: r["final_accuracy"] for r in rows if r["mode"] == "plain"}
        for r in rows:
            if r["mode"] == "plain" or r["seed"] not in plain:
                continue
            runs.append({"dataset": dataset, "tag": tag, "setting": SETTINGS[tag],
                         "noise": "2σ (clipped bound)" if tag in CLIPPED_BOUND else "σ (exact)",
                         "epsilon": r["epsilon"], "points": 100 * (r["final_accuracy"] - plain[r["seed"]]),
                         "plain": 100 * plain[r["seed"]],
                         "auc": r["direction_auc"], "projection": r.get("projection_auc"),
                         "load": r["load"]})
    return runs


def table(runs: list[dict]) -> str:
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["dataset"], r["tag"], r["epsilon"]), []).append(r)
    lines = ["| dataset | table (tag) | setting | noise | ε | runs | unprotected accuracy, mean | "
             "Δ accuracy, mean (min–max) | direction AUC | projection AUC | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (dataset, tag, epsilon), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        points = [r["points"] for r in rs]
        aucs = [r["auc"] for r in rs]
        loads = [r["load"] for r in rs]
        spread = f"{statistics.mean(points):+.2f} ({min(points):+.2f} to {max(points):+.2f})"
        projections = [r["projection"] for r in rs if r["projection"] is not None]
        projected = f"{min(projections):.3f}–{max(projections):.3f}" if projections else "not run"
        plain = statistics.mean(r["plain"] for r in rs)
        lines.append(f"| {dataset} | {tag or '(none)'} | {rs[0]['setting']} | {rs[0]['noise']} | "
                     f"{epsilon:g} | {len(rs)} | {plain:.2f} % | {spread} | "
                     f"{min(aucs):.3f}–{max(aucs):.3f} | {projected} | "
                     f"{min(loads):.1f}–{max(loads):.1f} |")
    return "\n".join(lines)


def pooled(runs: list[dict]) -> str:
    """The runs of one setting and ε pooled across tables (the same command on other days), with the
    three yardsticks of the goal side by side: the issue's direction attack, the strongest attack run
    (projection), and the AUC that label-DP's ε guarantees per row against any attack (5 passes, exact
    sensitivity: :func:`experiments.label_dp_limit.runtime_cap`)."""
    from experiments.label_dp_limit import runtime_cap

    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if r["noise"] == "σ (exact)" and "epochs" not in r["setting"]:
            groups.setdefault((r["dataset"], r["setting"], r["epsilon"]), []).append(r)
    lines = ["| dataset | setting | ε | runs (tables) | Δ accuracy, mean (min–max) | direction AUC | "
             "projection AUC (runs) | label-DP: per row AUC ≤ |", "|---|---|---|---|---|---|---|---|"]
    for (dataset, setting, epsilon), rs in sorted(groups.items()):
        points = [r["points"] for r in rs]
        projections = [r["projection"] for r in rs if r["projection"] is not None]
        projected = (f"{min(projections):.3f}–{max(projections):.3f} ({len(projections)})" if projections
                     else "not run")
        lines.append(f"| {dataset} | {setting} | {epsilon:g} | {len(rs)} ({len({r['tag'] for r in rs})}) | "
                     f"{statistics.mean(points):+.2f} ({min(points):+.2f} to {max(points):+.2f}) | "
                     f"{min(r['auc'] for r in rs):.3f}–{max(r['auc'] for r in rs):.3f} | {projected} | "
                     f"{runtime_cap(epsilon, passes=5):.3f} |")
    return "\n".join(lines)


def strongest(run: dict) -> float:
    """The run's highest attack AUC: the projection attack's where it was run (it averages a row's
    passes, and reads more than the direction attack's cosines under fresh noise)."""
    return max(run["auc"], run["projection"] or 0.0)


def plot(runs: list[dict], path: Path) -> None:
    plt = pyplot()
    datasets = sorted({r["dataset"] for r in runs})
    fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4.5), squeeze=False)
    keys = sorted({(r["setting"], r["noise"]) for r in runs})
    colour = colours(keys)
    for ax, dataset in zip(axes[0], datasets, strict=True):
        for key in keys:
            rs = [r for r in runs if r["dataset"] == dataset and (r["setting"], r["noise"]) == key]
            for measured in (True, False):
                some = [r for r in rs if (r["projection"] is not None) == measured]
                if some:  # the projection attack where it was run (filled), else the direction attack
                    ax.scatter([strongest(r) for r in some], [r["points"] for r in some], s=22,
                               color=colour[key], facecolors=colour[key] if measured else "none",
                               label=f"{key[0]}, noise {key[1]}")
        ax.axvline(GOAL_AUC, color="black", lw=0.8, ls="--")
        ax.axhline(GOAL_POINTS, color="black", lw=0.8, ls="--")
        ax.set_title(f"{dataset}: each protected run against its unprotected twin")
        ax.set_xlabel("strongest attack's AUC on a passive party (hollow: direction attack only)")
        ax.set_ylabel("test accuracy − unprotected (points)")
    handles, labels = {}, []
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in handles:
                handles[label] = h
                labels.append(label)
    fig.legend([handles[label] for label in labels], labels, loc="lower center", ncol=2, fontsize=8)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    check_labelled(fig)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    runs = read()
    text = table(runs)
    together = pooled(runs)
    (OUT / "privacy-summary.md").write_text(
        "Every protected run of `vnn_runtime --part privacy` (fresh noise), grouped by table and ε. "
        f"Goal: AUC ≤ {GOAL_AUC} at ≥ {GOAL_POINTS:+g} point. Command: `python -m experiments "
        "vnn_privacy_summary`.\n\n" + text + "\n\n"
        "## Pooled by setting and ε (5 epochs, exact sensitivity)\n\n"
        "The same setting's runs from every table, and the AUC that ε guarantees per row against any attack "
        "(label-DP's bound over 5 passes, an attacker who knows everything but the label).\n\n"
        + together + "\n")
    plot(runs, OUT / "privacy-summary.png")
    print(text + "\n\n" + together)


if __name__ == "__main__":
    main()
