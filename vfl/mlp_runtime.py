"""``VerticalMLPClassifier(backend="mpi")``: ``fit`` over a real ``vfl train --model mlp`` job.

``backend="simulate"`` plays the protocol step by step in one process. This backend runs the MPI runtime
itself, as ``vfl train --model mlp --party-files`` does:

* each party gets its own file, with the labels only in the label holder's (rank 0);
* the parties train in their own processes, summing their embeddings through the secure aggregation;
* each party's trained network is then read back from its own checkpoint.

Holding every party's network in one object is possible only because ``fit`` simulates a federation on
one machine, as the linear estimators' ``coef_`` is. In a deployment each party keeps its own network,
and ``vfl predict`` scores rows through the secure sum.

The runtime steps every network with Adam in float32 and clips ϑ to norm 1 under label DP
(``parties/party_model.py``). Settings it does not have are refused in one line rather than ignored.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def refusal(est) -> str | None:
    """Why the runtime cannot train ``est``'s settings (None when it can)."""
    if est.optimizer != "adam" or est.momentum:
        return "backend='mpi' steps every network with Adam: use optimizer='adam', momentum=0"
    if est.dtype != "float32":
        return "backend='mpi' trains in float32: use dtype='float32'"
    if est.label_privacy == "dp" and est.clip != 1.0:
        return "backend='mpi' clips each row's ϑ to norm 1 under label DP: use clip=1.0"
    if est.label_privacy == "dp" and est.delta != 1e-5:
        return "backend='mpi' accounts label DP at δ = 1e-5: use delta=1e-5"
    return None


def fit_over_mpi(est, X, labels: np.ndarray, columns: list[np.ndarray], work: Path) -> dict:
    """Train ``est``'s network on ``X`` and the class indices ``labels`` over real MPI parties (one per
    block of ``columns``) in the folder ``work``; returns the fitted attributes."""
    from parties.config import ConfigError, RunConfig
    from parties.launch import prepare, run_plan
    from parties.outcomes import EXIT_CODES

    n_classes = int(labels.max()) + 1
    folder = _party_files(X, labels, n_classes, columns, work / "parties")
    bottom = est.bottom if isinstance(est.bottom, str) else ",".join(est.bottom)
    privacy = {"label_privacy": "dp-theta", "epsilon": est.epsilon} if est.label_privacy == "dp" else {}
    try:
        config = RunConfig(model="mlp", algorithm="sgd", parties=len(columns), active=1,
                           party_files=str(folder), problem="logistic", standardize="off",
                           bottom=bottom, top=est.top, gamma=est.lr, lam=0.0, batch_size=est.batch_size,
                           epochs=float(est.epochs), mode=est.mode, seed=est.seed, out=str(work / "run"),
                           overwrite=True, progress=est.verbose, threads=None, **privacy)
        plan = prepare(config, echo=est.verbose)
    except ConfigError as err:
        raise ValueError(f"backend='mpi': {err}") from None
    code = run_plan(plan, echo=est.verbose)
    if code != EXIT_CODES["ok"]:
        reason = next((k for k, v in EXIT_CODES.items() if v == code), "failed")
        raise RuntimeError(f"the network job {reason} (exit code {code}); the message above says why")
    run = Path(plan.out)
    bottoms, top = _trained_networks(plan, columns, labels, run)
    return {"bottoms_": bottoms, "top_": top,
            "history_": [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()],
            "noise_multiplier_": plan.noise_multiplier,
            "epsilon_": est.epsilon if est.label_privacy == "dp" else None}


def _party_files(X, labels: np.ndarray, n_classes: int, columns, folder: Path) -> Path:
    """One file per party in ``folder``; binary labels as the party files hold them (±1)."""
    from vertical.datasets import Dataset, split_to_party_files

    binary = n_classes == 2
    y = np.where(labels == 1, 1.0, -1.0) if binary else labels.astype(np.int64)
    n = X.shape[0]
    ds = Dataset("in-memory", "binary" if binary else "multiclass", X, y, X[:0], y[:0], np.arange(n),
                 np.arange(n, n), seed=None)
    split_to_party_files(ds, columns, [0], folder, overwrite=True, layout="folder")
    return folder


def _trained_networks(plan, columns, labels: np.ndarray, run: Path):
    """Every party's trained network and the top, read from each party's checkpoint of the run's last
    complete epoch as ``vfl predict`` reads them (:func:`parties.party_model.load_trained_network`:
    names and shapes checked; for inference, no optimiser)."""
    from parties.checkpoint import complete_epochs
    from parties.model_options import bottom_specs
    from parties.party_model import load_trained_network

    epochs, specs = complete_epochs(run), bottom_specs(plan.bottom, plan.parties)
    parts = [load_trained_network(plan.party_folder(rank), rank, len(cols), epochs, specs[rank], plan.top,
                                  (labels,) if rank == 0 else None)
             for rank, cols in enumerate(columns)]
    return [part.model for part in parts], parts[0].top
