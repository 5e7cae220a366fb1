"""Candidate default steps scanned in one process: which rule reaches NonF's accuracy on every dataset.

The question behind ``vertical/step_size.py``: which γ, computed from the data alone, brings a run
within 0.5 points of NonF's test accuracy in the README's epochs (a9a, w8a: 3; else 10) at B = 1 and
B = 64, on breast-cancer, D1 (credit-card), a9a, w8a and the generated unscaled file
(``_unscaled.py``, scales 1 to 10⁴, seeded 80/20 split). Real jobs take minutes each on this machine;
the same updates in one process (:func:`simulate`: the VFB² SVRG rule of ``vertical/algorithms/vfb2.py``
on the whole row, one pass a permutation of the rows, one step per B of them, a snapshot each epoch)
take seconds, so every candidate is tried here and the chosen one is then confirmed by real jobs
(``python -m experiments default_step``). It is the MPI runtime minus asynchrony: the runtime's m = 2
dominators read scores a few steps stale.

Candidates (``--standardize on`` unless marked): the old bound (``L_rows`` the sum of the blocks'
largest squared row norms, ``L_full`` their mean: the trace bound), the chosen rule
(:func:`vertical.step_size.default_gamma`) and 2× and 4× it, a safeguard that halves γ after an epoch
whose loss rose ("halve", on 4× the rule), growing γ twice each epoch whose loss fell and going back
to the best epoch's model and half the step after one whose loss rose ("grow", from the rule), and
the rule on the features as given (``--standardize off``). The blocks are the launcher's split
(``random_blocks``, q = 4, seed 0).

Outputs in ``experiments/results/default_step/``: ``scan.csv``, ``scan.md``.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from experiments._machine import cpu_model
from experiments._unscaled import write_unscaled_libsvm
from experiments._vfb2_runner import (
    base_parser,
    command_line,
    markdown_table,
    output_dir,
    present_datasets,
    say,
    write_rows,
)
from vertical.algorithms.vfb2 import Block, get_rule
from vertical.partition import random_blocks
from vertical.problems import get_problem
from vertical.reference import evaluate, solve_reference
from vertical.standardize import apply_scaling, fit_scaling
from vertical.step_size import block_smoothness, default_gamma, expected_smoothness

NAME = "default_step"
DATASETS = ("breast-cancer", "credit-card", "a9a", "w8a", "unscaled")
EPOCHS = {"a9a": 3, "w8a": 3}
LAM = 1e-4
#: (label, γ's rule, multiple, policy): each on the features scaled (the default) and as given
CANDIDATES = (("old bound (max, trace)", "old", 1.0, "constant"),
              ("rule", "rule", 1.0, "constant"),
              ("2× rule", "rule", 2.0, "constant"),
              ("4× rule", "rule", 4.0, "constant"),
              ("4× rule, halve on a rise", "rule", 4.0, "halve"),
              ("rule, grow ×2 while it falls", "rule", 1.0, "grow"))
#: the NonF solve's tolerance (the features on scales to 10⁴ make a tighter one slow)
NONF_TOL = 1e-6


def main(argv: list[str] | None = None) -> None:
    p = base_parser("default_step_scan", __doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    args = p.parse_args(argv)
    out = output_dir(args, NAME)
    registered = [d for d in args.datasets if d != "unscaled"]
    present = present_datasets(registered, args.data_dir) if registered else set()
    load_before, rows = os.getloadavg(), []
    problem = get_problem("logistic", lam=LAM)
    for dataset in args.datasets:
        if dataset != "unscaled" and dataset not in present:
            say(f"{dataset}: not in the data folder, skipped")
            continue
        X, y, X_test, y_test = _data(dataset, args.data_dir, out)
        nonf = solve_reference(problem, X, y, tol=NONF_TOL)
        reference = evaluate(problem, nonf.w, X_test, y_test)["accuracy"]
        epochs = 3 if args.quick else EPOCHS.get(dataset, 10)
        scaling = fit_scaling(X, "on")
        features = {"on": (apply_scaling(X, scaling), apply_scaling(X_test, scaling)), "off": (X, X_test)}
        for standardize, (label, rule, multiple, policy), batch in itertools.product(
                ("on", "off"), CANDIDATES, args.batches):
            scaled, scaled_test = features[standardize]
            gamma = multiple * _gamma(rule, scaled, batch, problem)
            started = time.perf_counter()
            w, losses = simulate(problem, scaled, y, batch, epochs, gamma, policy)
            accuracy = evaluate(problem, w, scaled_test, y_test)["accuracy"]
            row = {"dataset": dataset, "batch_size": batch, "candidate": label,
                   "standardize": standardize, "gamma0": gamma,
                   "epochs": epochs, "final_loss": problem.objective(w, scaled, y),
                   "test_accuracy": accuracy,
                   "nonf_accuracy": reference, "delta_points": round(100 * (accuracy - reference), 3),
                   "losses": " ".join(f"{v:.4g}" for v in losses),
                   "seconds": round(time.perf_counter() - started, 2)}
            say(f"{dataset} B={batch} {label} ({standardize}): γ0 {gamma:.4g}, {100 * accuracy:.2f} % "
                f"({row['delta_points']:+.2f}), losses {row['losses']}")
            rows.append(row)
        meta = {"command": command_line("default_step_scan", argv), "load_before": load_before,
                "load_after": os.getloadavg(), "cpu": cpu_model()}
        write_rows(out / "scan.csv", rows)
        (out / "scan.md").write_text(_table(rows, meta))
    say(f"wrote {out / 'scan.md'}")


def _data(dataset: str, data_dir: str | None, out: Path):
    """Training and test rows (CSR) and labels: a registered dataset's split, or the generated file's
    seeded 80/20 split."""
    if dataset != "unscaled":
        from vertical.datasets import load

        ds = load(dataset, seed=0, data_dir=data_dir)
        return sp.csr_matrix(ds.X_train), ds.y_train, sp.csr_matrix(ds.X_test), ds.y_test
    from sklearn.datasets import load_svmlight_file

    from vertical.datasets.base import seeded_split

    path = write_unscaled_libsvm(out / "unscaled.libsvm")
    X, y = load_svmlight_file(str(path), n_features=300)
    path.unlink()
    train, test = seeded_split(X.shape[0], 0)
    return X[train].tocsr(), y[train], X[test].tocsr(), y[test]


def _gamma(rule: str, X, batch: int, problem) -> float:
    """γ of a rule from the launcher's four blocks of ``X``."""
    blocks = [Block.from_matrix(X[:, cols]) for cols in random_blocks(X.shape[1], 4, seed=0)]
    shared = np.array([block_smoothness(b) for b in blocks])
    if rule == "rule":
        return default_gamma(shared, X.shape[0], batch, problem.loss, LAM)
    trace = sum(float(np.square(b.data).sum()) / max(b.n_rows, 1) for b in blocks)  # the old L_full
    c = problem.loss.curvature
    return 1.0 / (expected_smoothness(c * shared[:, 0].sum(), c * trace, X.shape[0], batch) + LAM)


def simulate(problem, X, y: np.ndarray, batch: int, epochs: int, gamma: float, policy: str = "constant",
             seed: int = 0, algorithm: str = "svrg") -> tuple[np.ndarray, list[float]]:
    """SVRG (or ``algorithm``) as the runtime runs it, in one process: each epoch a snapshot (SAGA: one
    table at the start), then one permutation of the rows in steps of ``batch``. ``policy``:
    ``constant`` γ; ``halve`` γ after an epoch whose loss rose; ``grow``: γ doubles after an epoch whose
    loss fell, and after one whose loss rose the best epoch's model comes back with half the step.
    Returns the model (the best epoch's under ``grow``) and the loss at the start and after each
    epoch."""
    n = X.shape[0]
    rule = get_rule(algorithm)(Block.from_matrix(X), problem.regularizer, problem.lam, gamma,
                               batch_size=batch)
    w = np.zeros(X.shape[1])
    rng = np.random.default_rng(seed)
    losses = [problem.objective(w, X, y)]
    best, best_w = losses[0], w.copy()
    if rule.needs_initial_pass:
        rule.initialize(np.asarray(problem.theta(X @ w, y), dtype=np.float64), w)
    for _ in range(epochs):
        rule.synchronize(w)
        rule.set_gamma(gamma)
        if rule.needs_snapshot:
            rule.snapshot(np.asarray(problem.theta(X @ w, y), dtype=np.float64), w)
        order = rng.permutation(n)
        with np.errstate(all="ignore"):
            for start in range(0, n - batch + 1, batch):
                rows = order[start:start + batch]
                theta = problem.theta(rule.products(w, rows), y[rows])
                rule.apply(w, rows, np.asarray(theta, dtype=np.float64).reshape(-1))
            rule.synchronize(w)
            loss = problem.objective(w, X, y)
        rose = not np.isfinite(loss) or loss > losses[-1]
        losses.append(float(loss))
        if policy == "halve" and rose:
            gamma /= 2
        elif policy == "grow":
            if rose or loss > best:
                w[:] = best_w
                gamma /= 2
            else:
                best, best_w = loss, w.copy()
                gamma *= 2
    return w, losses


def _table(rows: list[dict], meta: dict) -> str:
    header = ["dataset", "B", "--standardize", "candidate", "γ₀", "epochs", "final loss", "test accuracy",
              "NonF", "Δ (points)"]
    body = [[r["dataset"], r["batch_size"], r["standardize"], r["candidate"], f"{r['gamma0']:.4g}",
             r["epochs"],
             f"{r['final_loss']:.5g}", f"{100 * r['test_accuracy']:.2f} %",
             f"{100 * r['nonf_accuracy']:.2f} %",
             f"{r['delta_points']:+.2f}" + (" ✗" if r["delta_points"] < -0.5 else "")] for r in rows]
    return ("# Candidate default steps, simulated in one process\n\n"
            f"`{meta['command']}`; SVRG, λ = 1e-4, the launcher's 4 blocks; one process (no asynchrony); "
            f"NonF on the features as loaded. CPU {meta['cpu']}, load average {meta['load_before'][0]:.2f} "
            f"before, {meta['load_after'][0]:.2f} after (accuracy does not depend on load). ✗: more than 0.5 "
            "points below NonF. The chosen default is \"rule\" (`vertical/step_size.py`).\n\n"
            + markdown_table(header, body))


if __name__ == "__main__":
    main()
