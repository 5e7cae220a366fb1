"""``vfl predict``: scores of a trained VFB² model, computed through secure aggregation.

Nobody holds the whole model: party l keeps its block w_l in its own folder (``--party-dir``, by
default the run folder) and loads only that; the leader tells the others which epoch to use. Prediction
is therefore the same Algorithm-1 aggregation as training, batched over the rows to score: every
party contributes its masked w_l·x_i^(l) and only the leader (rank 0) learns z_i = w·x_i. The leader
writes ``predictions-<split>.csv``, one line per row keyed by the sample's id (the ids the party files
carry, ``vfl align``'s or ``vfl split``'s), with the columns :data:`COLUMNS` names: the score w·x and,
for a binary problem, the probability σ(w·x) of the positive class and the predicted label.

The run's ``config.json`` says which data each party holds (a named dataset's split, or the per-party
files of ``vfl split``), so predicting needs only the run folder. A run trained with
``--secure-channels`` is predicted sealed, under its keys and a fresh session
(:mod:`parties.serving.sealing`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from parties.checkpoint import checkpoint_path, complete_epochs, load_checkpoint
from parties.plan import JobPlan

LEADER = 0
#: The columns of ``predictions-<split>.csv``: what each one is (the file's header names them).
COLUMNS = {"id": "the sample's id, as in the party files",
           "score": "w·x, the model's score (the prediction itself for regression; --model mlp: the "
                    "top's logit)",
           "probability": "binary problems: σ(w·x), the probability of the label +1",
           "predicted_label": "binary problems: +1 where the score is >= 0, else -1 (the party files' "
                              "encoding: a CSV file's label 1 is +1, its 0 is -1)"}


def predict(run_dir: str | Path, *, split: str = "test", output: str | Path | None = None) -> int:
    """Start ``mpiexec`` with one rank per party of the run; returns the job's exit code."""
    from parties.launch import run_mpi_module

    run = Path(run_dir)
    config_path = run / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path} not found: pass the --out folder of a `vfl train` run")
    if split not in ("train", "test"):
        raise ValueError(f"--split must be 'train' or 'test', got {split!r}")
    config = _run_config(run)
    complete_epochs(run)  # a run that never completed an epoch has nothing to predict with
    if config.party_dir is None:  # all blocks are here: check now rather than in the ranks
        missing = [r for r in range(config.parties) if not checkpoint_path(run, r).exists()]
        if missing:
            raise FileNotFoundError(f"{run}: no trained block for parties {missing} (party-<rank>.ckpt.npz)")
    target = Path(output) if output is not None else run / f"predictions-{split}.csv"
    code, _ = run_mpi_module(config.parties, "parties.predict",
                             ["--run", str(run), "--split", split, "--output", str(target)])
    return code


def _run_config(run: Path) -> JobPlan:
    """The run's saved plan (:func:`parties.resume.load_run`): ``out`` and its party files where the
    run folder is now, and nothing the run drew once drawn again (a ``--label-privacy dp`` run's
    randomized response is read back, not redrawn over the file a resume needs)."""
    from parties.resume import load_run

    return load_run(run)


def _party_rows(config: JobPlan, rank: int, split: str):
    """This party's feature block for the split, its sample ids, and (leader) the task."""
    from parties.loading import load_party

    party = load_party(config, rank, network=False)  # a network is loaded trained: _network_scores
    block = party.block if split == "train" else party.test_block
    if block is None:
        raise ValueError(f"party {rank} holds no {split} rows")
    return block, party


def run_predict(run: Path, split: str, output: Path) -> None:
    """One rank: load the block and this party's rows, aggregate securely, leader writes the CSV."""
    from mpi4py import MPI

    from parties.serving.sealing import open_session
    from protocols.secure_aggregation import SecureAggregator

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    config = _run_config(run)
    block, party = _party_rows(config, rank, split)
    epochs = np.zeros(1)
    if rank == LEADER:
        epochs[0] = complete_epochs(run)
    comm.Bcast(epochs, root=LEADER)
    channels = open_session(comm, config.sealing_keys(rank), use=b"predict")  # --secure-channels runs
    aggregator = SecureAggregator.over_mpi(comm, seed=config.seed, allow_leaky_q2=config.allow_two_parties,
                                           channels=None if channels is None else channels.passes)
    if config.model != "linear":
        z = _network_scores(aggregator, config, party, block, float(epochs[0]))
    else:
        w = load_checkpoint(config.party_folder(rank), rank, block.n_cols, float(epochs[0])).w
        indices = np.arange(block.n_rows) if rank == LEADER else None
        z = aggregator.inner_product(w, block.to_csr(), indices, root=LEADER)
    aggregator.close()
    if rank != LEADER:
        return
    assert party.problem is not None and z is not None
    ids = party.train_ids if split == "train" else party.test_ids
    if z.ndim == 2:  # a network's class probabilities (more than two classes)
        columns = write_class_predictions(output, ids, z)
    else:
        columns = _columns(party)
        write_predictions(output, ids, z, binary=party.problem.task == "binary")
    sealed = "; sealed channels" if channels is not None else ""
    print(f"wrote {len(ids)} {split} predictions to {output} (columns: {', '.join(columns)}{sealed})",
          flush=True)


def _network_scores(aggregator, config: JobPlan, party, block, epochs: float) -> np.ndarray | None:
    """``--model mlp``: each party's trained network on its own rows, the embeddings summed by secure
    aggregation (no party sees another's), and at the leader the top's logit of the positive class.
    Each network is built for inference (:func:`parties.party_model.run_network`: no optimiser, whose
    construction imports torch's compiler, seconds a rank)."""
    from parties.party_model import run_network

    part = run_network(config, party, epochs)
    total = aggregator.sum(part.embed(block.to_csr()).ravel(), root=LEADER)
    if total is None:
        return None
    return network_outputs(part.top.predict_proba(total.reshape(-1, part.k)))


def network_outputs(proba: np.ndarray) -> np.ndarray:
    """What a network's top gives for its class probabilities ``proba`` (n, C): binary, the logit of
    the positive class (the score); more classes, the probabilities themselves. ``vfl serve`` and
    ``parties.export.combined_scores`` answer through it, so all three agree."""
    from scipy.special import logit

    if proba.shape[1] > 2:
        return proba
    return logit(np.clip(proba[:, 1], 1e-300, 1 - 1e-16))


def _columns(party) -> list[str]:
    return list(COLUMNS) if party.problem.task == "binary" else ["id", "score"]


def write_class_predictions(output: Path, ids: np.ndarray, proba: np.ndarray) -> list[str]:
    """A network of C > 2 classes: per row its id, the predicted class (0..C−1, the label files' class
    numbers) and that class's probability; returns the columns."""
    names = ["id", "predicted_label", "probability"]
    output.parent.mkdir(parents=True, exist_ok=True)
    predicted = np.argmax(proba, axis=1)
    with open(output, "w") as fh:
        fh.write(",".join(names) + "\n")
        for i, c, p in zip(ids.tolist(), predicted.tolist(), proba[np.arange(len(ids)), predicted].tolist(),
                           strict=True):
            fh.write(f"{i},{c},{p:.10g}\n")
    return names


def write_predictions(output: Path, ids: np.ndarray, z: np.ndarray, *, binary: bool) -> None:
    """``predictions-<split>.csv``: one line per row, keyed by its id (:data:`COLUMNS`)."""
    from scipy.special import expit

    output.parent.mkdir(parents=True, exist_ok=True)
    names = list(COLUMNS) if binary else ["id", "score"]
    with open(output, "w") as fh:
        fh.write(",".join(names) + "\n")
        if binary:
            for i, score, p in zip(ids.tolist(), z.tolist(), expit(z).tolist(), strict=True):
                fh.write(f"{i},{score:.10g},{p:.10g},{1 if score >= 0 else -1}\n")
        else:
            for i, score in zip(ids.tolist(), z.tolist(), strict=True):
                fh.write(f"{i},{score:.10g}\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one party of `vfl predict` (run under mpiexec)")
    parser.add_argument("--run", required=True)
    parser.add_argument("--split", default="test")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    run_predict(Path(args.run), args.split, Path(args.output))


if __name__ == "__main__":
    main()
