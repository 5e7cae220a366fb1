"""What a serving party holds: its trained block ``w_l`` (or network) and its own feature rows, keyed by id.

The rows are the party's file, train and test rows together (``vfl split``/``vfl align``'s ids, the
run's id column), scaled as training scaled them (:func:`parties.loading.load_party`); the model is
the run's newest complete epoch, read from the party's own folder as ``vfl predict`` reads it: the
linear block ``w_l``, or for a ``--model mlp`` run the party's trained bottom network (and, at the
leader, the top). Nothing here leaves the party: the leader only ever receives masked sums of
``w_l·x`` or of the embeddings ``h_l(x)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from parties.plan import JobPlan


@dataclass
class PartyModel:
    """One party's block and rows; ``task`` only at the leader (the active party knows the problem)."""

    rank: int
    w: np.ndarray
    rows: sp.csr_matrix
    sorted_ids: np.ndarray  # the party's ids, sorted, for a vectorised lookup
    row_of_sorted: np.ndarray  # the row of each sorted id
    task: str | None
    #: ``--model mlp``: the party's trained network (:class:`parties.party_model.NetworkPart`, with the
    #: top at the leader); None for a linear block
    network: object | None = None

    @property
    def k(self) -> int:
        """Values a row contributes to the secure sum: the cut layer's width, 1 for a linear block."""
        return 1 if self.network is None else int(self.network.k)

    def round_values(self, n: int) -> int:
        """Values this party adds to the secure sum of a round of n ids: (k+1)·n (its k per id, then 1/0
        held); the aggregator is sized for a round of ``--max-batch`` ids from it."""
        return (self.k + 1) * n

    @property
    def classes(self) -> int:
        """C of the leader's answers: its top's class count when over two, else 1 (one score an id)."""
        top = None if self.network is None else self.network.top
        return int(top.n_classes) if top is not None and top.n_classes > 2 else 1

    def embed(self, rows: np.ndarray) -> np.ndarray:
        """This party's ``(len(rows), k)`` contribution of its ``rows`` (ids it holds)."""
        block = self.rows[rows]
        if self.network is None:
            return np.asarray(block @ self.w, dtype=np.float64).reshape(-1, 1)
        return self.network.embed(block)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The row of each id, −1 where this party does not hold it."""
        if self.sorted_ids.size == 0:
            return np.full(ids.shape, -1, dtype=np.int64)
        at = np.searchsorted(self.sorted_ids, ids)
        at = np.minimum(at, self.sorted_ids.size - 1)
        found = self.sorted_ids[at] == ids
        return np.where(found, self.row_of_sorted[at], -1)


def load_model(config: JobPlan, rank: int, epochs: float) -> PartyModel:
    """This party's :class:`PartyModel` for the complete epoch ``epochs`` (the leader's)."""
    from parties.checkpoint import load_checkpoint
    from parties.loading import load_party

    party = load_party(config, rank, network=False)
    blocks = [party.block.to_csr()]
    ids = [np.asarray(party.train_ids, dtype=np.int64)]
    if party.test_block is not None:
        blocks.append(party.test_block.to_csr())
        ids.append(np.asarray(party.test_ids, dtype=np.int64))
    rows = sp.csr_matrix(sp.vstack(blocks, format="csr"))
    all_ids = np.concatenate(ids)
    order = np.argsort(all_ids, kind="stable")
    task = party.problem.task if party.problem is not None else None
    if config.model == "linear":
        w = load_checkpoint(config.party_folder(rank), rank, party.block.n_cols, epochs).w
        return PartyModel(rank, np.asarray(w, dtype=np.float64), rows, all_ids[order], order, task)
    from parties.party_model import run_network

    network = run_network(config, party, epochs)
    if network.top is not None and network.top.n_classes > 2:
        task = "multiclass"
    return PartyModel(rank, np.zeros(party.block.n_cols), rows, all_ids[order], order, task, network)
