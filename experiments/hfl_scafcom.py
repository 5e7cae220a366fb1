"""SCAFCOM/SCALLION paper (Huang, Li & Li 2024), Figures 2-4 on Fashion-MNIST.

MNIST is not available on this machine (``/work/shared/data/MANIFEST.md``), so only the FMNIST halves of
the figures are reproduced. Setting (the paper's Section 6): MLP 784-256-128-10, N = 200 clients with 2
one-class shards each (400 shards), S = 20, K = 10, batch 32, float32, two-sided learning rates,
c_i^0 = 0.

- Fig 2: SCAFCOM (β = 0.2) vs Fed-EF with Top-0.01/0.05, against SCAFFOLD and FedAvg (full precision);
- Fig 3: SCALLION (α = 0.1) vs FedCOMGATE with 2/4-bit random dithering, against SCAFFOLD;
- Fig 4: SCAFCOM Top-0.01 for β ∈ {0.05, 0.1, 0.2, 0.5, 1}; SCALLION 2-bit for α ∈ {0.05, 0.1, 0.2, 1}.

Reductions (the paper: 9 × 9 learning-rate grid, 5 runs, T unstated), chosen to fit ~20 minutes of a
quiet 2-core machine and stated in every table caption: one seed; (η_l, η_g) tuned over
{0.03, 0.1, 0.3} × {1, 3} on a short horizon for one member of each family (FedAvg, SCAFFOLD,
SCAFCOM-Top-0.01, Fed-EF-Top-0.01, SCALLION-2-bit, FedCOMGATE-2-bit), selected by final test accuracy
(the paper's criterion), and reused by the family's other members; the final runs are shorter than the
paper's curves. Train loss is measured on a fixed 10k subsample of the training set.

A pair that wins the short search can still diverge late in a final run. Then the run is repeated with
the family's next-best pair among those that did not diverge in the search, and so on down the ranking;
the table shows the pair used *and* the diverged ones ("diverged first: ..."), the same in
``summary.csv``/``summary.json`` (``diverged_lr_choices``).

    python -m experiments hfl_scafcom [--quick] [--rounds 300] [--tune-rounds 50] [--out DIR] [--resume]

Outputs under ``--out`` (default ``experiments/results/hfl_scafcom``): ``metrics/<run>.{csv,jsonl}``
per run (a fallback run: ``metrics/<run>_l<η_l>_g<η_g>.*``), ``tuning.csv``, ``summary.csv``,
``summary.json``, ``fig2.png``, ``fig3.png``, ``fig4.png`` and ``results.md``. ``--resume`` reuses the
finished runs (tuning, first choices and fallbacks) whose learning rates and rounds match.

The helpers here (:class:`Setting`, :class:`RunSpec`, :class:`Experiment`, :func:`family_learning_rates`,
:func:`run_with_fallback`) are shared with ``experiments.hfl_isca``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.ticker import NullFormatter

from horizontal import (
    MLP,
    Algorithm,
    FederatedData,
    FederatedSimulation,
    FLConfig,
    MetricsLog,
    iid_partition,
    make_algorithm,
    shard_partition,
)
from protocols.compression import get_compressor
from vertical.datasets import Dataset, load

PAPER_MLP = (784, (256, 128), 10)   # MLP 784-256-128-10, d = 235,146
TRAIN_EVAL_ROWS = 10_000
FINAL_WINDOW = 3          # final accuracy = mean over the last evaluations (less noise than one point)
LR_LOCAL_GRID = (0.03, 0.1, 0.3)
LR_GLOBAL_GRID = (1.0, 3.0)

LearningRates = tuple[float, float]          # (η_l, η_g)


# --------------------------------------------------------------------------------- configuration

@dataclass(frozen=True)
class Setting:
    """The federation: N clients, S per round, K local steps, minibatch, split ("shards" or "iid")."""

    n_clients: int
    clients_per_round: int
    local_steps: int
    batch_size: int
    split: str
    seed: int = 0


@dataclass(frozen=True)
class RunSpec:
    """One curve: a registered algorithm with its options. ``compressor`` is ``(name, params)`` so the
    spec stays JSON-able; ``family`` names the tuned run whose learning rates it reuses."""

    key: str
    label: str
    algorithm: str
    family: str
    compressor: tuple[str, dict[str, Any]] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    lr_global_grid: tuple[float, ...] | None = None    # overrides the experiment's η_g grid when tuning

    def build(self) -> Algorithm[Any, Any]:
        options = dict(self.options)
        if self.compressor is not None:
            name, params = self.compressor
            options["compressor"] = get_compressor(name, **params)
        return make_algorithm(self.algorithm, **options)


@dataclass
class RunResult:
    """Per-round records of one run (evaluated rounds carry test accuracy) and whether it diverged."""

    spec: RunSpec
    lr_local: float
    lr_global: float
    records: list[dict[str, float]]
    diverged_at: int | None = None
    extra: dict[str, float] = field(default_factory=dict)
    diverged_choices: tuple[tuple[float, float, int], ...] = ()   # (η_l, η_g, round) tried before this run

    @property
    def diverged_choices_note(self) -> str:
        """The higher-ranked pairs that diverged before this run, e.g. ``(0.1, 1) at round 212``."""
        return "; ".join(f"({lr_local:g}, {lr_global:g}) at round {at}"
                         for lr_local, lr_global, at in self.diverged_choices)

    @property
    def lr_label(self) -> str:
        """``(η_l, η_g)`` of this run, followed by any pairs that diverged first (never hidden)."""
        label = f"({self.lr_local:g}, {self.lr_global:g})"
        return f"{label}; diverged first: {self.diverged_choices_note}" if self.diverged_choices else label

    @property
    def evaluations(self) -> list[dict[str, float]]:
        return [r for r in self.records if "test_accuracy" in r]

    @property
    def final_accuracy(self) -> float:
        evals = self.evaluations
        if self.diverged_at is not None or not evals:
            return math.nan
        return statistics.fmean(r["test_accuracy"] for r in evals[-FINAL_WINDOW:])

    @property
    def best_accuracy(self) -> float:
        return max((r["test_accuracy"] for r in self.evaluations), default=math.nan)

    @property
    def final_train_loss(self) -> float:
        evals = self.evaluations
        return math.nan if self.diverged_at is not None or not evals else evals[-1]["train_loss"]

    def reach(self, target: float) -> tuple[int, int] | None:
        """First evaluated round with test accuracy >= ``target`` and the uplink bits sent until then."""
        for r in self.evaluations:
            if r["test_accuracy"] >= target:
                return int(r["round"]), int(r["uplink_bits"])
        return None

    def summary(self, clients_per_round: int, dim: int, target: float | None = None) -> dict[str, Any]:
        """One row of the results tables (``dim``: model size, for the compression ratio vs 32-bit)."""
        last = self.records[-1] if self.records else {}
        rounds = int(last.get("round", 0))
        per_client_round = last.get("uplink_bits", 0) / max(rounds * clients_per_round, 1)
        out: dict[str, Any] = {
            "run": self.spec.key, "label": self.spec.label, "lr_local": self.lr_local,
            "lr_global": self.lr_global, "rounds": rounds,
            "final_test_accuracy": self.final_accuracy, "best_test_accuracy": self.best_accuracy,
            "final_train_loss": self.final_train_loss,
            "uplink_bits": int(last.get("uplink_bits", 0)),
            "uplink_bits_per_client_round": per_client_round,
            "compression_vs_32bit": 32 * dim / per_client_round if per_client_round else math.nan,
            "gradient_evaluations": int(last.get("gradient_evaluations", 0)),
            "median_round_seconds": statistics.median(r["round_seconds"] for r in self.records)
            if self.records else math.nan,
            "diverged_at": self.diverged_at, **self.extra,
        }
        if target is not None:
            hit = self.reach(target)
            out["rounds_to_target"] = None if hit is None else hit[0]
            out["uplink_bits_to_target"] = None if hit is None else hit[1]
        out["diverged_lr_choices"] = self.diverged_choices_note
        return out


# --------------------------------------------------------------------------------- the runner

@functools.cache
def fashion_mnist() -> Dataset:
    """Loaded once per process (the IDX files take seconds to read; the ISCA experiment needs two splits)."""
    return load("fashion-mnist")


class Experiment:
    """Data, model and bookkeeping for a set of runs in one :class:`Setting`."""

    def __init__(self, setting: Setting, out: Path, *, eval_every: int, resume: bool) -> None:
        self.setting = setting
        self.out = out
        self.eval_every = eval_every
        self.resume = resume
        ds = fashion_mnist()
        rng = np.random.default_rng(setting.seed)
        if setting.split == "shards":
            parts = shard_partition(ds.y_train, setting.n_clients, 2, rng)
        elif setting.split == "iid":
            parts = iid_partition(ds.y_train.size, setting.n_clients, rng)
        else:
            raise ValueError(f"split must be 'shards' or 'iid', got {setting.split!r}")
        self.data = FederatedData.from_partition(ds.X_train, ds.y_train, parts)
        self.test = (torch.as_tensor(ds.X_test), torch.as_tensor(ds.y_test))
        rows = np.sort(np.random.default_rng(setting.seed + 1).choice(ds.n_train, TRAIN_EVAL_ROWS,
                                                                      replace=False))
        self.train_eval = (torch.as_tensor(ds.X_train[rows]), torch.as_tensor(ds.y_train[rows]))
        self.model = MLP(*PAPER_MLP)

    def config(self, lr_local: float, lr_global: float) -> FLConfig:
        s = self.setting
        return FLConfig(s.n_clients, s.clients_per_round, s.local_steps, lr_local, lr_global)

    def run(self, spec: RunSpec, lr_local: float, lr_global: float, rounds: int, *, folder: str = "metrics",
            name: str | None = None) -> RunResult:
        """Train ``rounds`` rounds (or reload a finished run with ``resume``); a divergence is recorded,
        not raised, so a grid point or an unstable α shows up as 'diverged at round t'."""
        stem = self.out / folder / (name or spec.key)
        jsonl = _with_suffix(stem, ".jsonl")
        if self.resume and jsonl.exists():
            cached = _reload(jsonl, spec, lr_local, lr_global, rounds)
            if cached is not None:
                return cached
        sim = FederatedSimulation(spec.build(), self.model, self.data, self.config(lr_local, lr_global),
                                  batch_size=self.setting.batch_size, seed=self.setting.seed,
                                  test=self.test, train_eval=self.train_eval)
        header = {"run": spec.key, "lr_local": lr_local, "lr_global": lr_global, "rounds": rounds}
        records: list[dict[str, float]] = []
        diverged_at = None
        with MetricsLog(jsonl, _with_suffix(stem, ".csv"), extra={"run": spec.key}) as log:
            try:
                for t in range(rounds):
                    record = sim.step()
                    if (t + 1) % self.eval_every == 0 or t + 1 == rounds:
                        record |= sim.evaluate()
                    records.append(record)
                    log.write(record)
            except FloatingPointError:
                diverged_at = sim.round
        extra = _invariant_gap(sim)
        _with_suffix(stem, ".done.json").write_text(json.dumps({**header, "diverged_at": diverged_at,
                                                              **extra}) + "\n")
        return RunResult(spec, lr_local, lr_global, records, diverged_at, extra)

    def tune(self, spec: RunSpec, lr_locals: Sequence[float], lr_globals: Sequence[float], rounds: int
             ) -> tuple[list[LearningRates], list[dict[str, Any]]]:
        """Grid search on a short horizon. Returns the pairs that did not diverge, best final test accuracy
        first (the paper's criterion; the rest are fallbacks for a late divergence), and the table rows."""
        rows = []
        for lr_local in lr_locals:
            for lr_global in spec.lr_global_grid or lr_globals:
                result = self.run(spec, lr_local, lr_global, rounds, folder="tuning",
                                  name=f"{spec.key}_l{lr_local:g}_g{lr_global:g}")
                rows.append({"family": spec.key, "split": self.setting.split, "lr_local": lr_local,
                             "lr_global": lr_global, "rounds": rounds,
                             "final_test_accuracy": result.final_accuracy, "diverged_at": result.diverged_at})
                print(f"  tune {spec.key:24s} eta_l={lr_local:<5g} eta_g={lr_global:<4g} "
                      f"acc={result.final_accuracy:.4f}", flush=True)
        ranked = rank_learning_rates(rows)
        if not ranked:
            raise RuntimeError(f"every grid point diverged for {spec.key}")
        return ranked, rows


def rank_learning_rates(rows: Sequence[dict[str, Any]]) -> list[LearningRates]:
    """The tuning rows' pairs that did not diverge, best final test accuracy first (ties: grid order)."""
    finite = [r for r in rows if not math.isnan(r["final_test_accuracy"])]
    finite.sort(key=lambda r: -r["final_test_accuracy"])
    return [(r["lr_local"], r["lr_global"]) for r in finite]


def family_learning_rates(specs: Sequence[RunSpec], tuner: Experiment, tune_rounds: int,
                          untuned: Callable[[RunSpec], LearningRates]
                          ) -> tuple[dict[str, list[LearningRates]], list[dict[str, Any]]]:
    """Tune each family once, on its tuned member (the run whose key is the family name), and reuse the
    ranking for all its members: ``{family: [(η_l, η_g), ...] best first}`` and the tuning table rows.
    The grid is ``LR_LOCAL_GRID × LR_GLOBAL_GRID`` (a spec's ``lr_global_grid`` overrides the latter).
    With ``tune_rounds = 0`` there is no search: each family gets the single pair ``untuned(spec)``."""
    by_key = {spec.key: spec for spec in specs}
    candidates: dict[str, list[LearningRates]] = {}
    rows: list[dict[str, Any]] = []
    for spec in specs:
        if spec.family in candidates:
            continue
        if spec.family not in by_key:
            raise ValueError(f"family {spec.family!r} of {spec.key!r} is not one of the runs")
        tuned = by_key[spec.family]
        if tune_rounds > 0:
            ranked, family_rows = tuner.tune(tuned, LR_LOCAL_GRID, LR_GLOBAL_GRID, tune_rounds)
            candidates[spec.family] = ranked
            rows += family_rows
        else:
            candidates[spec.family] = [untuned(tuned)]
    return candidates, rows


def run_with_fallback(run: Callable[..., RunResult], spec: RunSpec, candidates: Sequence[LearningRates],
                      rounds: int) -> RunResult:
    """``run(spec, η_l, η_g, rounds, name=...)`` (an :meth:`Experiment.run`) at the best pair; while it
    diverges, again at the next pair of ``candidates``. The first choice keeps the run's own name (so
    ``--resume`` finds earlier results), a fallback is named ``<run>_l<η_l>_g<η_g>``. The returned result
    is the first that did not diverge (or the last one tried) and lists the pairs that diverged before it."""
    if not candidates:
        raise ValueError(f"no learning-rate pair to run {spec.key} with")
    diverged: list[tuple[float, float, int]] = []
    for attempt, (lr_local, lr_global) in enumerate(candidates):
        name = spec.key if attempt == 0 else f"{spec.key}_l{lr_local:g}_g{lr_global:g}"
        result = run(spec, lr_local, lr_global, rounds, name=name)
        if result.diverged_at is None or attempt == len(candidates) - 1:
            break
        diverged.append((lr_local, lr_global, result.diverged_at))
        print(f"  {spec.key} diverged at round {result.diverged_at} with eta=({lr_local:g}, {lr_global:g}); "
              f"falling back to eta={candidates[attempt + 1]}", flush=True)
    return dataclasses.replace(result, diverged_choices=tuple(diverged))


def _invariant_gap(sim: FederatedSimulation) -> dict[str, float]:
    """max |c − mean_i c_i| (or v − mean_i u_i): ~0 when the controls are kept consistent."""
    server, clients = sim.server.tensors(), sim.clients.tensors()
    for global_name, client_name in (("c", "c"), ("v", "u")):
        if global_name in server and client_name in clients:
            gap = (server[global_name] - clients[client_name].mean(dim=0)).abs().max()
            return {"control_invariant_gap": float(gap)}
    return {}


def _with_suffix(stem: Path, suffix: str) -> Path:
    """``stem`` + ``suffix`` (run names contain dots, e.g. ``beta0.2``, so ``Path.with_suffix`` won't do)."""
    return stem.parent / (stem.name + suffix)


def _reload(jsonl: Path, spec: RunSpec, lr_local: float, lr_global: float, rounds: int) -> RunResult | None:
    done = _with_suffix(jsonl.parent / jsonl.name.removesuffix(".jsonl"), ".done.json")
    if not done.exists():
        return None
    meta = json.loads(done.read_text())
    if (meta["lr_local"], meta["lr_global"], meta["rounds"]) != (lr_local, lr_global, rounds):
        return None
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    for r in records:
        r.pop("run", None)
    extra = {k: meta[k] for k in ("control_invariant_gap",) if k in meta}
    return RunResult(spec, lr_local, lr_global, records, meta["diverged_at"], extra)


# --------------------------------------------------------------------------------- reporting

def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def percent(value: float) -> str:
    return "diverged" if math.isnan(value) else f"{100 * value:.2f}"


def megabits(bits: float | None) -> str:
    return "not reached" if bits is None else f"{bits / 1e6:,.1f}"


#: the uncompressed baselines keep these colours in every figure; the other methods take the palette
BASELINE_COLOURS = {"SCAFFOLD (32-bit)": "black", "FedAvg (32-bit)": "tab:gray"}


def plot_runs(ax_rows: Any, results: Sequence[RunResult], title: str, colour: dict[str, str],
              legend: dict[str, str] | None = None) -> None:
    """Three panels: train loss vs rounds, test accuracy vs rounds, test accuracy vs uplink bits;
    ``colour``: label -> colour, the same on every panel of the figure; ``legend``: label -> the
    legend's text for it (default: the label)."""
    loss_ax, acc_ax, bits_ax = ax_rows
    for result in results:
        evals = result.evaluations
        rounds = [r["round"] for r in evals]
        accuracy = [100 * r["test_accuracy"] for r in evals]
        label = result.spec.label
        style = {"label": (legend or {}).get(label, label), "color": colour[label],
                 "linestyle": "--" if result.spec.compressor is None else "-"}
        loss_ax.plot(rounds, [r["train_loss"] for r in evals], **style)
        acc_ax.plot(rounds, accuracy, **style)
        bits_ax.plot([max(r["uplink_bits"], 1) for r in evals], accuracy, **style)
    loss_ax.set(title=f"{title}: train loss", xlabel="round", ylabel="train loss (log scale)", yscale="log")
    acc_ax.set(title=f"{title}: test accuracy", xlabel="round", ylabel="test accuracy (%)")
    bits_ax.set(title=f"{title}: accuracy vs uplink", xlabel="cumulative uplink bits (log scale)",
                ylabel="test accuracy (%)", xscale="log")
    bits_ax.xaxis.set_minor_formatter(NullFormatter())  # labelled minor ticks overlap on a short decade
    for ax in ax_rows:
        ax.grid(alpha=0.3)


def save_figure(path: Path, groups: Sequence[tuple[str, Sequence[RunResult]]]) -> None:
    """One row of panels per group; one colour per method across the whole figure, one legend."""
    from experiments._plotting import colours, figure_legend, save

    labels = [result.spec.label for _, results in groups for result in results]
    colour = colours(labels, fixed={k: v for k, v in BASELINE_COLOURS.items() if k in labels})
    fig, axes = plt.subplots(len(groups), 3, figsize=(15, 4 * len(groups) + 0.6), squeeze=False,
                             layout="constrained")
    legend = diverged_legend(groups)
    for row, (title, results) in zip(axes, groups, strict=True):
        plot_runs(row, results, title, colour, legend)
    figure_legend(fig)
    save(fig, path)


def diverged_legend(groups: Sequence[tuple[str, Sequence[RunResult]]]) -> dict[str, str]:
    """label -> legend text naming where the method diverged (one entry per method, even when it
    diverged in several rows, and even before its first evaluation, when there is no line to draw)."""
    rows_of = Counter(result.spec.label for _, results in groups for result in results)
    notes: dict[str, list[str]] = {}
    for title, results in groups:
        for result in results:
            if result.diverged_at is not None:
                where = f"{title.split(',')[0]} " if rows_of[result.spec.label] > 1 else ""
                late = "" if result.evaluations else ", before any evaluation"
                notes.setdefault(result.spec.label, []).append(f"{where}at round {result.diverged_at}{late}")
    return {label: f"{label} (diverged {'; '.join(found)})" for label, found in notes.items()}


def save_figures(out: Path, groups: dict[str, list[RunSpec]], results: dict[str, RunResult]) -> list[Path]:
    """fig2.png, fig3.png and fig4.png of the runs in ``results``."""
    def curves(name: str) -> list[RunResult]:
        return [results[s.key] for s in groups[name]]

    figures = {"fig2.png": [("Fig 2 (FMNIST)", curves("fig2"))],
               "fig3.png": [("Fig 3 (FMNIST)", curves("fig3"))],
               "fig4.png": [("Fig 4 SCAFCOM Top-0.01, β", curves("fig4_beta")),
                            ("Fig 4 SCALLION 2-bit, α", curves("fig4_alpha"))]}
    for name, panels in figures.items():
        save_figure(out / name, panels)
    return [out / name for name in figures]


def replot(out: Path) -> list[Path]:
    """Redraw fig2-4 from the committed ``summary.csv``/``summary.json`` and ``metrics/`` (no training):
    each run's curve is the metrics file of the (η_l, η_g) pair its summary row names."""
    import csv

    summary = json.loads((out / "summary.json").read_text())
    groups = runs(bool(summary["quick"]))
    specs = {spec.key: spec for group in groups.values() for spec in group}
    with open(out / "summary.csv", newline="", encoding="utf-8") as handle:
        rows = {row["run"]: row for row in csv.DictReader(handle)}
    results = {key: reload_run(out / "metrics", spec, rows[key], int(summary["rounds"]))
               for key, spec in specs.items()}
    return save_figures(out, groups, results)


def reload_run(metrics: Path, spec: RunSpec, row: dict[str, str], rounds: int) -> RunResult:
    """The finished run of ``spec`` in ``metrics/`` at the (η_l, η_g) its summary ``row`` names: under
    its own name, or under a fallback pair's name (:func:`run_with_fallback`)."""
    lr_local, lr_global = float(row["lr_local"]), float(row["lr_global"])
    stem = metrics / spec.key
    done = _with_suffix(stem, ".done.json")
    meta = json.loads(done.read_text()) if done.exists() else {}
    if (meta.get("lr_local"), meta.get("lr_global")) != (lr_local, lr_global):
        stem = metrics / f"{spec.key}_l{lr_local:g}_g{lr_global:g}"
    result = _reload(_with_suffix(stem, ".jsonl"), spec, lr_local, lr_global, rounds)
    if result is None:
        raise FileNotFoundError(f"{stem}.jsonl: no finished run of {spec.key} at "
                                f"({lr_local:g}, {lr_global:g})")
    return result


def machine_note() -> str:
    return (f"torch threads = {torch.get_num_threads()}, {os.cpu_count()} cores, 1-min load average "
            f"{os.getloadavg()[0]:.1f} at the end (the machine is shared)")


def command_note(experiment: str, args: argparse.Namespace, seconds: float) -> str:
    """The command that wrote a report and how long it took; with ``--resume`` the time covers only the
    runs this invocation trained, so the note says that finished runs were reused."""
    flags = "".join(flag for flag, on in ((" --quick", args.quick), (" --resume", args.resume)) if on)
    reused = ", reusing the finished runs of earlier invocations" if args.resume else ""
    return (f"Command: `python -m experiments {experiment}{flags} --rounds {args.rounds} "
            f"--tune-rounds {args.tune_rounds}` ({seconds / 60:.1f} min{reused}; {machine_note()}).")


def base_parser(description: str, default_out: str, rounds: int, tune_rounds: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true",
                        help="CI smoke tier: a few rounds, fixed learning rates, no tuning")
    parser.add_argument("--rounds", type=int, default=rounds, help="rounds of every final run")
    parser.add_argument("--tune-rounds", type=int, default=tune_rounds,
                        help="horizon of the learning-rate search (0: no search, use --lr-local/--lr-global)")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--lr-local", type=float, default=0.1, help="η_l when not tuning")
    parser.add_argument("--lr-global", type=float, default=1.0, help="η_g when not tuning")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--resume", action="store_true", help="reuse finished runs found under --out")
    parser.add_argument("--out", type=Path, default=Path(default_out))
    return parser


# --------------------------------------------------------------------------------- this experiment

SCAFFOLD_KEY = "scaffold"


def exp_dim() -> int:
    """d of the papers' MLP (235,146)."""
    return MLP(*PAPER_MLP).dim


def top(r: float) -> tuple[str, dict[str, Any]]:
    return ("top-r", {"r": r})


def dither(bits: int) -> tuple[str, dict[str, Any]]:
    return ("dithering", {"bits": bits})


def runs(quick: bool) -> dict[str, list[RunSpec]]:
    """The figure groups; in each, the first member of a family is the one tuned."""
    fedavg = RunSpec("fedavg", "FedAvg (32-bit)", "fedavg", "fedavg")
    scaffold = RunSpec(SCAFFOLD_KEY, "SCAFFOLD (32-bit)", "scaffold", SCAFFOLD_KEY)

    def scafcom(r: float, beta: float) -> RunSpec:
        return RunSpec(f"scafcom-top{r:g}-beta{beta:g}", f"SCAFCOM Top-{r:g} β={beta:g}", "scafcom",
                       "scafcom-top0.01-beta0.2", top(r), {"beta": beta})

    def fed_ef(r: float) -> RunSpec:
        return RunSpec(f"fed-ef-top{r:g}", f"Fed-EF Top-{r:g}", "fed-ef", "fed-ef-top0.01", top(r))

    def scallion(bits: int, alpha: float) -> RunSpec:
        return RunSpec(f"scallion-{bits}bit-alpha{alpha:g}", f"SCALLION {bits}-bit α={alpha:g}", "scallion",
                       "scallion-2bit-alpha0.1", dither(bits), {"alpha": alpha})

    def fedcomgate(bits: int) -> RunSpec:
        return RunSpec(f"fedcomgate-{bits}bit", f"FedCOMGATE {bits}-bit", "fedcomgate", "fedcomgate-2bit",
                       dither(bits))

    if quick:
        return {"fig2": [scaffold, fedavg, scafcom(0.01, 0.2), fed_ef(0.01)],
                "fig3": [scaffold, scallion(2, 0.1), fedcomgate(2)],
                "fig4_beta": [scafcom(0.01, 0.2)], "fig4_alpha": [scallion(2, 0.1)]}
    return {
        "fig2": [scaffold, fedavg, scafcom(0.01, 0.2), scafcom(0.05, 0.2), fed_ef(0.01), fed_ef(0.05)],
        "fig3": [scaffold, scallion(2, 0.1), scallion(4, 0.1), fedcomgate(2), fedcomgate(4)],
        "fig4_beta": [scafcom(0.01, beta) for beta in (0.05, 0.1, 0.2, 0.5, 1.0)],
        "fig4_alpha": [scallion(2, alpha) for alpha in (0.05, 0.1, 0.2, 1.0)],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0], "experiments/results/hfl_scafcom",
                         rounds=300, tune_rounds=50)
    parser.add_argument("--replot", action="store_true",
                        help="only redraw fig2-4 from summary.csv and metrics/ in --out (no training)")
    args = parser.parse_args(argv)
    if args.replot:
        print(f"redrew {', '.join(map(str, replot(args.out)))}")
        return 0
    if args.quick:
        args.rounds, args.tune_rounds, args.eval_every = 10, 0, 5
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    setting = Setting(200, 20, 10, 32, "shards", args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    exp = Experiment(setting, args.out, eval_every=args.eval_every, resume=args.resume)
    groups = runs(args.quick)
    specs = {spec.key: spec for group in groups.values() for spec in group}
    print(f"SCAFCOM/SCALLION Figs 2-4 on Fashion-MNIST: {setting}; {len(specs)} runs x {args.rounds} rounds, "
          f"tuning {args.tune_rounds} rounds", flush=True)

    candidates, tuning_rows = family_learning_rates(list(specs.values()), exp, args.tune_rounds,
                                                    lambda spec: (args.lr_local, args.lr_global))
    results: dict[str, RunResult] = {}
    for key, spec in specs.items():
        results[key] = r = run_with_fallback(exp.run, spec, candidates[spec.family], args.rounds)
        print(f"  {key:28s} eta={r.lr_label} acc={r.final_accuracy:.4f} "
              f"uplink={r.records[-1]['uplink_bits'] / 8e6 if r.records else 0:.1f} MB", flush=True)

    report = write_report(args, setting, groups, results, tuning_rows, time.perf_counter() - started)
    print(f"\n{report['headline']}\nwrote {args.out}/")
    return 0


def write_report(args: argparse.Namespace, setting: Setting, groups: dict[str, list[RunSpec]],
                 results: dict[str, RunResult], tuning_rows: list[dict[str, Any]], seconds: float
                 ) -> dict[str, Any]:
    out = args.out
    scaffold = results[SCAFFOLD_KEY]
    target = scaffold.final_accuracy - 0.01
    summaries = {key: r.summary(setting.clients_per_round, exp_dim(), target) for key, r in results.items()}
    write_csv(out / "summary.csv", list(summaries.values()))
    if tuning_rows:
        write_csv(out / "tuning.csv", tuning_rows)

    scafcom = results[next(s.key for s in groups["fig2"] if s.algorithm == "scafcom")]
    gap = scaffold.final_accuracy - scafcom.final_accuracy
    ratio = scaffold.records[-1]["uplink_bits"] / scafcom.records[-1]["uplink_bits"]
    holds = abs(gap) <= 0.01 + 1e-12 and 20 <= ratio <= 100 * 1.5
    headline = (f"Headline (SCAFCOM Top-0.01 within ~1 point of SCAFFOLD at 20-100x fewer uplink bits): "
                f"SCAFFOLD {percent(scaffold.final_accuracy)}% vs {scafcom.spec.label} "
                f"{percent(scafcom.final_accuracy)}% (gap {100 * gap:+.2f} points) with {ratio:.1f}x fewer "
                f"uplink bits at equal rounds -> {'holds' if holds else 'does NOT hold'} at this scale.")
    summary = {"setting": asdict(setting), "rounds": args.rounds, "tune_rounds": args.tune_rounds,
               "quick": args.quick, "target_accuracy": target, "headline": headline,
               "headline_holds": holds, "accuracy_gap_scaffold_minus_scafcom": gap,
               "uplink_ratio_scaffold_over_scafcom": ratio, "runs": summaries,
               "seconds_total": seconds, "machine": machine_note()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")

    save_figures(out, groups, results)
    (out / "results.md").write_text(_markdown(args, setting, groups, results, summaries, target, headline,
                                              tuning_rows, seconds))
    return summary


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    import csv

    keys = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def _markdown(args: argparse.Namespace, setting: Setting, groups: dict[str, list[RunSpec]],
              results: dict[str, RunResult], summaries: dict[str, dict[str, Any]], target: float,
              headline: str, tuning_rows: list[dict[str, Any]], seconds: float) -> str:
    tuned = (f"(η_l, η_g) tuned over {{{', '.join(map(str, LR_LOCAL_GRID))}}} × "
             f"{{{', '.join(map(str, LR_GLOBAL_GRID))}}} for {args.tune_rounds} rounds on one member per "
             "family (paper: 9 × 9 grid)" if args.tune_rounds else
             f"fixed (η_l, η_g) = ({args.lr_local}, {args.lr_global}), not tuned")
    caption = (f"Fashion-MNIST only (MNIST absent). N = {setting.n_clients}, 2 one-class shards/client, "
               f"S = {setting.clients_per_round}, K = {setting.local_steps}, batch {setting.batch_size}. "
               f"REDUCED: {args.rounds} rounds, 1 seed (paper: 5), {tuned}. Final accuracy = mean of the "
               f"last {FINAL_WINDOW} evaluations (every {args.eval_every} rounds). Target = SCAFFOLD's final "
               f"accuracy − 1 point = {percent(target)}%. A final run that diverges is rerun at its family's "
               "next-best pair that did not diverge in the search; the pairs that diverged are named.")

    def table(keys: Sequence[str]) -> str:
        rows = []
        for key in keys:
            s = summaries[key]
            reached = s["rounds_to_target"]
            rows.append([s["label"], results[key].lr_label,
                         percent(s["final_test_accuracy"]), f"{s['final_train_loss']:.3f}",
                         f"{s['uplink_bits_per_client_round'] / 1e3:,.1f}",
                         f"{s['compression_vs_32bit']:.1f}x",
                         "not reached" if reached is None else reached, megabits(s["uplink_bits_to_target"])])
        return markdown_table(["method", "(η_l, η_g)", "test acc %", "train loss", "uplink kbit/client/round",
                               "compression vs 32-bit", "rounds to target", "uplink Mbit to target"], rows)

    def keys(*names: str) -> list[str]:
        return list(dict.fromkeys(s.key for name in names for s in groups[name]))

    parts = [
        "## SCAFCOM / SCALLION paper, Figs 2-4 (Fashion-MNIST)", "",
        command_note("hfl_scafcom", args, seconds), "",
        f"**{headline}**", "", f"_{caption}_", "",
        "### Fig 2: biased compression (Top-r), SCAFCOM β = 0.2 vs Fed-EF", "", table(keys("fig2")), "",
        "![Fig 2](fig2.png)", "",
        "### Fig 3: unbiased compression (random dithering), SCALLION α = 0.1 vs FedCOMGATE", "",
        table(keys("fig3")), "", "![Fig 3](fig3.png)", "",
        "### Fig 4: SCAFCOM Top-0.01 over β; SCALLION 2-bit over α", "",
        table(keys("fig4_beta", "fig4_alpha")), "", "![Fig 4](fig4.png)", "",
    ]
    diverged = [f"{s['label']} (round {s['diverged_at']})" for s in summaries.values() if s["diverged_at"]]
    if diverged:
        parts += [f"Diverged: {', '.join(diverged)}.", ""]
    if tuning_rows:
        parts += ["Learning-rate search (final test accuracy after the tuning horizon):", "",
                  markdown_table(["family", "η_l", "η_g", "test acc %"],
                                 [[r["family"], r["lr_local"], r["lr_global"],
                                   percent(r["final_test_accuracy"])] for r in tuning_rows]), ""]
    return "\n".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
