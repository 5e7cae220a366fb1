"""Vertical networks on the MPI runtime (issue 28, phase 2): real ``vfl train --model mlp`` jobs.

* **straggler** - one party 3× slower (``--straggler 1 --slowdown 2``): asynchronous VFB² (``--mode
  async``) against lock-step split learning (``--mode sync-global``), alternating run by run, each
  evaluated every ``--eval-every`` epochs. The lock-step run's final test accuracy is the target; the
  speed-up is the lock-step run's training time over the time the asynchronous run first reached it
  (the issue's goal: ≥ 2×).
* **privacy** - ``--label-privacy dp-theta`` at each ``--epsilons`` against the unprotected job (the same
  seed and options, async): test accuracy, and Li et al.'s direction and norm attacks on a passive
  party's ``--audit`` transcript (1 % of the labels known to orient the direction), and the model
  completion attack (a logistic head fitted on the party's own trained embeddings of the known rows);
  the issue's goal: attack AUC ≤ 0.60 at ≤ 1 point of accuracy, with ε stated.
* **accuracy** - the runtime (async) against the centralised network of the same architecture
  (``vertical/nn/central.py``: every party's network on its own columns, summed, the same top, one
  process, the same epochs and batch size), per seed; and the time of an epoch of each.

Fashion-MNIST is cut by ``vfl split --strips`` (q vertical strips of the image), the binary datasets
by random column blocks (the launcher's split). Training time is the runtime's own (evaluations
excluded); the CPU model and the load average are recorded with every row, because on this shared
2-core machine numbers at load 6-11 differ 2-50× from quiet ones.

``python -m experiments vnn_runtime --part straggler --dataset a9a --epochs 2 --repeats 2``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments._machine import cpu_model

OUT = Path(__file__).resolve().parent / "results" / "vnn_runtime"
REPO = Path(__file__).resolve().parents[1]
COLOURS = {"async": "tab:blue", "sync-global": "tab:orange", "central": "tab:green"}


def _job(folder: Path, dataset: str, parties: int, args: list[str]) -> list[dict]:
    """One ``vfl train --model mlp`` job; its metrics records."""
    data = (["--party-files", str(_strips(folder.parent, dataset, parties))] if dataset == "fashion-mnist"
            else ["--dataset", dataset])
    cmd = [sys.executable, "-m", "vfl.cli", "train", "--model", "mlp", "--algorithm", "sgd", "-m", "1",
           "-n", str(parties), *data, "--out", str(folder), "--overwrite", "--no-progress", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _strips(root: Path, dataset: str, parties: int) -> Path:
    folder = root / f"{dataset}-{parties}-strips"
    if not (folder / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "vfl.cli", "split", dataset, "-n", str(parties), "--strips",
                        "--out", str(folder), "--overwrite"], cwd=REPO, check=True, capture_output=True)
    return folder


def _load() -> float:
    return os.getloadavg()[0]


def straggler(args, work: Path) -> list[dict]:
    rows = []
    common = ["-B", str(args.batch), "--gamma", str(args.gamma), "--eval-every", str(args.eval_every),
              "--straggler", "1", "--slowdown", str(args.slowdown), "--bottom", args.bottom,
              "--top", args.top]
    for repeat in range(args.repeats):
        runs = {}
        for mode in ("sync-global", "async"):  # alternating, side by side
            load = _load()
            # the asynchronous run may go on past the lock-step run's epochs to reach its accuracy
            epochs = args.epochs * (args.async_factor if mode == "async" else 1)
            extra = ["--mode", mode, "--epochs", str(epochs)] + (["-P", str(args.inflight)]
                                                                 if mode == "async" else [])
            runs[mode] = _job(work / f"{mode}-{repeat}", args.dataset, args.parties,
                              common + extra + ["--seed", str(repeat)])
            runs[mode + "-load"] = load
        target = runs["sync-global"][-1]["test_accuracy"]
        lock_time = runs["sync-global"][-1]["time"]
        reached = next((r["time"] for r in runs["async"] if r["test_accuracy"] >= target), None)
        for mode in ("sync-global", "async"):
            rows.append({"part": "straggler", "dataset": args.dataset, "repeat": repeat, "mode": mode,
                         "final_accuracy": runs[mode][-1]["test_accuracy"],
                         "train_time": runs[mode][-1]["time"],
                         "time_to_target": lock_time if mode == "sync-global" else reached,
                         "target": target, "speedup": (lock_time / reached) if reached else None,
                         "curve": [(r["time"], r["test_accuracy"]) for r in runs[mode]],
                         "load": round(runs[mode + "-load"], 2), "cpu": cpu_model()})
    return rows


def _central(dataset: str, parties: int, bottom: str, top: str, epochs: int, batch: int, seed: int,
             gamma: float) -> dict:
    """The centralised network of the runtime's architecture on the job's columns, one process."""
    import torch

    from vertical.datasets import load
    from vertical.nn.central import AssembledNetwork, train_central
    from vertical.nn.networks import OptimizerSpec, build_split_network
    from vertical.partition import image_strips, random_blocks

    torch.set_num_threads(1)
    ds = load(dataset, seed=0)
    if dataset == "fashion-mnist":
        columns, y, y_test = image_strips(28, 28, parties), ds.y_train, ds.y_test
        n_classes = 10
    else:
        columns = random_blocks(ds.n_features, parties, seed=seed)
        y, y_test, n_classes = (ds.y_train > 0).astype(np.int64), (ds.y_test > 0).astype(np.int64), 2
    X, X_test = _scaled_as_the_parties(ds.X_train, ds.X_test, columns)
    optimizer = OptimizerSpec("adam", lr=gamma, weight_decay=1e-4)  # the runtime's --gamma, --lam 1e-4
    bottoms, head = build_split_network(X, columns, bottom, top, n_classes, optimizer=optimizer, seed=seed)
    model = AssembledNetwork.from_parties(bottoms, columns, head)
    started = time.perf_counter()
    train_central(model, X, y, epochs=epochs, batch_size=batch, optimizer=optimizer, seed=seed)
    seconds = time.perf_counter() - started
    proba = model.predict_proba(X_test)
    return {"test_accuracy": float(np.mean(proba.argmax(axis=1) == y_test)), "time": seconds}


def _scaled_as_the_parties(X, X_test, columns):
    """Each party's columns scaled as ``--standardize on`` scales them at the party (its training rows'
    statistics), so that the centralised network sees the data the runtime's networks see."""
    import scipy.sparse as sp

    from vertical.standardize import apply_scaling, fit_scaling

    X, X_test = sp.csc_matrix(X, dtype=np.float64), sp.csc_matrix(X_test, dtype=np.float64)
    train_parts, test_parts = [], []
    for cols in columns:
        scaling = fit_scaling(X[:, cols], "on")
        train_parts.append(apply_scaling(X[:, cols], scaling))
        test_parts.append(apply_scaling(X_test[:, cols], scaling))
    order = np.argsort(np.concatenate(columns))  # back to the data's column order
    return (sp.hstack(train_parts).tocsc()[:, order].toarray(),
            sp.hstack(test_parts).tocsc()[:, order].toarray())


def accuracy(args, work: Path) -> list[dict]:
    rows = []
    for seed in range(args.seeds):
        load = _load()
        records = _job(work / f"async-{seed}", args.dataset, args.parties,
                       ["-B", str(args.batch), "--gamma", str(args.gamma), "--epochs", str(args.epochs),
                        "--bottom", args.bottom,
                        "--top", args.top, "-P", str(args.inflight), "--seed", str(seed)])
        rows.append({"part": "accuracy", "dataset": args.dataset, "seed": seed, "mode": "async",
                     "final_accuracy": records[-1]["test_accuracy"], "train_time": records[-1]["time"],
                     "epoch_time": records[-1]["time"] / args.epochs, "load": round(load, 2),
                     "cpu": cpu_model()})
        load = _load()
        central = _central(args.dataset, args.parties, args.bottom, args.top, args.epochs, args.batch, seed,
                           args.gamma)
        rows.append({"part": "accuracy", "dataset": args.dataset, "seed": seed, "mode": "central",
                     "final_accuracy": central["test_accuracy"], "train_time": central["time"],
                     "epoch_time": central["time"] / args.epochs, "load": round(load, 2), "cpu": cpu_model()})
    return rows


def privacy(args, work: Path) -> list[dict]:
    rows = []
    common = ["-B", str(args.batch), "--gamma", str(args.gamma), "--gamma-decay", str(args.gamma_decay),
              "--epochs", str(args.epochs), "--lam", f"{args.lam:g}",
              "--bottom", args.bottom, "--top", args.top, "-P", str(args.inflight), "--audit"]
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for epsilon in [None, *args.epsilons]:
            if epsilon is None:
                mode, extra = "plain", []
            elif args.mechanism == "dp":  # randomized response on the labels, drawn once per run
                mode = f"dp rr{'-forward' if args.correction == 'forward' else ''} ε={epsilon:g}"
                extra = ["--label-privacy", "dp", "--epsilon", f"{epsilon:g}", "--label-noise-correction",
                         args.correction]
            else:
                mode = f"dp-theta {args.theta_noise} ε={epsilon:g}"
                extra = ["--label-privacy", "dp-theta", "--epsilon", f"{epsilon:g}", "--theta-noise",
                         args.theta_noise]
            load = _load()
            folder = work / f"{mode.replace(' ', '-')}-{seed}"
            records = _job(folder, args.dataset, args.parties, common + extra + ["--seed", str(seed)])
            attacks = _attacks(folder, rank=args.parties - 1, seed=seed)
            rows.append({"part": "privacy", "dataset": args.dataset, "seed": seed, "mode": mode,
                         "epsilon": epsilon, "final_accuracy": records[-1]["test_accuracy"],
                         "train_time": records[-1]["time"], **attacks, "load": round(load, 2),
                         "cpu": cpu_model()})
    return rows


def _attacks(out: Path, rank: int, seed: int) -> dict[str, float]:
    """The attacks of a curious passive party ``rank`` on its own transcript and its own trained network
    (read from its own folder, as the party itself could), with 1 % of the labels known."""
    from experiments.label_attacks import (
        Transcript,
        judge,
        model_completion,
        theta_direction,
        theta_norm,
        theta_projection,
    )
    from parties.checkpoint import complete_epochs, load_checkpoint
    from parties.loading import load_party, true_training_labels
    from parties.party_model import NetworkPart
    from parties.resume import load_run

    plan = load_run(out)  # resume on: nothing the run drew (scaling, randomized labels) is drawn again
    y = true_training_labels(plan, 0)  # under --label-privacy dp, load_party's y is the noisy draw
    rng = np.random.default_rng(seed)
    known_rows = rng.choice(y.size, size=max(20, y.size // 100), replace=False)
    transcript = Transcript.load(out / f"audit-{rank}.npz")
    direction = judge(theta_direction(transcript, y.size, (known_rows, y[known_rows])), y)
    projection = judge(theta_projection(transcript, y.size, (known_rows, y[known_rows])), y)
    norm = judge(theta_norm(transcript, y.size), y)
    party = load_party(plan, rank)
    part = NetworkPart(party)
    ckpt = load_checkpoint(plan.party_folder(rank), rank, party.block.n_cols, complete_epochs(out),
                           part.state_shapes())
    part.load_state(ckpt.network)
    completion = judge(model_completion(part.embed(party.block.to_csr()), known_rows, y[known_rows]), y)
    auc = lambda r: max(r["auc"], 1 - r["auc"])  # noqa: E731 - either way round, as the attacker may flip
    return {"direction_accuracy": direction["accuracy"], "direction_auc": auc(direction),
            "projection_auc": auc(projection),
            "norm_auc": auc(norm), "completion_auc": auc(completion), "coverage": direction["coverage"]}


def write(rows: list[dict], name: str) -> None:
    from experiments import _plotting

    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    if rows[0]["part"] == "privacy":
        _write_privacy(rows, name)
        return
    lines = ["| part | dataset | run | mode | test accuracy | training s | to target s | load | CPU |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        to_target = r.get("time_to_target")
        lines.append(f"| {r['part']} | {r['dataset']} | {r.get('repeat', r.get('seed'))} | {r['mode']} | "
                     f"{r['final_accuracy']:.4f} | {r['train_time']:.2f} | "
                     f"{'-' if to_target is None else f'{to_target:.2f}'} | {r['load']} | {r['cpu']} |")
    (OUT / f"{name}.md").write_text("\n".join(lines) + "\n")
    curves = [r for r in rows if "curve" in r]
    if curves:
        plt = _plotting.pyplot()
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in curves:
            t, a = zip(*r["curve"], strict=True)
            ax.plot(t, a, color=COLOURS[r["mode"]], alpha=0.8,
                    label=r["mode"] if r["repeat"] == 0 else None)
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("test accuracy")
        ax.set_title(f"{rows[0]['dataset']}: one party 3× slower")
        _plotting.figure_legend(fig)
        _plotting.save(fig, OUT / f"{name}.png")


def _write_privacy(rows: list[dict], name: str) -> None:
    from experiments import _plotting

    lines = ["| dataset | seed | mode | test accuracy | Δ vs plain (points) | direction: accuracy, AUC | "
             "projection AUC | norm AUC | model completion AUC | training s | load | CPU |",
             "|---" * 12 + "|"]
    plain = {r["seed"]: r["final_accuracy"] for r in rows if r["epsilon"] is None}
    for r in rows:
        lines.append(f"| {r['dataset']} | {r['seed']} | {r['mode']} | {r['final_accuracy']:.4f} | "
                     f"{100 * (r['final_accuracy'] - plain[r['seed']]):+.2f} | "
                     f"{100 * r['direction_accuracy']:.1f} %, {r['direction_auc']:.3f} | "
                     f"{r.get('projection_auc', float('nan')):.3f} | {r['norm_auc']:.3f} | "
                     f"{r['completion_auc']:.3f} | {r['train_time']:.1f} | {r['load']} | {r['cpu']} |")
    (OUT / f"{name}.md").write_text("\n".join(lines) + "\n")
    plt = _plotting.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    colours = {"direction_auc": "tab:red", "projection_auc": "tab:brown", "norm_auc": "tab:orange",
               "completion_auc": "tab:purple"}
    for key, colour in colours.items():
        ax.scatter([100 * r["final_accuracy"] for r in rows], [r[key] for r in rows], color=colour,
                   label=key.replace("_auc", "").replace("completion", "model completion"))
    for r in rows:
        label = r["mode"].replace("dp-theta ", "").replace("per-row ", "")
        ax.annotate(label, (100 * r["final_accuracy"], r["direction_auc"]), fontsize=7)
    ax.axhline(0.6, color="grey", linestyle=":")
    ax.set_xlabel("test accuracy (%)")
    ax.set_ylabel("attack AUC on a passive party")
    ax.set_title(f"{rows[0]['dataset']}: label attacks against accuracy")
    _plotting.figure_legend(fig)
    _plotting.save(fig, OUT / f"{name}.png")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("straggler", "accuracy", "privacy"), required=True)
    p.add_argument("--dataset", default="a9a")
    p.add_argument("-n", "--parties", type=int, default=4)
    p.add_argument("--epochs", type=float, default=2)
    p.add_argument("--eval-every", type=float, default=0.25)
    p.add_argument("-B", "--batch", type=int, default=64)
    p.add_argument("-P", "--inflight", type=int, default=4)
    p.add_argument("--slowdown", type=float, default=2.0)
    p.add_argument("--async-factor", type=float, default=2.0,
                   help="straggler: the asynchronous run trains this many times the epochs, to reach the "
                        "lock-step run's final accuracy")
    p.add_argument("--gamma", type=float, default=1e-3, help="Adam's step (the runtime's default)")
    p.add_argument("--bottom", default="*-64-16")
    p.add_argument("--top", default="*-*")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0,
                   help="privacy: seeds first-seed .. first-seed + seeds - 1 (more runs of a setting)")
    p.add_argument("--epsilons", type=float, nargs="+", default=[4.0, 8.0],
                   help="privacy: the label-DP budgets of the protected runs")
    p.add_argument("--theta-noise", choices=("fresh", "per-row"), default="fresh",
                   help="privacy: how the protected runs noise ϑ (vfl train --theta-noise)")
    p.add_argument("--mechanism", choices=("dp-theta", "dp"), default="dp-theta",
                   help="privacy: the protected runs' --label-privacy (dp: randomized response on labels)")
    p.add_argument("--correction", choices=("none", "forward"), default="none",
                   help="privacy, --mechanism dp: vfl train --label-noise-correction")
    p.add_argument("--gamma-decay", type=float, default=0.0,
                   help="privacy: Adam's step decays by whole epochs (vfl train --gamma-decay)")
    p.add_argument("--lam", type=float, default=1e-4,
                   help="privacy: every network's weight decay, plain and protected alike (vfl train --lam)")
    p.add_argument("--tag", default="",
                   help="appended to the output files' names, so that a variant keeps its own tables")
    args = p.parse_args(argv)
    if args.correction != "none" and args.mechanism != "dp":
        p.error("--correction corrects --mechanism dp's randomized labels: it needs --mechanism dp")
    if args.part in ("accuracy", "privacy"):
        if args.epochs != int(args.epochs):
            p.error(f"--part {args.part} trains whole epochs")
        args.epochs = int(args.epochs)
    with tempfile.TemporaryDirectory(prefix="vnn-runtime-") as tmp:
        rows = {"straggler": straggler, "accuracy": accuracy, "privacy": privacy}[args.part](args, Path(tmp))
    name = f"{args.part}-{args.dataset}" + ("-per-row" if args.part == "privacy" and
                                            args.theta_noise == "per-row" else "") + (
        f"-{args.tag}" if args.tag else "")
    write(rows, name)
    print((OUT / f"{name}.md").read_text())
