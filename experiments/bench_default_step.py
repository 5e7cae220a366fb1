"""The default step and scaling (issue 25): test accuracy without ``--gamma`` against NonF, per dataset, B.

Without ``--gamma`` a run derives its step from the data (``vertical/step_size.py``) and, by default
(``--standardize on``), each party first scales its columns (``vertical/standardize.py``). This runs
real ``vfl train`` jobs with no step or scaling option on breast-cancer, a9a, w8a, credit-card (D1) and
a generated 5,000 × 300 file of features on scales 1 to 10⁴ (``_unscaled.py``), at B = 1 and B = 64, and
compares the final test accuracy with the centralised NonF model's on the features as the job trains
them (each party's block scaled as ``--standardize on`` scales it; the bundled datasets are left as
loaded by that scaling, so there it is NonF on the data as loaded). The scaling changes only what the
regulariser sees (``vertical/standardize.py``), so on the generated file NonF on the raw features is a
different objective; the table gives it too. Epochs: the README's jobs (a9a, w8a: 3, Table 2's cap; else
10); ``--epochs NAME[@B]=E`` reduces one (the table says so). ``--constant-gamma G`` adds the same jobs
with the paper's setting beside (γ = G on the features as given, ``--standardize off``), for the
contrast. q = 4, m = 2, SVRG (the defaults), λ = 1e-4. The candidates were scanned in one process first
(``python -m experiments default_step_scan``).

Outputs in ``experiments/results/default_step/``: ``rows.csv``/``rows.json``, ``table.md`` and
``default_step.png``, with the load average and the CPU model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments._machine import cpu_model
from experiments._plotting import colours, figure_legend, pyplot, save
from experiments._unscaled import write_unscaled_libsvm
from experiments._vfb2_runner import (
    base_parser,
    command_line,
    markdown_table,
    nonf,
    nonf_cache,
    output_dir,
    present_datasets,
    say,
    write_rows,
)
from parties.config import RunConfig
from parties.launch import launch
from parties.outcomes import EXIT_CODES

NAME = "default_step"
DATASETS = ("breast-cancer", "a9a", "w8a", "credit-card", "unscaled")
#: the README's jobs: Table 2 caps a9a and w8a at 3 epochs; the default 10 elsewhere
EPOCHS = {"a9a": 3.0, "w8a": 3.0}
BATCHES = (1, 64)
GENERATED = "unscaled"
LAM = 1e-4


def main(argv: list[str] | None = None) -> None:
    p = base_parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    p.add_argument("--epochs", nargs="*", default=[], metavar="NAME[@B]=E",
                   help="fewer epochs for a dataset (at batch size B) than the README's (said in the table)")
    p.add_argument("--constant-gamma", type=float, default=None,
                   help="also run every job with this fixed γ (e.g. 0.05, the old default)")
    p.add_argument("--update", action="store_true",
                   help="keep the rows of the datasets not run now from the output folder's rows.json")
    args = p.parse_args(argv)
    out = output_dir(args, NAME)
    reduced = {k: float(v) for k, v in (e.split("=", 1) for e in args.epochs)}
    registered = [d for d in args.datasets if d != GENERATED]
    present = present_datasets(registered, args.data_dir) if registered else set()
    load_before = os.getloadavg()
    rows = _kept_rows(out, args.datasets) if args.update else []
    earlier = _earlier_run(out) if rows else None
    with tempfile.TemporaryDirectory(prefix="vfl-default-step-") as tmp:
        for dataset in args.datasets:
            if dataset != GENERATED and dataset not in present:
                say(f"{dataset}: not in the data folder, skipped")
                continue
            source, reference, raw = _data(dataset, args, out, Path(tmp))
            for batch in args.batches:
                epochs = reduced.get(f"{dataset}@{batch}", reduced.get(dataset, EPOCHS.get(dataset, 10.0)))
                full = epochs == EPOCHS.get(dataset, 10.0)
                for gamma in (None, args.constant_gamma) if args.constant_gamma else (None,):
                    say(f"{dataset} B={batch} {'default' if gamma is None else f'γ = {gamma:g}'}: "
                        f"{epochs:g} epochs; load {os.getloadavg()[0]:.2f}")
                    row = _job(source, dataset, batch, gamma, epochs, Path(tmp) / "run")
                    row.update(nonf_accuracy=reference, nonf_raw_accuracy=raw, full_epochs=full,
                               delta_points=round(100 * (row["test_accuracy"] - reference), 3))
                    say(json.dumps(row))
                    rows.append(row)
                    _write(out, rows, {"command": command_line(NAME, argv), "load_before": load_before,
                                       "load_after": os.getloadavg(), "cpu": cpu_model(),
                                       "earlier": earlier})
    say(f"wrote {out}")


def _write(out: Path, rows: list[dict], meta: dict) -> None:
    """Everything so far (after each job: a run cut short keeps what it measured)."""
    meta = {**meta, "parties": 4, "active": 2, "algorithm": "svrg", "lam": LAM}
    write_rows(out / "rows.csv", rows)
    (out / "rows.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (out / "table.md").write_text(_table(rows, meta))
    _figure(rows, out / f"{NAME}.png")


def _kept_rows(out: Path, rerun: list[str]) -> list[dict]:
    """``--update``: the rows of ``rows.json`` whose dataset is not run again."""
    saved = out / "rows.json"
    if not saved.exists():
        return []
    return [r for r in json.loads(saved.read_text())["rows"] if r["dataset"] not in rerun]


def _earlier_run(out: Path) -> dict:
    """The command and loads of the run whose rows ``--update`` keeps (itself kept from an earlier one)."""
    meta = json.loads((out / "rows.json").read_text())["meta"]
    return meta.get("earlier") or {k: meta[k] for k in ("command", "load_before", "load_after")}


def _data(dataset: str, args, out: Path, tmp: Path) -> tuple[list[str], float, float]:
    """The job's data options, NonF's test accuracy on the features as trained and on the raw ones
    (the generated file: split into party files; the bundled datasets: the same, scaling leaves them)."""
    if dataset != GENERATED:
        ref = nonf(dataset, "logistic", LAM, 0, data_dir=args.data_dir, cache=nonf_cache(args, out))
        return ["--dataset", dataset], ref.metric, ref.metric
    source = write_unscaled_libsvm(tmp / "unscaled.libsvm")
    parties = tmp / "parties"
    subprocess.run([sys.executable, "-m", "vfl.cli", "split", str(source), "-n", "4", "-m", "2", "--task",
                    "binary", "--n-features", "300", "--out", str(parties)], check=True, capture_output=True)
    return ["--party-files", str(parties)], _nonf_of_files(parties, scaled=True), _nonf_of_files(parties)


def _nonf_of_files(parties: Path, *, scaled: bool = False) -> float:
    """NonF's test accuracy on the split file: the blocks put back together (one machine holds them),
    each scaled first as its party scales it under ``--standardize on`` when ``scaled``."""
    import scipy.sparse as sp

    from vertical.datasets import load_party_file
    from vertical.datasets.party_files import find_party_file
    from vertical.problems import get_problem
    from vertical.reference import evaluate, solve_reference
    from vertical.standardize import apply_scaling, fit_scaling

    files = [load_party_file(find_party_file(parties, p)) for p in range(4)]
    blocks = []
    for f in files:
        train, test = sp.csr_matrix(f.X_train), sp.csr_matrix(f.X_test)
        if scaled:
            scaling = fit_scaling(train, "on")
            train, test = apply_scaling(train, scaling), apply_scaling(test, scaling)
        blocks.append((train, test))
    X_train = sp.hstack([b[0] for b in blocks]).tocsr()
    X_test = sp.hstack([b[1] for b in blocks]).tocsr()
    problem = get_problem("logistic", lam=LAM)
    sol = solve_reference(problem, X_train, files[0].y_train, tol=1e-6)
    return float(evaluate(problem, sol.w, X_test, files[0].y_test)["accuracy"])


def _job(data: list[str], dataset: str, batch: int, gamma: float | None, epochs: float, work: Path) -> dict:
    """One ``vfl train`` job through the launcher; a diverged run is a result, not a failure."""
    shutil.rmtree(work, ignore_errors=True)
    options = {"dataset": data[1]} if data[0] == "--dataset" else {"party_files": data[1]}
    paper = {} if gamma is None else {"gamma": gamma, "standardize": "off"}  # the paper's: as given
    config = RunConfig(**options, batch_size=batch, epochs=epochs, eval_every=epochs,
                       lam=LAM, reference=False, out=str(work), progress=False, **paper)
    started = time.perf_counter()
    code = launch(config, echo=False)
    wall = time.perf_counter() - started
    if code not in (EXIT_CODES["ok"], EXIT_CODES["diverged"]):
        raise RuntimeError(f"{dataset} B={batch}: vfl train failed with exit code {code}")
    result = json.loads((work / "result.json").read_text())
    record = result["record"]
    return {"dataset": dataset, "batch_size": batch, "gamma_given": gamma, "gamma": result["gamma"],
            "epochs": result["epochs"], "outcome": result["outcome"], "loss": record["loss"],
            "test_accuracy": record.get("test_accuracy", float("nan")), "warning": "warning" in result,
            "standardize": config.standardize, "wall_s": round(wall, 2),
            "load_1min": round(os.getloadavg()[0], 2)}


def _table(rows: list[dict], meta: dict) -> str:
    header = ["dataset", "B", "γ", "--standardize", "epochs", "outcome", "final loss", "test accuracy",
              "NonF (as trained)", "Δ (points)", "NonF (raw features)"]
    body = [[r["dataset"], r["batch_size"],
             f"{r['gamma']:.4g} ({'derived' if r['gamma_given'] is None else '--gamma'})", r["standardize"],
             f"{r['epochs']:g}" + ("" if r["full_epochs"] else " (reduced)"), r["outcome"],
             f"{r['loss']:.4g}", f"{100 * r['test_accuracy']:.2f} %", f"{100 * r['nonf_accuracy']:.2f} %",
             f"{r['delta_points']:+.2f}" + (" ✗" if r["delta_points"] < -0.5 else ""),
             f"{100 * r.get('nonf_raw_accuracy', r['nonf_accuracy']):.2f} %"] for r in rows]
    return (f"# Without --gamma: test accuracy against NonF\n\n"
            f"`{meta['command']}`; q = 4, m = 2, SVRG, λ = 1e-4; CPU {meta['cpu']}, load average "
            f"{meta['load_before'][0]:.2f} before, {meta['load_after'][0]:.2f} after (shared machine: "
            "accuracy does not depend on load). Epochs: the README's (a9a, w8a 3; else 10) unless marked "
            "reduced. Rows marked derived ran with no step or scaling option (the defaults); --gamma rows "
            "are the paper's setting on the features as given. NonF (as trained): the centralised optimum"
            " of the objective the job trains (each block scaled as --standardize on scales it; the "
            "bundled datasets are left as loaded by it); Δ is against it. NonF (raw features): on the "
            "data as loaded, a different objective where the scaling changes anything (the regulariser "
            "sees the scales). ✗: "
            "more than 0.5 points below NonF (as trained)." + _kept_note(meta.get("earlier")) + "\n\n"
            + markdown_table(header, body))


def _kept_note(earlier: dict | None) -> str:
    if not earlier:
        return ""
    return (f" Rows of the datasets this command did not run come from `{earlier['command']}` (load "
            f"{earlier['load_before'][0]:.2f} before, {earlier['load_after'][0]:.2f} after).")


def _figure(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    keys = sorted({(r["batch_size"], r["gamma_given"] is None) for r in rows}, key=lambda k: (not k[1], k[0]))
    constant = next((r["gamma_given"] for r in rows if r["gamma_given"] is not None), None)
    label = {k: f"B = {k[0]}, " + ("defaults" if k[1] else f"γ = {constant:g}, as given") for k in keys}
    colour = colours(label[k] for k in keys)
    fig, (acc, loss, step) = plt.subplots(1, 3, figsize=(14, 4), layout="constrained")
    width = 0.8 / max(len(keys), 1)
    for j, key in enumerate(keys):
        picked = {r["dataset"]: r for r in rows if (r["batch_size"], r["gamma_given"] is None) == key}
        x = np.array([i for i, d in enumerate(datasets) if d in picked]) + (j - (len(keys) - 1) / 2) * width
        mine = [picked[d] for d in datasets if d in picked]
        acc.bar(x, [max(r["delta_points"], -20) for r in mine], width, color=colour[label[key]],
                label=label[key])
        loss.bar(x, [min(r["loss"], 100.0) for r in mine], width, color=colour[label[key]], label=label[key])
        step.bar(x, [r["gamma"] for r in mine], width, color=colour[label[key]], label=label[key])
    for ax in (acc, loss, step):
        ax.set_xticks(range(len(datasets)), datasets, rotation=20)
        ax.set_xlabel("dataset")
    acc.axhline(0, color="black", linewidth=0.8)
    acc.axhline(-0.5, color="black", linestyle=":", linewidth=0.8, label="0.5 points below NonF")
    acc.set_ylabel("test accuracy − NonF (points; floor −20)")
    acc.set_title("accuracy after the README's epochs")
    loss.axhline(np.log(2), color="black", linestyle="--", linewidth=0.8, label="loss at w = 0 (log 2)")
    loss.set_yscale("log")
    loss.set_ylabel("final training loss (log scale; cap 100)")
    loss.set_title("above the dashed line: worse than w = 0")
    step.set_yscale("log")
    step.set_ylabel("step size γ")
    step.set_title("the step each run used")
    figure_legend(fig)
    save(fig, path)


if __name__ == "__main__":
    main()
