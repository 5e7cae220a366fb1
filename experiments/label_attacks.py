"""Label inference by a curious passive party, from what it received (its ``--audit`` transcript).

The attacks a passive party can run on its own transcript with no help (usable as a library):

* ``theta_sign``: every dispatched (ϑ, i) has ϑ = ∂L/∂z; for the logistic loss ϑ = −y·σ(−y z), so
  sign(ϑ) = −y on every row it received.
* ``full_theta``: the full pass at w = 0 (first SVRG snapshot, SAGA start) broadcasts ϑ₀ = −y/2 for
  every training row.
* ``batch_gradient`` (``--label-privacy he``, needs the party's own block X_l): each batch gives the
  party g = X_Bᵀϑ_B; the minimum-norm ϑ̂_B = (X_Bᵀ)⁺g is the part of ϑ_B its own features span.
* ``full_gradient`` (``--label-privacy he`` with SVRG, needs X_l): the first snapshot gives the party
  X_lᵀϑ_0 over all n rows (n μ_l, at w = 0 where ϑ_0 = −y/2); the same minimum-norm inversion.
* ``theta_norm`` (Li et al., "Label Leakage and Protection in Two-party Split Learning", ICLR 2022):
  the norm of each row's ϑ, k-wide or scalar. The rows a model fits worst have the largest gradients,
  and on unbalanced data those are mostly the minority class; judged by AUC, either way round.
* ``theta_direction`` (the same paper's cosine attack): within a batch, the ϑ's of the two classes of
  a binary task point along opposite directions (exactly, for a linear top), so each row is scored by
  the cosine of its ϑ with the batch's leading direction, oriented by the few rows whose labels the
  attacker knows (``known``), else from one batch to the next.
* ``theta_projection``: the same without the cosine's division by ‖ϑ‖, each row's mean projection on
  the batch direction. Against fresh noise it is the stronger of the two: the cosine of a one-logit ϑ
  is only its sign, so a row's passes vote, where the projections' mean averages the noise away.
* ``model_completion`` (Fu et al., USENIX Security 2022): the party fits a head on its own bottom's
  embeddings of a few labelled rows and predicts the rest; compare it with the same head on its raw
  features, which it could fit without the federation.

The network attacks read k-wide messages (``vertical/nn/messages.py``); a simulated run's dispatched
messages become an audit file of the runtime's format with :func:`write_simulated_audit`.

Each attack gives a score per training row (higher = more likely +1; NaN where it saw nothing) and is
judged by accuracy and ROC AUC on the rows it covers, and by its coverage. A protected mode must bring
every attack to chance; plain VFB² does not claim that, and ``tests/test_label_attacks.py`` shows it.

``python -m experiments label_attacks`` runs plain VFB² jobs with ``--audit`` and tabulates the attacks
per passive party.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments._machine import cpu_model
from parties.runtime import (
    AUDIT_FULL_THETA,
    AUDIT_HE_FULL_GRADIENT,
    AUDIT_HE_GRADIENT,
    TAG_HE_BATCH,
    TAG_THETA,
    TAG_THETA_REQUEST,
)
from protocols.dispatch import split_piggyback

OUT = Path(__file__).resolve().parent / "results" / "label_attacks"


@dataclass
class Transcript:
    """What one party received: per message, its source, tag (or ``AUDIT_*`` label) and words."""

    sources: np.ndarray
    tags: np.ndarray
    messages: list[np.ndarray]

    @classmethod
    def load(cls, path: str | Path) -> Transcript:
        with np.load(path) as z:
            bounds = np.concatenate([[0], np.cumsum(z["lengths"])])
            words = z["words"]
            return cls(z["sources"], z["tags"], [words[a:b] for a, b in itertools.pairwise(bounds)])

    def of_tag(self, tag: int) -> list[np.ndarray]:
        return [m for m, t in zip(self.messages, self.tags, strict=True) if t == tag]

    def theta_messages(self) -> list[np.ndarray]:
        """Every (ϑ, i) message as float64 words, sent alone or inside a request (``--piggyback``)."""
        return [words.view(np.float64) if tag == TAG_THETA else split_piggyback(int(source), words)[0]
                for words, tag, source in zip(self.messages, self.tags, self.sources, strict=True)
                if tag in (TAG_THETA, TAG_THETA_REQUEST)]

    def from_source(self, tag: int, source: int) -> list[np.ndarray]:
        return [m for m, t, s in zip(self.messages, self.tags, self.sources, strict=True)
                if t == tag and s == source]


def theta_batches(t: Transcript) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(rows, ϑ (B, k))`` of every (ϑ, i) message, k read from its length (1 for the linear models)."""
    from vertical.nn.messages import unpack

    return [unpack(buf)[1:] for buf in t.theta_messages()]


def _mean_per_row(n_rows: int, pieces) -> np.ndarray:
    """Per row, the mean of the values ``pieces`` (pairs of rows and values) give it; NaN for none."""
    total, count = np.zeros(n_rows), np.zeros(n_rows)
    for rows, values in pieces:
        np.add.at(total, rows, values)
        np.add.at(count, rows, 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / count, np.nan)


def theta_sign(t: Transcript, n_rows: int) -> np.ndarray:
    """Score −mean(ϑ) of each row from the dispatched scalar (ϑ, i) pairs (``[seq, B, rows, ϑs]``)."""
    return -_mean_per_row(n_rows, ((rows, theta[:, 0]) for rows, theta in theta_batches(t)
                                   if theta.shape[1] == 1))


def theta_norm(t: Transcript, n_rows: int) -> np.ndarray:
    """Score the mean ‖ϑ‖ of each row, less the median over the rows seen (so that the accuracy of
    :func:`judge` splits at the median; the AUC does not depend on it)."""
    scores = _mean_per_row(n_rows, ((rows, np.linalg.norm(theta, axis=1))
                                    for rows, theta in theta_batches(t)))
    return scores - np.nanmedian(scores) if np.isfinite(scores).any() else scores


def two_means_split(values: np.ndarray) -> float:
    """The threshold that splits ``values`` into the two groups of least total squared deviation
    (1-D 2-means, exact): where an attacker with no labels cuts a two-class score."""
    v = np.sort(values[np.isfinite(values)])
    if v.size < 2:
        return 0.0
    prefix, prefix_sq = np.cumsum(v), np.cumsum(v * v)
    left = np.arange(1, v.size)
    right = v.size - left
    cost = (prefix_sq[:-1] - prefix[:-1] ** 2 / left) + (
        prefix_sq[-1] - prefix_sq[:-1] - (prefix[-1] - prefix[:-1]) ** 2 / right)
    cut = int(np.argmin(cost))
    return float((v[cut] + v[cut + 1]) / 2)


def theta_direction(t: Transcript, n_rows: int, known: tuple[np.ndarray, np.ndarray] | None = None
                    ) -> np.ndarray:
    """Score the mean cosine of each row's ϑ with its batch's leading direction (the top right-singular
    vector of ϑ_B), each batch's direction turned to agree with the previous batch's. One sign for the
    whole transcript then comes from the rows whose ±1 labels the attacker knows (``known``: rows and
    labels), or without any, from the length heuristic of :func:`theta_norm` (the side whose ϑ's are
    longer is +1, the minority class). Scores are centred at their :func:`two_means_split`: with a
    nonlinear top the two classes' cosines need not straddle 0, though they separate."""
    return _along_the_direction(t, n_rows, known, cosine=True)


def theta_projection(t: Transcript, n_rows: int, known: tuple[np.ndarray, np.ndarray] | None = None
                     ) -> np.ndarray:
    """:func:`theta_direction` without the division by ‖ϑ‖: each row's mean projection on its batches'
    leading direction. Against fresh Gaussian noise this is the stronger attack: a cosine keeps only
    the sign of a one-logit ϑ, so a row's passes vote, while the mean of the projections averages the
    noise away as the accountant assumes an attacker would (with one logit it is −mean(ϑ), the
    sufficient statistic of a row's releases if its ϑ stayed put)."""
    return _along_the_direction(t, n_rows, known, cosine=False)


def _along_the_direction(t: Transcript, n_rows: int, known, cosine: bool) -> np.ndarray:
    previous, pieces, norms = None, [], []
    for rows, theta in theta_batches(t):
        direction = np.linalg.svd(theta, full_matrices=False)[2][0]
        if previous is not None and direction @ previous < 0:
            direction = -direction
        previous = direction
        length = np.linalg.norm(theta, axis=1)
        if cosine:
            with np.errstate(invalid="ignore", divide="ignore"):
                pieces.append((rows, np.where(length > 0, theta @ direction / length, 0.0)))
        else:
            pieces.append((rows, theta @ direction))
        norms.append((rows, length))
    scores = _mean_per_row(n_rows, pieces)
    if not np.isfinite(scores).any():
        return scores
    scores -= two_means_split(scores)
    if known is not None:
        rows, labels = np.asarray(known[0], dtype=np.int64), np.asarray(known[1], dtype=np.float64)
        seen = scores[rows]
        positive, negative = seen[(labels > 0) & np.isfinite(seen)], seen[(labels < 0) & np.isfinite(seen)]
        if positive.size and negative.size:   # class means, so that the majority does not outvote
            flip = positive.mean() < negative.mean()
        else:
            flip = float(labels[np.isfinite(seen)] @ seen[np.isfinite(seen)]) < 0
    else:
        length = _mean_per_row(n_rows, norms)
        flip = np.nanmean(length[scores >= 0]) < np.nanmean(length[scores < 0])
    return -scores if flip else scores


def model_completion(features, known_rows: np.ndarray, known_labels: np.ndarray) -> np.ndarray:
    """Fit a logistic head on ``features`` (a passive party's embeddings of its rows, or its raw
    columns) of the known rows; returns its scores for every row (binary: the decision function,
    higher = the larger label; more classes: the predicted label)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    features = features.toarray() if hasattr(features, "toarray") else np.asarray(features)
    head = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    head.fit(features[known_rows], known_labels)
    if len(np.unique(known_labels)) == 2:
        return head.decision_function(features)
    return head.predict(features)


def write_simulated_audit(path: str | Path, dispatched: list[np.ndarray], *, rank: int,
                          source: int = 0) -> Path:
    """Write what a passive party ``rank`` received in a simulated run (``vertical.nn.simulate``'s
    ``dispatched`` messages, all from the dominator ``source``) as an ``--audit`` transcript of the
    runtime's format (``parties/audit.py``), so that every attack here reads it as it reads a real one.
    Counters the simulation has no equivalent of are zero."""
    from parties.audit import AuditLog

    log = AuditLog(rank, enabled=True)
    for words in dispatched:
        log.record(source, TAG_THETA, words)
    log.save(path, sent=0, applied=np.zeros(1, dtype=np.int64), max_unacked=0)
    return Path(path)


def full_theta(t: Transcript, n_rows: int) -> np.ndarray:
    """Score −ϑ₀ from the first full ϑ vector this party received (NaN if none)."""
    vectors = [m.view(np.float64) for m in t.of_tag(AUDIT_FULL_THETA)]
    return -vectors[0] if vectors and vectors[0].size == n_rows else np.full(n_rows, np.nan)


def batch_gradient(t: Transcript, n_rows: int, X=None) -> np.ndarray:
    """Score −mean ϑ̂ of each row, ϑ̂_B = (X_Bᵀ)⁺ g the minimum-norm solution of each batch's gradient
    (the rows from the encrypted batch, the gradient from what the party decoded, paired in order)."""
    total, count = np.zeros(n_rows), np.zeros(n_rows)
    if X is None:
        return np.full(n_rows, np.nan)
    X = X.tocsr() if hasattr(X, "tocsr") else np.asarray(X)
    for source in np.unique(t.sources):
        batches = t.from_source(TAG_HE_BATCH, int(source))
        gradients = t.from_source(AUDIT_HE_GRADIENT, int(source))
        for words, grad in zip(batches, gradients, strict=False):
            b = int(words[1])
            rows = words[3:3 + b].astype(np.int64)
            block = X[rows]
            block = block.toarray() if hasattr(block, "toarray") else block
            theta = np.linalg.lstsq(block.T, grad.view(np.float64), rcond=None)[0]
            np.add.at(total, rows, theta)
            np.add.at(count, rows, 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, -total / count, np.nan)


def full_gradient(t: Transcript, n_rows: int, X=None) -> np.ndarray:
    """Score −ϑ̂_0, ϑ̂_0 = (X_lᵀ)⁺g the minimum-norm solution of the first snapshot's X_lᵀϑ_0 (NaN if none)."""
    gradients = t.of_tag(AUDIT_HE_FULL_GRADIENT)
    if X is None or not gradients:
        return np.full(n_rows, np.nan)
    dense = X.toarray() if hasattr(X, "toarray") else np.asarray(X)
    return -np.linalg.lstsq(dense.T, gradients[0].view(np.float64), rcond=None)[0]


ATTACKS = {"theta_sign": theta_sign, "full_theta": full_theta, "batch_gradient": batch_gradient,
           "full_gradient": full_gradient, "theta_norm": theta_norm, "theta_direction": theta_direction,
           "theta_projection": theta_projection}
#: The attacks oriented by the few labels the attacker knows.
ORIENTED = ("theta_direction", "theta_projection")
#: The attacks that need the party's own training block X_l.
NEEDS_FEATURES = ("batch_gradient", "full_gradient")


def judge(scores: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Accuracy and ROC AUC on the rows the attack covers, and the coverage (labels in {−1, +1})."""
    from sklearn.metrics import roc_auc_score

    seen = ~np.isnan(scores)
    result = {"coverage": float(seen.mean()), "accuracy": float("nan"), "auc": float("nan"),
              "majority": float(max(np.mean(y == 1), np.mean(y == -1)))}
    if seen.any():
        guess = np.where(scores[seen] >= 0, 1.0, -1.0)
        result["accuracy"] = float(np.mean(guess == y[seen]))
        if len(np.unique(y[seen])) == 2:
            result["auc"] = float(roc_auc_score(y[seen], scores[seen]))
    return result


def attack_all(transcript_path: str | Path, y: np.ndarray, X=None, known: tuple | None = None
               ) -> dict[str, dict[str, float]]:
    """Every attack on one party's transcript; those that need the party's own training block
    (:data:`NEEDS_FEATURES`) only when ``X`` is given; ``known`` (rows, ±1 labels) orients
    :data:`ORIENTED`."""
    t = Transcript.load(transcript_path)
    found = {name: judge(attack(t, y.size, known) if name in ORIENTED else attack(t, y.size), y)
             for name, attack in ATTACKS.items() if name not in NEEDS_FEATURES}
    if X is not None:
        found.update({name: judge(ATTACKS[name](t, y.size, X), y) for name in NEEDS_FEATURES})
    return found


#: The HE row runs SGD (the mode FATE runs; SVRG works too) on mini-batches of 256 (above every passive
#: block of a9a / credit-card at q = 4) with the step a batch mean allows.
#: plain and dp keep the constant γ = 0.05 the published results were run with (the default is now
#: derived from the data, parties.step)
MODES = {"plain": {"gamma": 0.05}, "dp-16": {"label_privacy": "dp", "epsilon": 16.0, "gamma": 0.05},
         "dp-4": {"label_privacy": "dp", "epsilon": 4.0, "gamma": 0.05},
         "dp-1": {"label_privacy": "dp", "epsilon": 1.0, "gamma": 0.05},
         "he": {"label_privacy": "he", "algorithm": "sgd", "batch_size": 256, "gamma": 0.5},
         "he-svrg": {"label_privacy": "he", "algorithm": "svrg", "batch_size": 256, "gamma": 0.5},
         **{f"he-eps-{e:g}": {"label_privacy": "he", "algorithm": "sgd", "batch_size": 256, "gamma": 0.5,
                              "epsilon": e} for e in (16.0, 4.0, 1.0)}}
COLOURS = {"plain": "tab:red", "dp-16": "tab:orange", "dp-4": "tab:green", "dp-1": "tab:blue",
           "he": "tab:purple", "he-svrg": "tab:brown", "he-eps-16": "tab:pink", "he-eps-4": "tab:olive",
           "he-eps-1": "tab:cyan"}


def main(argv: list[str] | None = None) -> None:
    import tempfile

    from parties.config import RunConfig
    from parties.launch import launch
    from vertical.datasets import load
    from vertical.datasets.party_files import find_party_file, load_party_file
    from vertical.problems import get_problem
    from vertical.reference import evaluate, solve_reference

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", default=["credit-card", "a9a"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--algorithm", default="svrg")
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--he-gamma", type=float, default=None,
                   help="γ of the he modes (default 0.5; their step follows a mean over B = 256 rows)")
    p.add_argument("--he-batch-size", type=int, default=None,
                   help="B of the he modes (default 256); with --epsilon a larger B averages the noise "
                        "over more rows")
    p.add_argument("--he-gamma-decay", type=float, default=0.0,
                   help="the he modes' step γ/(1 + decay·e) in epoch e (default 0: constant)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    rows = []
    for dataset in args.datasets:
        try:
            ds = load(dataset, seed=0)
        except FileNotFoundError as err:
            print(f"[label_attacks] {dataset}: {err.__class__.__name__}; skipped")
            continue
        problem = get_problem("logistic", lam=1e-4)
        nonf = evaluate(problem, solve_reference(problem, ds.X_train, ds.y_train).w, ds.X_test, ds.y_test)
        for mode in args.modes:
            # the run's folder (checkpoints, the audit transcripts) is not a result: gone after the attack
            with tempfile.TemporaryDirectory(prefix="vfl-attack-") as tmp:
                work = Path(tmp)
                # the recorded results' step and features: the paper's γ = 0.05, the data as loaded
                config = RunConfig(**{"parties": 4, "active": 1, "dataset": dataset, "gamma": 0.05,
                                      "standardize": "off",
                                      "algorithm": args.algorithm, "epochs": args.epochs, "audit": True,
                                      "out": str(work), "progress": False, **MODES[mode],
                                      **({"gamma": args.he_gamma} if args.he_gamma and mode.startswith("he")
                                         else {}),
                                      **({"batch_size": args.he_batch_size}
                                         if args.he_batch_size and mode.startswith("he") else {}),
                                      **({"gamma_decay": args.he_gamma_decay}
                                         if args.he_gamma_decay and mode.startswith("he") else {})})
                if launch(config, echo=False) != 0:
                    raise RuntimeError(f"{dataset}/{mode}: training failed")
                last = json.loads((work / "metrics.jsonl").read_text().splitlines()[-1])
                own = load_party_file(find_party_file(work / "parties", 1), expect_labels=False).X_train
                found = attack_all(work / "audit-1.npz", ds.y_train, own)
            best = max(found, key=lambda a: found[a]["accuracy"] if found[a]["coverage"] else -1)
            rows.append({"dataset": dataset, "mode": mode, "algorithm": config.algorithm, "party": 1,
                         "gamma": config.gamma, "gamma_decay": config.gamma_decay,
                         "test_accuracy": last["test_accuracy"], "nonf_accuracy": nonf["accuracy"],
                         "seconds_per_epoch": last["time"] / max(last["epoch"], 1e-9),
                         "best_attack": best,
                         **{f"{a}_{k}": v for a, r in found.items() for k, v in r.items()}})
            print(f"[label_attacks] {dataset} {mode}: test {last['test_accuracy']:.4f} (NonF "
                  f"{nonf['accuracy']:.4f}), best attack {best} {found[best]['accuracy']:.3f}", flush=True)
    if not rows:
        raise SystemExit("[label_attacks] no data set could be loaded: nothing to write")
    write(rows, args.out)


def write(rows: list[dict], out: Path, load: tuple | None = None, cpu: str | None = None) -> None:
    """Results as JSON/CSV/Markdown and the privacy–utility plot; ``load``/``cpu`` default to now,
    passed when re-rendering a finished run from its results.json."""
    import csv

    from experiments._plotting import figure_legend, pyplot, save

    plt = pyplot()

    out.mkdir(parents=True, exist_ok=True)
    header = {"load": load or os.getloadavg(), "cpu": cpu or cpu_model()}
    (out / "results.json").write_text(json.dumps({**header, "rows": rows}, indent=1))
    with open(out / "results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| dataset | mode | test accuracy | NonF | best attack | its accuracy (rows seen) | its AUC "
             "| majority class | s/epoch |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["best_attack"]
        auc = r.get(b + "_auc", float("nan"))
        lines.append(f"| {r['dataset']} | {r['mode']} | {100 * r['test_accuracy']:.2f} % | "
                     f"{100 * r['nonf_accuracy']:.2f} % | {b} | {100 * r[b + '_accuracy']:.1f} % "
                     f"({100 * r[b + '_coverage']:.0f} %) | {auc:.2f} | {100 * r[b + '_majority']:.1f} % | "
                     f"{r['seconds_per_epoch']:.2f} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    datasets = sorted({r["dataset"] for r in rows})
    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4.4), squeeze=False,
                             layout="constrained")
    for ax, dataset in zip(axes[0], datasets, strict=True):
        for r in (r for r in rows if r["dataset"] == dataset):
            b = r["best_attack"]
            plain = r["mode"] == "plain"  # a ring, so a DP point on the same spot does not hide it
            ax.scatter(100 * r[b + "_accuracy"], 100 * r["test_accuracy"], s=160 if plain else 60,
                       facecolors="none" if plain else COLOURS[r["mode"]], edgecolors=COLOURS[r["mode"]],
                       linewidths=2 if plain else 1, label=r["mode"], zorder=3 if plain else 2)
        majority = next(r for r in rows if r["dataset"] == dataset)["full_theta_majority"]
        ax.axvline(100 * majority, color="grey", ls=":", lw=1, label="majority class (chance)")
        ax.set_title(dataset)
        ax.set_xlabel("best label attack by a passive party: accuracy (%)")
        ax.set_ylabel("test accuracy of the model (%)")
    figure_legend(fig, ncol=3 if len(datasets) == 1 else None)  # a one-panel figure is narrow
    save(fig, out / "privacy_utility.png", dpi=120)
    print("\n".join(lines))
