"""Vertical partitions: which feature columns each of the q parties holds.

A partition is a list of q sorted, disjoint int64 arrays of column indices that together cover
``0..n_features-1`` (the paper's G_1..G_q). Party p's block of a matrix is ``X[:, blocks[p]]``;
:func:`block_of` takes it keeping CSR data CSR.

- :func:`random_blocks`: the VFB² paper's split, "vertically and randomly into q non-overlapped parts
  with nearly equal number of features" (sizes differ by at most one, the larger ones first).
- :func:`contiguous_blocks`: the companion AVFL code's split, d/q consecutive columns each, the
  remainder going to the first ranks.
- :func:`blocks_from_columns`: a partition given by the parties themselves, validated.
- :func:`image_strips`: row-major images cut into q vertical strips (the usual image VFL benchmark: each
  party sees a band of pixel columns of every image).

Every party must hold at least one column: a party with no features has nothing to learn.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp


def _check_counts(n_features: int, q: int) -> None:
    if n_features < 1:
        raise ValueError(f"n_features must be >= 1, got {n_features}")
    if not 1 <= q <= n_features:
        raise ValueError(f"the number of parties q must be between 1 and n_features={n_features}, got {q}")


def random_blocks(n_features: int, q: int, seed: int) -> list[np.ndarray]:
    """A random partition into q near-equal blocks (deterministic for a seed)."""
    _check_counts(n_features, q)
    order = np.random.default_rng(seed).permutation(n_features)
    return [np.sort(part).astype(np.int64) for part in np.array_split(order, q)]


def contiguous_blocks(n_features: int, q: int) -> list[np.ndarray]:
    """Consecutive near-equal blocks, the remainder to the first parties (the AVFL code's split)."""
    _check_counts(n_features, q)
    return [part.astype(np.int64) for part in np.array_split(np.arange(n_features), q)]


def image_strips(height: int, width: int, q: int) -> list[np.ndarray]:
    """The pixels of ``height × width`` row-major images in q vertical strips of near-equal width
    (Fashion-MNIST at q = 4: 7 pixel columns × 28 rows = 196 features a party)."""
    if height < 1:
        raise ValueError(f"height must be >= 1, got {height}")
    return [np.sort((np.arange(height)[:, None] * width + cols[None, :]).ravel())
            for cols in contiguous_blocks(width, q)]


def blocks_from_columns(columns: Sequence[Sequence[int]], n_features: int) -> list[np.ndarray]:
    """Validate a partition given as one column list per party; returns sorted int64 arrays.

    Errors name the party and the column: out of range, duplicated, held by two parties, or not held
    by anyone.
    """
    if len(columns) < 1:
        raise ValueError("a partition needs at least one party")
    blocks, owner = [], np.full(n_features, -1, dtype=np.int64)
    for party, cols in enumerate(columns):
        block = np.asarray(cols)
        if block.ndim != 1 or block.size == 0:
            raise ValueError(f"party {party}: expected a non-empty list of column indices, got {cols!r}")
        if not np.issubdtype(block.dtype, np.integer):
            raise ValueError(f"party {party}: column indices must be integers, got dtype {block.dtype}")
        outside = block[(block < 0) | (block >= n_features)]
        if outside.size:
            raise ValueError(f"party {party}: column {int(outside[0])} is outside 0..{n_features - 1}")
        block = np.sort(block).astype(np.int64)
        repeated = block[1:][block[1:] == block[:-1]]
        if repeated.size:
            raise ValueError(f"party {party}: column {int(repeated[0])} is listed twice")
        shared = block[owner[block] >= 0]
        if shared.size:
            column = int(shared[0])
            raise ValueError(f"column {column} is held by both party {int(owner[column])} and party {party}")
        owner[block] = party
        blocks.append(block)
    orphans = np.flatnonzero(owner < 0)
    if orphans.size:
        raise ValueError(f"{orphans.size} column(s) are held by no party, e.g. column {int(orphans[0])}")
    return blocks


COLUMN_ORDERS = ("auto", "index", "frequency")
"""How a party's block stores its columns: by global index, by how many rows use them, or ``auto``:
by frequency where a block is wider than :data:`AUTO_FREQUENCY_WIDTH`, by index elsewhere."""

AUTO_FREQUENCY_WIDTH = 65_536
"""Columns a block above which ``auto`` numbers by frequency: 512 KiB of float64, about where w stops
fitting a core's L2 cache. Narrower blocks keep the index order, so small data sets split exactly as
before."""


def column_counts(*matrices: np.ndarray | sp.spmatrix, n_features: int) -> np.ndarray:
    """Nonzeros per column over all rows of ``matrices`` (train and test: an ordering heuristic only)."""
    counts = np.zeros(n_features, dtype=np.int64)
    for X in matrices:
        if sp.issparse(X):
            counts += np.bincount(sp.csr_matrix(X).indices, minlength=n_features)
        else:
            counts += np.count_nonzero(np.asarray(X), axis=0)
    return counts


def order_columns(block: np.ndarray, counts: np.ndarray, order: str) -> np.ndarray:
    """A party's columns in the order its block stores them. ``"frequency"``: by descending count of
    nonzeros, ties by index. On a wide block with heavy-tailed column use (webspam's 4M columns a
    party) the columns most rows touch then share cache lines: an update's scattered reads and writes of
    w hit cache instead of memory (docs/large-sparse-data.md measures it). Any order trains the same
    model; only the local numbering changes, and ``columns`` maps it back."""
    if order not in COLUMN_ORDERS:
        raise ValueError(f"unknown column order {order!r}; choose one of {', '.join(COLUMN_ORDERS)}")
    if order == "index" or (order == "auto" and block.size <= AUTO_FREQUENCY_WIDTH):
        return block
    return block[np.argsort(-counts[block], kind="stable")]


def block_of(X: np.ndarray | sp.spmatrix, block: np.ndarray) -> np.ndarray | sp.csr_matrix:
    """The columns ``block`` of ``X``: CSR (sorted indices) for sparse input, a C-contiguous array else."""
    if sp.issparse(X):
        part = sp.csr_matrix(X)[:, block]
        part.sort_indices()
        return part
    return np.ascontiguousarray(X[:, block])
