"""Vertical neural networks (issue 28, phase 1): simulated VFB² of split networks against the centralised
network of the same architecture, the linear model beside them, and label leakage with and without the
protected mode.

* Fashion-MNIST in q = 4 vertical strips of the image (7 pixel columns × 28 rows = 196 features a party),
  bottoms 196-64-16, top 16-10: asynchronous VFB² (collaborators up to τ updates behind), lock-step split
  learning, the centralised network, and the linear model (bottoms 196-10 and an identity top:
  multinomial logistic regression, by the same simulation). Test accuracy per pass, time per pass.
* credit-card (D1) and a9a, binary, q = 4 random column blocks: the same comparison with bottoms
  ``*-32-8`` and top ``8-*`` (the linear reference is NonF, ``vertical/reference.py``), then the label
  attacks of ``experiments/label_attacks.py`` on a passive party's transcript, unprotected and in the
  protected mode (bottoms ``*-16-1``, identity top: no top parameters to privatise), with ε stated.

What the simulation measures and what it cannot: one process plays every party, so accuracy under
bounded staleness and the compute cost of splitting a network are real; the time an asynchronous run
saves over lock-step with a straggler is not (that is the MPI runtime's, phase 2). Times are wall and
CPU seconds of this process with torch on one thread; the machine is shared, so the CPU seconds are the
fairer comparison, and the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments._machine import cpu_model

OUT = Path(__file__).resolve().parent / "results" / "vnn"
COLOURS = {"vfb2-async": "tab:blue", "split-sync": "tab:orange", "central": "tab:green",
           "linear": "tab:grey"}


def _accuracy(proba: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(proba.argmax(axis=1) == y))


def _run_split(X, y, X_test, y_test, columns, bottom, top, n_classes, *, mode, tau, epochs, batch_size,
               optimizer, seed, protection=None, record=False):
    from vertical.nn.networks import build_split_network
    from vertical.nn.simulate import predict_proba, simulate

    bottoms, head = build_split_network(X, columns, bottom, top, n_classes, optimizer=optimizer, seed=seed)
    blocks = [X_test[:, c] for c in columns]
    result = simulate(bottoms, head, y, epochs=epochs, batch_size=batch_size, mode=mode, max_staleness=tau,
                      seed=seed, protection=protection, record=record,
                      evaluate=lambda e: {"test_accuracy": _accuracy(predict_proba(bottoms, head, blocks),
                                                                     y_test)})
    return result, bottoms


def _run_central(X, y, X_test, y_test, columns, bottom, top, n_classes, *, epochs, batch_size, optimizer,
                 seed):
    from vertical.nn.central import AssembledNetwork, train_central
    from vertical.nn.networks import build_split_network

    bottoms, head = build_split_network(X, columns, bottom, top, n_classes, optimizer=optimizer, seed=seed)
    model = AssembledNetwork.from_parties(bottoms, columns, head)
    return train_central(model, X, y, epochs=epochs, batch_size=batch_size, optimizer=optimizer, seed=seed,
                         evaluate=lambda e: {"test_accuracy": _accuracy(model.predict_proba(X_test), y_test)})


def _summary(dataset, method, seed, history, extra=None) -> dict:
    last = history[-1]
    return {"dataset": dataset, "method": method, "seed": seed, "epochs": last["epoch"],
            "test_accuracy": last["test_accuracy"], "best_accuracy": max(h["test_accuracy"] for h in history),
            "seconds_per_epoch": last["seconds"] / last["epoch"],
            "cpu_seconds_per_epoch": last["cpu_seconds"] / last["epoch"],
            "curve": [h["test_accuracy"] for h in history], "load": list(os.getloadavg()), **(extra or {})}


def main(argv: list[str] | None = None) -> None:
    import torch

    from vertical.datasets import load
    from vertical.nn.networks import OptimizerSpec
    from vertical.partition import image_strips, random_blocks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", default=["fashion-mnist", "credit-card", "a9a"])
    p.add_argument("--epochs", type=int, default=5, help="passes per run (default 5)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--tau", type=int, default=2, help="async: collaborators up to τ updates behind")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's step for every model")
    p.add_argument("--epsilon", type=float, nargs="+", default=[4.0],
                   help="the protected mode's ε (δ = 1e-5) over --epochs passes, binary data sets")
    p.add_argument("--no-privacy", action="store_true", help="skip the label-attack runs")
    p.add_argument("--methods", nargs="+", default=list(COLOURS), choices=list(COLOURS))
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of --out's results.json that this run does not redo")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    optimizer = OptimizerSpec("adam", args.lr)
    rows, privacy = [], []
    for dataset in args.datasets:
        ds = load(dataset, seed=0)
        if ds.task == "multiclass":
            y, y_test, n_classes = ds.y_train, ds.y_test, int(ds.y_train.max()) + 1
            side = round(np.sqrt(ds.X_train.shape[1]))   # square images: 28 for Fashion-MNIST
            columns = image_strips(side, side, 4)
            bottom, top, linear = "*-64-16", "16-*", ("*-10", "10")
        else:
            y, y_test, n_classes = (ds.y_train > 0).astype(int), (ds.y_test > 0).astype(int), 2
            columns = random_blocks(ds.X_train.shape[1], 4, seed=0)
            bottom, top, linear = "*-32-8", "8-*", None
        common = dict(epochs=args.epochs, batch_size=args.batch_size, optimizer=optimizer)
        data = (ds.X_train, y, ds.X_test, y_test, columns)
        for seed in args.seeds:
            for method, mode, tau in (("vfb2-async", "async", args.tau), ("split-sync", "sync", 0)):
                if method not in args.methods:
                    continue
                result, _ = _run_split(*data, bottom, top, n_classes, mode=mode, tau=tau, seed=seed, **common)
                rows.append(_summary(dataset, method, seed, result.history,
                                     {"tau": tau, "max_staleness": result.max_staleness}))
                print(f"[vnn] {dataset} {method} seed {seed}: {rows[-1]['test_accuracy']:.4f}, "
                      f"{rows[-1]['cpu_seconds_per_epoch']:.1f} CPU s/epoch", flush=True)
            if "central" in args.methods:
                history = _run_central(*data, bottom, top, n_classes, seed=seed, **common)
                rows.append(_summary(dataset, "central", seed, history))
                print(f"[vnn] {dataset} central seed {seed}: {rows[-1]['test_accuracy']:.4f}, "
                      f"{rows[-1]['cpu_seconds_per_epoch']:.1f} CPU s/epoch", flush=True)
            if linear is not None and "linear" in args.methods:
                result, _ = _run_split(*data, *linear, n_classes, mode="async", tau=args.tau, seed=seed,
                                       **common)
                rows.append(_summary(dataset, "linear", seed, result.history, {"tau": args.tau}))
                print(f"[vnn] {dataset} linear seed {seed}: {rows[-1]['test_accuracy']:.4f}", flush=True)
        if linear is None and "linear" in args.methods:
            rows.append(_nonf(dataset, ds))
        if ds.task == "binary" and not args.no_privacy:
            privacy += _privacy(dataset, ds, y, y_test, columns, args, optimizer)
    if args.merge and (args.out / "results.json").exists():
        earlier = json.loads((args.out / "results.json").read_text())
        args.earlier_commands = earlier.get("commands", [])
        redone = {(r["dataset"], r["method"], r["seed"]) for r in rows}
        rows = [r for r in earlier["rows"] if (r["dataset"], r["method"], r["seed"]) not in redone] + rows
        done = {r["dataset"] for r in privacy}
        privacy = [r for r in earlier.get("privacy", []) if r["dataset"] not in done] + privacy
        order = {d: i for i, d in enumerate(dict.fromkeys(r["dataset"] for r in earlier["rows"]))}
        rows.sort(key=lambda r: (order.get(r["dataset"], len(order)), list(COLOURS).index(r["method"]),
                                 r["seed"]))
    write(rows, privacy, args)


def _nonf(dataset, ds) -> dict:
    """The linear model of a binary data set: the NonF logistic regression (λ = 1e-4)."""
    from vertical.problems import get_problem
    from vertical.reference import evaluate, solve_reference

    problem = get_problem("logistic", lam=1e-4)
    start = time.process_time()
    solution = solve_reference(problem, ds.X_train, ds.y_train)
    accuracy = evaluate(problem, solution.w, ds.X_test, ds.y_test)["accuracy"]
    return {"dataset": dataset, "method": "linear", "seed": 0, "epochs": None, "test_accuracy": accuracy,
            "best_accuracy": accuracy, "seconds_per_epoch": None, "cpu_seconds_per_epoch": None,
            "curve": [], "load": list(os.getloadavg()), "note": "NonF logistic regression, "
            f"{time.process_time() - start:.1f} CPU s to convergence"}


def _privacy(dataset, ds, y, y_test, columns, args, optimizer) -> list[dict]:
    """Attacks on passive party 1's transcript, unprotected and at each ε, with a k = 1 split network."""
    from experiments.label_attacks import attack_all, judge, model_completion, write_simulated_audit
    from vertical.nn.networks import OptimizerSpec
    from vertical.nn.protection import LabelProtection

    out = []
    known_rows = np.random.default_rng(0).choice(y.size, y.size // 100, replace=False)
    y_pm = ds.y_train
    own = ds.X_train[:, columns[1]]
    raw = judge(model_completion(own, known_rows, y_pm[known_rows]), y_pm)
    for epsilon in [None, *args.epsilon]:
        protection = None if epsilon is None else LabelProtection.calibrated(
            epsilon, 1e-5, args.epochs, clip=0.5, seed=np.random.default_rng([args.seeds[0], 2]))
        result, bottoms = _run_split(ds.X_train, y, ds.X_test, y_test, columns, "*-16-1", "1", 2,
                                     mode="async", tau=args.tau, epochs=args.epochs,
                                     batch_size=2 * args.batch_size, optimizer=OptimizerSpec("adam", 3e-3),
                                     seed=args.seeds[0], protection=protection, record=True)
        with tempfile.TemporaryDirectory(prefix="vfl-vnn-") as tmp:
            path = write_simulated_audit(Path(tmp) / "audit-1.npz", result.dispatched, rank=1)
            found = attack_all(path, y_pm, known=(known_rows, y_pm[known_rows]))
        completion = judge(model_completion(bottoms[1].embed(own), known_rows, y_pm[known_rows]), y_pm)
        out.append({"dataset": dataset, "mode": "plain" if epsilon is None else f"dp ε={epsilon:g}",
                    "epsilon": epsilon, "delta": None if epsilon is None else 1e-5,
                    "noise_multiplier": None if protection is None else protection.noise_multiplier,
                    "test_accuracy": result.history[-1]["test_accuracy"],
                    "norm_auc": max(found["theta_norm"]["auc"], 1 - found["theta_norm"]["auc"]),
                    "direction_auc": max(found["theta_direction"]["auc"],
                                         1 - found["theta_direction"]["auc"]),
                    "direction_accuracy": found["theta_direction"]["accuracy"],
                    "completion_auc": completion["auc"], "raw_features_auc": raw["auc"],
                    "known_labels": int(known_rows.size), "load": list(os.getloadavg())})
        print(f"[vnn] {dataset} {out[-1]['mode']}: test {out[-1]['test_accuracy']:.4f}, direction AUC "
              f"{out[-1]['direction_auc']:.3f}, norm AUC {out[-1]['norm_auc']:.3f}", flush=True)
    return out


def write(rows: list[dict], privacy: list[dict], args) -> None:
    """results.json / results.csv / table.md and the FMNIST accuracy curves."""
    import csv

    from experiments._plotting import figure_legend, pyplot, save

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m experiments vnn " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items() if k not in ("out", "no_privacy", "merge", "earlier_commands"))
    header = {"load": os.getloadavg(), "cpu": cpu_model(), "torch_threads": 1,
              "commands": [*getattr(args, "earlier_commands", []),
                           command + (" --merge" if args.merge else "")],
              "epochs": args.epochs, "seeds": args.seeds, "batch_size": args.batch_size, "tau": args.tau}
    (out / "results.json").write_text(json.dumps({**header, "rows": rows, "privacy": privacy}, indent=1))
    with open(out / "results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=[k for k in rows[0] if k != "curve"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"Machine: {header['cpu']}, load {', '.join(f'{x:.1f}' for x in header['load'])} at the end; "
             f"{args.epochs} pass(es), seeds {args.seeds}, B = {args.batch_size}, τ = {args.tau}; torch on "
             "one thread. Commands: " + "; ".join(f"`{c}`" for c in header["commands"]) + ".", "",
             "| dataset | method | test accuracy (mean over seeds) | Δ vs central (points) | CPU s/epoch | "
             "× central | wall s/epoch |", "|---|---|---|---|---|---|---|"]
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        mine = [r for r in rows if r["dataset"] == dataset]
        central = [r for r in mine if r["method"] == "central"]
        c_acc = np.mean([r["test_accuracy"] for r in central])
        c_cpu = np.mean([r["cpu_seconds_per_epoch"] for r in central])
        for method in dict.fromkeys(r["method"] for r in mine):
            group = [r for r in mine if r["method"] == method]
            acc = np.mean([r["test_accuracy"] for r in group])
            cpu = [r["cpu_seconds_per_epoch"] for r in group if r["cpu_seconds_per_epoch"] is not None]
            wall = [r["seconds_per_epoch"] for r in group if r["seconds_per_epoch"] is not None]
            name = f"{method} ({group[0]['note']})" if "note" in group[0] else method
            times = (f"{np.mean(cpu):.2f} | {np.mean(cpu) / c_cpu:.2f} | {np.mean(wall):.2f}" if cpu
                     else "– | – | –")
            lines.append(f"| {dataset} | {name} | {100 * acc:.2f} % | {100 * (acc - c_acc):+.2f} | {times} |")
    if privacy:
        lines += ["", "Label attacks on passive party 1's transcript (k = 1 bottoms `*-16-1`, identity top; "
                  "1 % of the labels known to the attacker; AUC either way round is max(AUC, 1 − AUC)):", "",
                  "| dataset | mode | σ | test accuracy | direction attack: accuracy, AUC | norm AUC | "
                  "model completion AUC (raw features) |", "|---|---|---|---|---|---|---|"]
        for r in privacy:
            sigma = "–" if r["noise_multiplier"] is None else f"{r['noise_multiplier']:.2f}"
            lines.append(f"| {r['dataset']} | {r['mode']} | {sigma} | {100 * r['test_accuracy']:.2f} % | "
                         f"{100 * r['direction_accuracy']:.1f} %, {r['direction_auc']:.3f} | "
                         f"{r['norm_auc']:.3f} | {r['completion_auc']:.3f} ({r['raw_features_auc']:.3f}) |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    curves = [r for r in rows if r["curve"]]
    datasets = list(dict.fromkeys(r["dataset"] for r in curves))
    if not datasets:
        return
    plt = pyplot()
    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4), squeeze=False,
                             layout="constrained")
    for ax, dataset in zip(axes[0], datasets, strict=True):
        for r in (r for r in curves if r["dataset"] == dataset):
            ax.plot(range(1, len(r["curve"]) + 1), [100 * a for a in r["curve"]], marker="o",
                    color=COLOURS[r["method"]], label=r["method"], alpha=0.8)
        ax.set_title(dataset)
        ax.set_xlabel("pass over the training rows")
        ax.set_ylabel("test accuracy (%)")
    figure_legend(fig)
    save(fig, out / "accuracy.png", dpi=110)
