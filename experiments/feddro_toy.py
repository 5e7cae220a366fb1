"""FedDRO vs vanilla FedAvg for CO on closed-form problems (paper Theorem 4.1 / Figure 6).

P1 is the paper's own counterexample (K = 2, g₁ = 4x − 4, g₂ = −2x + 4, f = √(y² + 4), x* = 0, I = 2,
x̄⁰ = 0.5): the paper plots Case II's x̄^t staying above 0.5 for several η (values not given, Figure 6 is an
image). P2 (not in the paper) is a 2-D generalisation with four clients and heterogeneous Jacobians.
Both are deterministic, so the numbers are exact and compared with reference values from an independent
float64 NumPy implementation of the recursions.

    python -m experiments feddro_toy [--quick] [--out experiments/results/feddro]

Outputs: ``toy_p1.png`` (x̄ at every model round), ``toy_results.json``, ``toy_table.md``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from horizontal.dro_objectives import AffineInnerProblem, p1_problem, p2_problem
from horizontal.feddro import CompositionalSimulation, FedDRO

P1_ETAS = (0.01, 0.05, 0.1)
# reference values from an independent float64 NumPy implementation of the recursions (η = 0.05 for P2)
P1_REFERENCE = {("I", 0.01): 1.17373, ("I", 0.05): 1.19816, ("I", 0.1): 1.24229,
                ("II", 0.01): 1.07045, ("II", 0.05): 1.13361, ("II", 0.1): 1.21828}
P2_REFERENCE = {("I", 0.05, 1): (1.01702, -0.41874), ("I", 0.05, 2): (1.02078, -0.39411),
                ("I", 0.05, 5): (1.03452, -0.31126), ("II", 0.05, 1): (0.0, -1.0),
                ("II", 0.05, 2): (0.83068, -0.80271), ("II", 0.05, 5): (0.97531, -0.52599)}


def methods(period: int) -> dict[str, FedDRO]:
    return {"FedAvg-CO Case I": FedDRO.fedavg_co("I", period),
            "FedAvg-CO Case II": FedDRO.fedavg_co("II", period),
            "FedDRO (β=0.3)": FedDRO(period, 0.3)}


def run(problem: AffineInnerProblem, alg: FedDRO, eta: float, x0: torch.Tensor,
        iterations: int) -> list[list[float]]:
    """x̄ after every model round; FedDRO starts from the exact ȳ⁰ = g(x̄⁰) (Case I/II need none)."""
    y0 = problem.A_mean @ x0 + problem.c.mean(0) if alg.beta < 1 else None
    sim = CompositionalSimulation(alg, problem, eta, x0=x0, y_init=y0)
    return [sim.model().tolist() for _ in range(iterations) if sim.step()["synced"]]


#: method -> colour, the same on every panel (experiments/_plotting.py); the line style repeats the method
COLOURS = {"FedAvg-CO Case I": "tab:orange", "FedAvg-CO Case II": "tab:red", "FedDRO (β=0.3)": "tab:blue"}
STYLES = {"FedAvg-CO Case I": ":", "FedAvg-CO Case II": "--", "FedDRO (β=0.3)": "-"}


def p1_paths(etas: Sequence[float]) -> dict[tuple[str, float], list[list[float]]]:
    """x̄ after every model round of P1, per (method, η): deterministic, seconds to compute."""
    x0 = torch.tensor([0.5], dtype=torch.float64)
    return {(name, eta): run(p1_problem(), alg, eta, x0, int(200 / eta))
            for eta in etas for name, alg in methods(2).items()}


def plot_p1(paths: dict[tuple[str, float], list[list[float]]], out: Path) -> None:
    """One panel per step size η, one colour per method on every panel, one legend."""
    from experiments._plotting import figure_legend, save

    etas = sorted({eta for _, eta in paths})
    fig, axes = plt.subplots(1, len(etas), figsize=(4.2 * len(etas), 3.8), sharey=True, squeeze=False,
                             layout="constrained")
    for ax, eta in zip(axes[0], etas, strict=True):
        for name in COLOURS:
            path = paths.get((name, eta))
            if path is not None:
                ax.plot(range(1, len(path) + 1), [p[0] for p in path], STYLES[name], color=COLOURS[name],
                        label=name)
        ax.axhline(0.5, color="grey", lw=0.8, label="x̄ = 0.5")
        ax.set(xscale="log", xlabel="model round (I = 2)", ylabel="x̄ after the round  (x* = 0)",
               title=f"η = {eta}")
    fig.suptitle("P1 (paper eq. 10): FedAvg-CO stays ≥ 0.5, FedDRO reaches x* = 0", fontsize=10)
    figure_legend(fig)
    save(fig, out, dpi=120)


def replot(out: Path) -> Path:
    """Redraw toy_p1.png. The x̄ paths are not stored (only the finals, in toy_results.json): they are
    recomputed, and each must end where the committed run ended before anything is drawn."""
    stored = json.loads((out / "toy_results.json").read_text())["p1"]
    etas = sorted({float(key.split("|")[1]) for key in stored})
    paths = p1_paths(etas)
    for (name, eta), path in paths.items():
        expected = stored[f"{name}|{eta}"]["final"]
        if max(abs(a - b) for a, b in zip(path[-1], expected, strict=True)) > 1e-9:
            raise ValueError(f"{name}, η={eta}: recomputed x̄ ends at {path[-1]}, toy_results.json says "
                             f"{expected}")
    plot_p1(paths, out / "toy_p1.png")
    return out / "toy_p1.png"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="P1 at one step size, P2 at I = 2 only")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/feddro"))
    parser.add_argument("--replot", action="store_true",
                        help="only redraw toy_p1.png (recomputing the P1 paths, checked against "
                             "toy_results.json)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.replot:
        print(f"redrew {replot(args.out)}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)

    p1, p2 = p1_problem(), p2_problem()
    etas = (0.1,) if args.quick else P1_ETAS
    paths: dict[tuple[str, float], list[list[float]]] = {}
    rows = ["| problem | method | η | I | final x̄ | spec reference | ‖x̄ − x*‖ | ‖∇Φ(x̄)‖ |",
            "|---|---|---|---|---|---|---|---|"]
    results: dict[str, object] = {"p1": {}, "p2": {}}
    x0 = torch.tensor([0.5], dtype=torch.float64)
    for eta in etas:
        for name, alg in methods(2).items():
            path = run(p1, alg, eta, x0, int(200 / eta))
            paths[(name, eta)] = path
            final = torch.tensor(path[-1], dtype=torch.float64)
            case = name.split()[-1]
            ref = P1_REFERENCE.get((case, eta), 0.0)
            results["p1"][f"{name}|{eta}"] = {"final": final.tolist(), "reference": ref,
                                              "min_over_rounds": min(p[0] for p in path)}
            rows.append(f"| P1 | {name} | {eta} | 2 | {final[0]:.5f} | {ref:.5f} "
                        f"| {abs(float(final[0])):.2e} | {float(p1.grad_phi(final).norm()):.2e} |")
    x0 = torch.tensor([2.0, 2.0], dtype=torch.float64)
    x_star = p2.x_star()
    for period in (2,) if args.quick else (1, 2, 5):
        for name, alg in methods(period).items():
            final = torch.tensor(run(p2, alg, 0.05, x0, 6000 // period * period)[-1], dtype=torch.float64)
            case = name.split()[-1]
            ref = P2_REFERENCE.get((case, 0.05, period), (0.0, -1.0))
            distance = float((final - x_star).norm())
            results["p2"][f"{name}|{period}"] = {"final": final.tolist(), "reference": ref,
                                                 "distance_to_x_star": distance}
            rows.append(f"| P2 | {name} | 0.05 | {period} | ({final[0]:.5f}, {final[1]:.5f}) | "
                        f"({ref[0]:.5f}, {ref[1]:.5f}) | {distance:.2e} | "
                        f"{float(p2.grad_phi(final).norm()):.2e} |")

    plot_p1(paths, args.out / "toy_p1.png")
    (args.out / "toy_table.md").write_text("\n".join(rows) + "\n")
    (args.out / "toy_results.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(rows))
    print(f"wrote {args.out}/toy_*")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
