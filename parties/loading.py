"""What one rank loads: its own block of the features and, on an active party, the labels.

A rank reads only its own data: its per-party file, written by ``vfl split`` (a real deployment: each
organisation has only its file) or by the launcher from a registered dataset (a simulation on one
machine runs the same way, and no rank ever holds the other parties' columns). The loss goes only to
active parties: passive parties never see it.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np

from parties.checkpoint import atomic_write, npz_member_shape
from parties.plan import JobPlan
from parties.runtime import PartyState
from vertical.algorithms.registry import get_algorithm
from vertical.algorithms.vfb2 import Block, SAGARule
from vertical.problems import get_problem
from vertical.standardize import Scaling, apply_scaling, fit_scaling


def load_party(config: JobPlan, rank: int, *, network: bool = True) -> PartyState:
    """This rank's PartyState: its block of the training/test features and, if active, the labels;
    ``--model mlp``: its network to train too, unless ``network`` is False (``vfl predict`` and ``vfl
    serve`` load the trained one for inference, :func:`parties.party_model.run_network`)."""
    active = rank < config.active
    if config.party_files is None:
        raise ValueError("a rank reads only its own party file: the launcher writes them for a named "
                         "dataset (parties.launch.write_party_files)")
    data = read_own_party(own_party_file(config.party_files, rank), active, config.problem)
    X_train, X_test, y_train, y_test = data.X_train, data.X_test, data.y_train, data.y_test
    train_ids, test_ids = data.train_ids, data.test_ids
    if active and config.label_privacy == "dp":
        y_train = noisy_labels(config, rank, y_train, train_ids)
    scaling = party_scaling(config, rank, X_train, train_ids)
    if scaling is not None:
        X_train = apply_scaling(X_train, scaling, who=f"party {rank}")
        if X_test is not None and X_test.shape[0] > 0:
            X_test = apply_scaling(X_test, scaling, who=f"party {rank}")
    problem = get_problem(config.problem, lam=config.lam)
    block = Block.from_matrix(X_train)
    rule_cls = get_algorithm(config.algorithm).rule
    options = {"lazy": config.lazy_updates(block.n_cols), "batch_size": config.batch_size,
               "writers": config.worker_threads + 1}  # slot 0: the dominator; 1..k: the workers
    if rule_cls is SAGARule:
        options["table_budget_bytes"] = int(config.saga_table_budget * 2**30)
    # under --gamma auto the step is derived from every party's block at start (parties.step.choose_gamma,
    # before the first step): NaN until then, so that no step can be taken with a made-up one
    gamma = config.gamma if config.gamma is not None else math.nan
    rule = rule_cls(block, problem.regularizer, problem.lam, gamma, **options)
    has_test = X_test is not None and X_test.shape[0] > 0
    state = PartyState(
        rank=rank, block=block, w=np.zeros(block.n_cols), rule=rule,
        problem=problem if active else None,
        y=None if y_train is None else np.asarray(y_train, dtype=np.float64),
        test_block=Block.from_matrix(X_test) if has_test else None,
        y_test=None if y_test is None or not has_test else np.asarray(y_test, dtype=np.float64),
        ids_digest=ids_digest(train_ids, test_ids), train_ids=train_ids, test_ids=test_ids)
    if config.model != "linear" and network:
        from parties.party_model import attach_network

        attach_network(config, state, X_train)
    return state


#: The names of a party's CSV file (``vfl align`` writes ``party-<p>.csv``).
CSV_SUFFIXES = (".csv", ".csv.gz", ".csv.bz2")


def true_training_labels(config: JobPlan, rank: int) -> np.ndarray:
    """A label holder's training labels as its party file holds them: never ``--label-privacy dp``'s
    randomized response (which :func:`load_party` returns, and draws afresh for a plan that is not
    resuming). An attack is judged against these."""
    data = read_own_party(own_party_file(config.party_files, rank), True, config.problem)
    return np.asarray(data.y_train, dtype=np.float64)


def own_party_file(path: str | Path, rank: int) -> Path:
    """A rank's data: ``party-<rank>`` of a split folder, or a party's file or folder itself (a party
    started on its own, ``vfl party --data``, holds only its own): a ``party-<p>/`` folder, an ``.npz``,
    a CSV file, or a folder of ``vfl align`` holding ``party-<rank>.csv``."""
    from vertical.datasets.csv_parties import csv_party_name
    from vertical.datasets.party_files import find_party_file
    from vertical.datasets.party_folder import is_party_folder

    given = Path(path)
    if is_party_folder(given) or (given.suffix == ".npz" and given.is_file()):
        return given
    if given.is_file() and given.name.endswith(CSV_SUFFIXES):
        return given
    try:
        return find_party_file(given, rank)
    except FileNotFoundError:
        if (given / csv_party_name(rank)).is_file():
            return given / csv_party_name(rank)
        raise


def read_own_party(path: Path, active: bool, problem: str):
    """One party's data from its file: a CSV is read with the checks ``vfl train --party-files`` makes
    of a CSV folder before converting it (the problem's task for the labels, a feature column and a
    training row at least); the row alignment across parties is the join's ids check."""
    from vertical.datasets.party_files import load_party_file
    from vertical.datasets.validation import DataValidationError
    from vertical.problems import PROBLEMS

    if not path.name.endswith(CSV_SUFFIXES):
        return load_party_file(path, expect_labels=active)
    data = load_party_file(path, expect_labels=active, task=PROBLEMS[problem].task)
    if data.n_features == 0:
        raise DataValidationError(f"{path}: no feature columns (only id/label/split): every party needs "
                                  "at least one")
    if data.train_ids.size == 0:
        raise DataValidationError(f"{path}: no training rows")
    return data


def scaling_path(config: JobPlan, rank: int) -> Path:
    """Where party ``rank`` keeps its ``--standardize`` statistics: its own folder."""
    return scaling_file(config.party_folder(rank), rank)


def scaling_file(folder: str | Path, rank: int) -> Path:
    """Party ``rank``'s ``--standardize`` statistics in its folder (a ``vfl party`` folder too)."""
    return Path(folder) / f"standardize-{rank}.npz"


def party_scaling(config: JobPlan, rank: int, X_train, train_ids: np.ndarray) -> Scaling | None:
    """``--standardize``: this party's column scaling, fitted on its own training rows when the run
    starts and kept in its own folder (``standardize-<rank>.npz``), so that ``--resume`` and ``vfl
    predict`` scale exactly as training did; read back (and checked against the rows' ids and the
    block's width) from then on. None under ``--standardize off``."""
    if config.standardize == "off":
        return None
    path = scaling_path(config, rank)
    digest = np.frombuffer(ids_digest(train_ids, np.zeros(0, dtype=np.int64)), dtype=np.uint8)
    if not config.resume:
        scaling = fit_scaling(X_train, config.standardize)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda fh: np.savez(fh, shift=scaling.shift, scale=scaling.scale,
                                               mode=config.standardize, ids_digest=digest))
        return scaling
    return read_scaling(path, X_train.shape[1], config.standardize, digest)


def read_scaling(path: Path, n_cols: int, mode: str, digest: np.ndarray | None = None) -> Scaling:
    """A party's saved ``--standardize`` statistics, checked: the run's mode, one finite shift and one
    positive finite scale per column, and (``digest``) the same training rows. Anything else is a
    ``ValueError`` naming the file: scaling with other statistics would silently change the model."""
    if not path.exists():
        raise ValueError(f"{path} is missing: the run's --standardize statistics are kept there; start "
                         "the run again without --resume")
    foreign = False
    try:
        with np.load(path, allow_pickle=False) as z:
            shapes = [npz_member_shape(z, key) for key in ("shift", "scale", "mode", "ids_digest")]
            foreign = shapes != [(n_cols,), (n_cols,), (), (32,)]  # checked before any array is read
            if not foreign:
                shift, scale, saved_mode, saved = z["shift"], z["scale"], str(z["mode"]), z["ids_digest"]
    except (OSError, KeyError, ValueError, EOFError) as err:
        raise ValueError(f"{path} is damaged ({err}); start the run again without --resume") from None
    if (foreign or saved_mode != mode or shift.dtype.kind != "f" or scale.dtype.kind != "f"
            or not np.isfinite(shift).all() or not (np.isfinite(scale).all() and (scale > 0).all())
            or (digest is not None and not np.array_equal(saved, digest))):
        raise ValueError(f"{path} is not this run's --standardize {mode} statistics for {n_cols} columns "
                         "(other rows, columns or mode); start the run again without --resume")
    return Scaling(shift.astype(np.float64), scale.astype(np.float64))


def noisy_labels(config: JobPlan, rank: int, y: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``--label-privacy dp``: the randomized response of this party's training labels, drawn **once**
    and kept in its own folder (``label-dp-<rank>.npz``).

    ε-label-DP holds for one draw. Each further draw is another release of the same labels: a passive
    party that saw rows before and after a ``--resume`` with a fresh draw would combine two noisy copies
    (87.7 % correct at ε = 1 instead of 73.1 %, the 2ε level). So a resumed run reads the draw back,
    checked against the labels' ids and ε, and refuses without it; and any other load of the same rows,
    labels and ε in this folder (a fresh run over an old one, or a tool that loads a finished run's plan
    without ``resume``) reuses the draw instead of making a second one. Only other rows, labels or ε draw
    anew. The draw is a secret only this party makes (OS entropy): a seed anyone could read would let
    them undo the flips; the labels' digest stays in this party's own folder."""
    from vertical.label_privacy import randomized_response

    path = config.party_folder(rank) / f"label-dp-{rank}.npz"
    digest = np.frombuffer(ids_digest(ids, np.zeros(0, dtype=np.int64)), dtype=np.uint8)
    labels = np.frombuffer(hashlib.sha256(np.ascontiguousarray(y, dtype="<f8").tobytes()).digest(),
                           dtype=np.uint8)
    saved = _saved_draw(path, config.epsilon, digest, y.shape)
    if not config.resume:
        if saved is not None and saved[1] is not None and np.array_equal(saved[1], labels):
            return saved[0]  # these labels were drawn here already: one release, not two
        drawn = randomized_response(y, config.epsilon, np.random.default_rng())
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda fh: np.savez(fh, y=drawn, epsilon=config.epsilon, ids_digest=digest,
                                               labels_digest=labels))
        return drawn
    if not path.exists():
        raise ValueError(f"{path} is missing: resuming would draw the randomized response again and "
                         "release the labels twice (2ε); start the run again without --resume")
    if saved is None or (saved[1] is not None and not np.array_equal(saved[1], labels)):
        raise ValueError(f"{path} is not this run's randomized response (ε, other rows or labels): start "
                         "the run again without --resume")
    return saved[0]


def _saved_draw(path: Path, epsilon: float, digest: np.ndarray, shape) -> tuple | None:
    """The draw saved at ``path`` and its labels' digest (None for a file written before it was kept),
    if it is one of these rows at this ε; None otherwise."""
    if not path.exists():
        return None
    with np.load(path, allow_pickle=False) as z:
        drawn, saved_epsilon, saved_ids = z["y"], float(z["epsilon"]), z["ids_digest"]
        labels = z["labels_digest"] if "labels_digest" in z.files else None
    if saved_epsilon != epsilon or not np.array_equal(saved_ids, digest) or drawn.shape != shape \
            or not np.isin(drawn, (-1.0, 1.0)).all():
        return None
    return drawn, labels


def ids_digest(train_ids: np.ndarray, test_ids: np.ndarray) -> bytes:
    """SHA-256 of the sample ids in row order: parties compare digests, never the ids themselves."""
    h = hashlib.sha256()
    for ids in (train_ids, test_ids):
        h.update(np.int64(ids.size).tobytes())
        h.update(np.ascontiguousarray(ids, dtype="<i8").tobytes())
    return h.digest()
