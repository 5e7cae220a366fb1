"""What label-DP's per-row cap on label attacks costs a central learner: issue 28's goal in context.

The goal: a passive party's label attack at AUC ≤ 0.60 for ≤ 1 point of accuracy. A measured attack
reads less than the most that label-DP allows, so this asks what the cap costs when it must hold row
by row for the optimal attack (one that knows everything but the row's label), with no VFL, no network and no
asynchrony in the way: one L2 logistic regression on all columns, trained centrally on labels that went
through the mechanism. It is a reference, not a bound: a better-tuned learner may pay less.

- **gaussian**: each row's target y ∈ {0, 1} plus one draw n ~ N(0, s²), the gradient σ(z) − y − n. It is
  ``dp-theta``'s identity top seen by the optimal attacker: labels one apart in noise s is μ-GDP with
  μ = 1/s, and P fresh passes of noise multiplier σ are μ = √P/σ. The optimal test's AUC is Φ(μ/√2), so
  the cap a sets s = 1 / (√2 Φ⁻¹(a)).
- **rr**: randomized response, each label flipped with probability 1/(1 + e^ε), ε = 2 artanh(2a − 1)
  (pure ε-label-DP, whose best test has exactly AUC a), trained with the flip's forward correction.

The learner never sees a clean training label: λ is picked on a held-out fifth of the training rows by
the noisy targets' loss (linear in the target, so unbiased for the clean one), then refit on all of them.
Beside these, the runtime networks of ``vnn_runtime --part privacy`` at the cap their ε guarantees.

    python -m experiments label_dp_limit [--seeds 5] [--caps 0.55 0.6 0.65 0.7]

Outputs: ``experiments/results/label_dp_limit/{limit.json, limit.md, limit.png}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path

import numpy as np

from experiments._machine import cpu_model
from experiments._plotting import check_labelled, colours, pyplot

OUT = Path(__file__).resolve().parent / "results" / "label_dp_limit"
DATASETS = ("a9a", "credit-card")
LAMBDAS = (1e-4, 1e-3, 1e-2, 3e-2, 1e-1)
GOAL_AUC, GOAL_POINTS = 0.60, -1.0
#: The runtime networks' setting beside which the central learner is shown (``vnn_privacy_summary``'s
#: SETTINGS; bottoms ``*-16-1``, top 1, q = 4, async, 5 epochs)
RUNTIME_SETTING = "B 1024, γ 2e-2, decay 1"


def gaussian_scale(cap: float) -> float:
    """The noise s on a 0/1 target whose optimal attack reads AUC ``cap``: Φ(1/(s√2)) = cap."""
    from scipy.stats import norm

    return 1.0 / (math.sqrt(2.0) * float(norm.ppf(cap)))


def rr_epsilon(cap: float) -> float:
    """The ε of randomized response whose optimal attack reads AUC ``cap``: ½ + ½ tanh(ε/2) = cap."""
    return 2.0 * math.atanh(2.0 * cap - 1.0)


def runtime_cap(epsilon: float, passes: int, delta: float = 1e-5) -> float:
    """The AUC that ``dp-theta``'s fresh noise at (ε, δ) over ``passes`` guarantees, row by row, against
    any attack on an identity top's one-logit ϑ: Φ(√P / (σ√2)), σ the runtime's own noise multiplier
    (σ grows as √P at a fixed ε, so the cap hardly depends on P: a run charged 6 releases has it too).
    Row by row: across rows, an attack also reads what the features predict (model completion does)."""
    from scipy.stats import norm

    from vertical.label_privacy import gaussian_noise_multiplier

    sigma = gaussian_noise_multiplier(epsilon, delta, passes)
    return float(norm.cdf(math.sqrt(passes) / (sigma * math.sqrt(2))))


def _dense(X) -> np.ndarray:
    return np.asarray(X.todense()) if hasattr(X, "todense") else np.asarray(X, dtype=np.float64)


def load(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Training and test rows (tabular columns standardised on the training rows), labels in {0, 1}."""
    from vertical.datasets.registry import load as load_dataset

    data = load_dataset(name, seed=0, data_dir=os.environ.get("VFL_DATA_DIR", "/work/shared/data"))
    X, Xt = _dense(data.X_train), _dense(data.X_test)
    if name != "a9a":
        mean, std = X.mean(axis=0), X.std(axis=0) + 1e-12
        X, Xt = (X - mean) / std, (Xt - mean) / std
    return X, (data.y_train > 0).astype(float), Xt, (data.y_test > 0).astype(float)


def fit(X: np.ndarray, target: np.ndarray, lam: float, flip: float = 0.0):
    """L2 logistic regression by L-BFGS on ``target`` (0/1 or noisy reals); ``flip`` > 0: the forward
    correction of labels flipped with that probability. Returns the weights and bias."""
    import torch

    Xt, t = torch.as_tensor(X), torch.as_tensor(target)
    w = torch.zeros(X.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=400, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = noisy_loss(Xt @ w + b, t, flip) + lam * (w @ w)
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach().numpy(), float(b.detach())


def noisy_loss(z, t, flip: float):
    """The loss on the mechanism's targets: logistic (its gradient σ(z) − t, linear in t) or, for flipped
    labels, the likelihood of the flip applied to the model's probability."""
    import torch

    if flip == 0.0:
        return (torch.nn.functional.softplus(z) - t * z).mean()
    q = torch.sigmoid(z) * (1 - 2 * flip) + flip
    return -(t * torch.log(q) + (1 - t) * torch.log(1 - q)).mean()


def trained_accuracy(X, target, Xt, yt, flip: float, rng) -> float:
    """λ by the held-out noisy loss, refit on every training row, test accuracy against clean labels."""
    import torch

    held = rng.permutation(target.size)[: target.size // 5]
    keep = np.setdiff1d(np.arange(target.size), held)
    scores = []
    for lam in LAMBDAS:
        w, b = fit(X[keep], target[keep], lam, flip)
        z = torch.as_tensor(X[held] @ w + b)
        scores.append(float(noisy_loss(z, torch.as_tensor(target[held]), flip)))
    w, b = fit(X, target, LAMBDAS[int(np.argmin(scores))], flip)
    return float(np.mean(((Xt @ w + b) > 0) == (yt > 0)))


def measure(name: str, caps: list[float], seeds: int) -> list[dict]:
    X, y, Xt, yt = load(name)
    rows = []
    for seed in range(seeds):
        clean = trained_accuracy(X, y, Xt, yt, 0.0, np.random.default_rng(seed))
        for cap in caps:
            rng = np.random.default_rng([seed, int(cap * 1000)])
            noisy = y + rng.normal(0.0, gaussian_scale(cap), y.size)
            flip = 1.0 / (1.0 + math.exp(rr_epsilon(cap)))
            flipped = np.where(rng.random(y.size) < flip, 1.0 - y, y)
            for mechanism, target, correction in (("gaussian", noisy, 0.0), ("rr", flipped, flip)):
                accuracy = trained_accuracy(X, target, Xt, yt, correction, np.random.default_rng(seed))
                rows.append({"dataset": name, "seed": seed, "cap": cap, "mechanism": mechanism,
                             "points": 100 * (accuracy - clean), "clean": clean, "accuracy": accuracy,
                             "load": os.getloadavg()[0]})
        print(f"{name} seed {seed}: clean {100 * clean:.2f} %", flush=True)
    return rows


def runtime_points() -> list[dict]:
    """Every protected run of the runtime networks in the final setting (:data:`RUNTIME_SETTING`, 5
    epochs, fresh noise, exact sensitivity): its accuracy cost and the cap its ε guarantees."""
    from experiments.vnn_privacy_summary import read

    return [{"dataset": r["dataset"], "epsilon": r["epsilon"], "points": r["points"],
             "cap": runtime_cap(r["epsilon"], passes=5), "projection": r["projection"]}
            for r in read() if r["noise"] == "σ (exact)" and r["setting"] == RUNTIME_SETTING]


def table(rows: list[dict], runtime: list[dict]) -> str:
    lines = ["| dataset | mechanism | AUC cap (optimal attack, per row) | seeds | "
             "Δ accuracy, mean (min–max) |",
             "|---|---|---|---|---|"]
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["mechanism"], r["cap"]), []).append(r["points"])
    for r in runtime:
        groups.setdefault((r["dataset"], f"runtime network, ε = {r['epsilon']:g}", round(r["cap"], 3)),
                          []).append(r["points"])
    for (dataset, mechanism, cap), points in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2])):
        mean = statistics.mean(points)
        lines.append(f"| {dataset} | {mechanism} | {cap:.3f} | {len(points)} | {mean:+.2f} "
                     f"({min(points):+.2f} to {max(points):+.2f}) |")
    return "\n".join(lines)


def plot(rows: list[dict], runtime: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(DATASETS), figsize=(6 * len(DATASETS), 4.3), squeeze=False)
    labels = {"gaussian": "Gaussian target noise (dp-theta's)", "rr": "randomized response, corrected",
              "runtime": "runtime networks, dp-theta (each run)"}
    colour = colours(list(labels))
    for ax, dataset in zip(axes[0], DATASETS, strict=True):
        for mechanism in ("gaussian", "rr"):
            caps = sorted({r["cap"] for r in rows if r["dataset"] == dataset and r["mechanism"] == mechanism})
            points = [[r["points"] for r in rows if r["dataset"] == dataset and r["mechanism"] == mechanism
                       and r["cap"] == cap] for cap in caps]
            means = [statistics.mean(p) for p in points]
            spread = [[m - min(p) for m, p in zip(means, points, strict=True)],
                      [max(p) - m for m, p in zip(means, points, strict=True)]]
            ax.errorbar(caps, means, yerr=spread, color=colour[mechanism], marker="o", capsize=3,
                        label=labels[mechanism])
        mine = [r for r in runtime if r["dataset"] == dataset]
        ax.scatter([r["cap"] for r in mine], [r["points"] for r in mine], s=14, color=colour["runtime"],
                   label=labels["runtime"])
        ax.axvline(GOAL_AUC, color="black", lw=0.8, ls="--")
        ax.axhline(GOAL_POINTS, color="black", lw=0.8, ls="--")
        ax.set_title(f"{dataset}: the price of label-DP's per-row cap")
        ax.set_xlabel("AUC the best attack can reach (label-DP's guarantee)")
        ax.set_ylabel("test accuracy − without protection (points)")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    check_labelled(fig)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--caps", type=float, nargs="+", default=[0.55, 0.6, 0.65, 0.7])
    args = parser.parse_args(argv)
    if args.seeds < 1 or not all(0.5 < c < 1 for c in args.caps):
        parser.error("--seeds must be ≥ 1 and every --caps value in (0.5, 1)")
    OUT.mkdir(parents=True, exist_ok=True)
    rows = [r for name in DATASETS for r in measure(name, args.caps, args.seeds)]
    runtime = runtime_points()
    record = {"cpu": cpu_model(), "runs": rows, "runtime": runtime}
    (OUT / "limit.json").write_text(json.dumps(record, indent=1))
    text = table(rows, runtime)
    loads = [r["load"] for r in rows]
    (OUT / "limit.md").write_text(
        "The accuracy an L2 logistic regression on all columns (λ picked without a clean label) loses when "
        "the optimal attack on a row's label is capped at an AUC, beside the runtime networks (bottoms "
        "`*-16-1`, top 1, "
        f"{RUNTIME_SETTING}, 5 epochs) at the cap their ε guarantees. Command: `python -m "
        f"experiments label_dp_limit --seeds {args.seeds}`; {cpu_model()}, load {min(loads):.1f}–"
        f"{max(loads):.1f}.\n\n" + text + "\n")
    plot(rows, runtime, OUT / "limit.png")
    print(text)


if __name__ == "__main__":
    main()
