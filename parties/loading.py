"""What one rank loads: its own block of the features and, on an active party, the labels.

A rank reads only its own data: its per-party file, written by ``vfl split`` (a real deployment: each
organisation has only its file) or by the launcher from a registered dataset (a simulation on one
machine runs the same way, and no rank ever holds the other parties' columns). The loss goes only to
active parties: passive parties never see it.
"""

from __future__ import annotations

import hashlib

import numpy as np

from parties.plan import JobPlan
from parties.runtime import PartyState
from vfl.algorithms.registry import get_algorithm
from vfl.algorithms.vfb2 import Block, SAGARule
from vfl.problems import get_problem


def load_party(config: JobPlan, rank: int) -> PartyState:
    """This rank's PartyState: its block of the training/test features and, if active, the labels."""
    active = rank < config.active
    if config.party_files is None:
        raise ValueError("a rank reads only its own party file: the launcher writes them for a named "
                         "dataset (parties.launch.write_party_files)")
    from vfl.datasets.party_files import find_party_file, load_party_file

    data = load_party_file(find_party_file(config.party_files, rank), expect_labels=active)
    X_train, X_test, y_train, y_test = data.X_train, data.X_test, data.y_train, data.y_test
    train_ids, test_ids = data.train_ids, data.test_ids
    if active and config.label_privacy == "dp":
        from vfl.label_privacy import randomized_response

        # a secret only this party draws: a seed anyone could read would let them undo the flips
        y_train = randomized_response(y_train, config.epsilon, np.random.default_rng())
    problem = get_problem(config.problem, lam=config.lam)
    block = Block.from_matrix(X_train)
    rule_cls = get_algorithm(config.algorithm).rule
    options = {"lazy": config.lazy_updates(block.n_cols), "batch_size": config.batch_size,
               "writers": config.worker_threads + 1}  # slot 0: the dominator; 1..k: the workers
    if rule_cls is SAGARule:
        options["table_budget_bytes"] = int(config.saga_table_budget * 2**30)
    rule = rule_cls(block, problem.regularizer, problem.lam, config.gamma, **options)
    has_test = X_test is not None and X_test.shape[0] > 0
    return PartyState(
        rank=rank, block=block, w=np.zeros(block.n_cols), rule=rule,
        problem=problem if active else None,
        y=None if y_train is None else np.asarray(y_train, dtype=np.float64),
        test_block=Block.from_matrix(X_test) if has_test else None,
        y_test=None if y_test is None or not has_test else np.asarray(y_test, dtype=np.float64),
        ids_digest=ids_digest(train_ids, test_ids))


def ids_digest(train_ids: np.ndarray, test_ids: np.ndarray) -> bytes:
    """SHA-256 of the sample ids in row order: parties compare digests, never the ids themselves."""
    h = hashlib.sha256()
    for ids in (train_ids, test_ids):
        h.update(np.int64(ids.size).tobytes())
        h.update(np.ascontiguousarray(ids, dtype="<i8").tobytes())
    return h.digest()
