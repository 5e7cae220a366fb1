"""Label-DP noise for HE-SGD compared in one process: what ``he --epsilon`` computes, without the
encryption (HE-SGD takes the same steps as plain mini-batch SGD to 1e-6) and without async staleness.

Mechanisms, each at the same (ε, δ = 1e-5) over the run's passes:

* ``gradient``: the first version, N(0, (σC)²) on every coordinate of each batch gradient, C the root
  of the blocks' largest squared row norms summed (a random 4-block column split);
* ``theta``: today's, ϑ̃ = ϑ + N(0, σ²) for every row of every batch;
* ``rr``: randomized response on the labels once (ε-label-DP, δ = 0, whatever the number of passes),
  with ϑ = σ(z) − ŷ for the debiased 0/1 label ŷ = (ỹ − ρ)/(1 − 2ρ): a candidate, not implemented.

    python -m experiments label_dp_sim [--dataset a9a] [--epsilons 1 4] [--seeds 8] [--epochs 2]

Writes ``results/label_dp_sim/results.json`` and ``table.md`` (with the CPU model and load).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import numpy as np
import scipy.sparse as sp

OUT = Path(__file__).resolve().parent / "results" / "label_dp_sim"
MECHANISMS = ("gradient", "theta", "rr")


def run(X, y, Xt, yt, mechanism: str, epsilon: float, seed: int, *, batch: int, epochs: float,
        gamma: float, lam: float, C: float) -> tuple[float, float]:
    """Test accuracy after ``epochs`` of mini-batch SGD on the pass batches, and σ."""
    from parties.label_plane import PassBatches
    from vertical.label_privacy import flip_probability, gaussian_noise_multiplier, randomized_response

    n, d = X.shape
    steps = math.ceil(epochs * n / batch)
    sigma = gaussian_noise_multiplier(epsilon, 1e-5, math.ceil(steps / (n // batch)))
    rng = np.random.default_rng([seed, 7])
    if mechanism == "rr":
        rho = flip_probability(epsilon)
        soft = ((randomized_response(y, epsilon, rng) + 1) / 2 - rho) / (1 - 2 * rho)
    w = np.zeros(d)
    for rows in PassBatches(n, batch, 1, 0, seed).take(steps):
        Xb = X[rows]
        z = Xb @ w
        if mechanism == "rr":
            theta = 1 / (1 + np.exp(-z)) - soft[rows]
        else:
            theta = -y[rows] / (1 + np.exp(y[rows] * z))
        if mechanism == "theta":
            theta = theta + rng.normal(0.0, sigma, batch)
        g = Xb.T @ theta
        if mechanism == "gradient":
            g = g + rng.normal(0.0, sigma * C, d)
        w -= gamma * lam * w
        w -= gamma / batch * g
    return float(np.mean(np.sign(Xt @ w) == yt)), sigma


def main(argv: list[str] | None = None) -> None:
    from experiments._machine import cpu_model
    from vertical.datasets import load
    from vertical.partition import random_blocks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="a9a")
    p.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 4.0])
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--gamma", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    ds = load(args.dataset, seed=0)
    X, Xt = sp.csr_matrix(ds.X_train), sp.csr_matrix(ds.X_test)
    blocks = random_blocks(X.shape[1], 4, 0)
    C = math.sqrt(sum(float(X[:, b].multiply(X[:, b]).sum(axis=1).max()) for b in blocks))
    load_before = os.getloadavg()
    rows = []
    for epsilon in args.epsilons:
        for mechanism in MECHANISMS:
            found = [run(X, ds.y_train, Xt, ds.y_test, mechanism, epsilon, s, batch=args.batch,
                         epochs=args.epochs, gamma=args.gamma, lam=1e-4, C=C) for s in range(args.seeds)]
            acc = [a for a, _ in found]
            rows.append({"epsilon": epsilon, "mechanism": mechanism, "sigma": found[0][1], "accuracies": acc,
                         "mean": float(np.mean(acc)), "sd": float(np.std(acc))})
            print(f"[label_dp_sim] ε={epsilon:g} {mechanism}: {100 * np.mean(acc):.2f} ± "
                  f"{100 * np.std(acc):.2f} %", flush=True)
    meta = {"cpu": cpu_model(), "load_before": load_before, "load_after": os.getloadavg(), "C": C,
            "command": "python -m experiments label_dp_sim " + " ".join(argv or []), **vars(args)}
    meta["out"] = str(meta["out"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    lines = ["| ε | mechanism | test accuracy, mean ± sd over seeds | σ |", "|---|---|---|---|"]
    lines += [f"| {r['epsilon']:g} | {r['mechanism']} | {100 * r['mean']:.2f} ± {100 * r['sd']:.2f} % | "
              f"{'-' if r['mechanism'] == 'rr' else format(r['sigma'], '.3g')} |" for r in rows]
    lines.append(f"\n{args.dataset}, B = {args.batch}, γ = {args.gamma}, {args.epochs:g} epochs, "
                 f"{args.seeds} seeds; {meta['cpu']}, load {load_before[0]:.1f}; `{meta['command']}`")
    (args.out / "table.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
