"""Label inference by a curious passive party, from what it received (its ``--audit`` transcript).

The attacks a passive party can run on its own transcript with no help (usable as a library):

* ``theta_sign``: every dispatched (ϑ, i) has ϑ = ∂L/∂z; for the logistic loss ϑ = −y·σ(−y z), so
  sign(ϑ) = −y on every row it received.
* ``full_theta``: the full pass at w = 0 (first SVRG snapshot, SAGA start) broadcasts ϑ₀ = −y/2 for
  every training row.

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

from parties.runtime import AUDIT_FULL_THETA, TAG_THETA

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


def theta_sign(t: Transcript, n_rows: int) -> np.ndarray:
    """Score −mean(ϑ) of each row from the dispatched (ϑ, i) pairs (``[seq, B, rows, ϑs]`` messages)."""
    total, count = np.zeros(n_rows), np.zeros(n_rows)
    for words in t.of_tag(TAG_THETA):
        buf = words.view(np.float64)
        b = int(buf[1])
        rows, thetas = buf[2:2 + b].astype(np.int64), buf[2 + b:2 + 2 * b]
        np.add.at(total, rows, thetas)
        np.add.at(count, rows, 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, -total / count, np.nan)


def full_theta(t: Transcript, n_rows: int) -> np.ndarray:
    """Score −ϑ₀ from the first full ϑ vector this party received (NaN if none)."""
    vectors = [m.view(np.float64) for m in t.of_tag(AUDIT_FULL_THETA)]
    return -vectors[0] if vectors and vectors[0].size == n_rows else np.full(n_rows, np.nan)


ATTACKS = {"theta_sign": theta_sign, "full_theta": full_theta}


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


def attack_all(transcript_path: str | Path, y: np.ndarray) -> dict[str, dict[str, float]]:
    t = Transcript.load(transcript_path)
    return {name: judge(attack(t, y.size), y) for name, attack in ATTACKS.items()}


def main(argv: list[str] | None = None) -> None:
    import tempfile

    from parties.config import RunConfig
    from parties.launch import launch
    from vfl.datasets import load

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", default=["breast-cancer", "a9a"])
    p.add_argument("--algorithms", nargs="+", default=["sgd", "svrg", "saga-scalar"])
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    rows = []
    for dataset in args.datasets:
        try:
            y = load(dataset, seed=0).y_train
        except FileNotFoundError as err:
            print(f"[label_attacks] {dataset}: {err.__class__.__name__}; skipped")
            continue
        for algorithm in args.algorithms:
            work = Path(tempfile.mkdtemp(prefix="vfl-attack-"))
            config = RunConfig(parties=4, active=1, dataset=dataset, algorithm=algorithm, epochs=args.epochs,
                               audit=True, out=str(work), progress=False)
            if launch(config, echo=False) != 0:
                raise RuntimeError(f"{dataset}/{algorithm}: training failed")
            for party in range(1, 4):
                for attack, scores in attack_all(work / f"audit-{party}.npz", y).items():
                    rows.append({"dataset": dataset, "mode": "plain", "algorithm": algorithm,
                                 "party": party, "attack": attack, **scores})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"load": os.getloadavg(), "rows": rows}, indent=1))
    lines = ["| dataset | algorithm | attack | coverage | accuracy | AUC | majority class |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["party"] == 1:
            lines.append(f"| {r['dataset']} | {r['algorithm']} | {r['attack']} | {r['coverage']:.2f} | "
                         f"{r['accuracy']:.3f} | {r['auc']:.3f} | {r['majority']:.3f} |")
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
