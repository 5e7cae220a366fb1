"""Which rows each client owns: partitions of a labelled data set, each returning one array of row indices
per client (increasing), seeded by a numpy ``Generator``.

- :func:`shard_partition`: the SCAFFOLD/SCAFCOM papers' label shards. ``n_clients * shards_per_client``
  shards, **each of one class only** ("400 shards, each containing samples from only one class"; 2 per
  client). Decision: the shards are split per class, each class getting a number of shards proportional
  to its size (largest remainder; for Fashion-MNIST with N = 200 that is exactly 40 shards of 150 per
  class), and the shards are dealt to clients by a random permutation. Two shards of the same class may
  land on one client ("at most two classes").
- :func:`dirichlet_partition`: per class, client proportions ~ Dir(α·1); redrawn until every client
  holds at least ``min_size`` rows (clear error after ``max_tries``).
- :func:`iid_partition`: a random permutation cut into near-equal parts.
- :func:`labels_per_client_partition`: FedBAT's Non-IID-2 split, a fixed number of classes per client.
- :func:`imbalanced_st_indices`: not a partition but the row subset of FedDRO's imbalanced "-ST" sets.
"""

from __future__ import annotations

import numpy as np


def _check_clients(n_rows: int, n_clients: int) -> None:
    if n_clients < 1:
        raise ValueError(f"n_clients must be >= 1, got {n_clients}")
    if n_clients > n_rows:
        raise ValueError(f"cannot give {n_clients} clients at least one row each from {n_rows} rows")


def iid_partition(n_rows: int, n_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Uniformly random, near-equal split (sizes differ by at most one)."""
    _check_clients(n_rows, n_clients)
    return [np.sort(part) for part in np.array_split(rng.permutation(n_rows), n_clients)]


def shard_partition(labels: np.ndarray, n_clients: int, shards_per_client: int,
                    rng: np.random.Generator) -> list[np.ndarray]:
    """Label shards: every shard holds one class only; each client gets ``shards_per_client`` shards."""
    labels = np.asarray(labels)
    _check_clients(labels.size, n_clients)
    if shards_per_client < 1:
        raise ValueError(f"shards_per_client must be >= 1, got {shards_per_client}")
    n_shards = n_clients * shards_per_client
    classes, counts = np.unique(labels, return_counts=True)
    if n_shards < classes.size:
        raise ValueError(f"{n_shards} shards cannot cover {classes.size} classes with one class per shard")
    quota = counts / counts.sum() * n_shards
    per_class = np.maximum(np.floor(quota).astype(int), 1)
    while per_class.sum() < n_shards:                 # largest remainder, one shard at a time
        per_class[np.argmax(quota - per_class)] += 1
    while per_class.sum() > n_shards:
        per_class[np.argmax(np.where(per_class > 1, per_class - quota, -np.inf))] -= 1
    if np.any(per_class > counts):
        raise ValueError("too many shards for the rows of some class: lower n_clients or shards_per_client")
    shards: list[np.ndarray] = []
    for cls, k in zip(classes, per_class, strict=True):
        rows = rng.permutation(np.flatnonzero(labels == cls))
        shards.extend(np.array_split(rows, k))
    order = rng.permutation(n_shards).reshape(n_clients, shards_per_client)
    return [np.sort(np.concatenate([shards[s] for s in mine])) for mine in order]


def dirichlet_partition(labels: np.ndarray, n_clients: int, alpha: float, rng: np.random.Generator,
                        min_size: int = 1, max_tries: int = 1000) -> list[np.ndarray]:
    """Per class, split its rows among clients with proportions ~ Dirichlet(α); small α = more skew."""
    labels = np.asarray(labels)
    _check_clients(labels.size, n_clients)
    if not alpha > 0:
        raise ValueError(f"Dirichlet alpha must be > 0, got {alpha}")
    if min_size * n_clients > labels.size:
        raise ValueError(f"min_size={min_size} x {n_clients} clients exceeds the {labels.size} rows")
    by_class = [np.flatnonzero(labels == cls) for cls in np.unique(labels)]
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
        for rows in by_class:
            rows = rng.permutation(rows)
            cuts = (np.cumsum(rng.dirichlet(np.full(n_clients, alpha)))[:-1] * rows.size).astype(int)
            for client, piece in enumerate(np.split(rows, cuts)):
                parts[client].append(piece)
        result = [np.sort(np.concatenate(p)) for p in parts]
        if min(r.size for r in result) >= min_size:
            return result
    raise ValueError(f"no Dirichlet(alpha={alpha}) draw gave every one of {n_clients} clients "
                     f">= {min_size} rows in {max_tries} tries: raise alpha or lower min_size")


def labels_per_client_partition(labels: np.ndarray, n_clients: int, labels_per_client: int,
                                rng: np.random.Generator) -> list[np.ndarray]:
    """The paper's Non-IID-2 split: every client holds exactly ``labels_per_client`` classes.

    Decision: labels are assigned as in the authors' code, balanced (each client in a
    random order takes the least-used classes, ties broken at random), so every class is used and, for
    FMNIST with N = 100 and 3 labels, has 30 holders; each class's rows are then shuffled and split equally
    among its holders. The paper's "random labels" could leave a class unused.
    """
    labels = np.asarray(labels)
    classes = np.unique(labels)
    if not 1 <= labels_per_client <= classes.size:
        raise ValueError(f"labels_per_client must be in [1, {classes.size}], got {labels_per_client}")
    if n_clients < 1:
        raise ValueError(f"n_clients must be >= 1, got {n_clients}")
    usage = np.zeros(classes.size, dtype=np.int64)
    holders: list[list[int]] = [[] for _ in classes]
    for client in rng.permutation(n_clients):
        tie_break = rng.random(classes.size)
        for c in np.lexsort((tie_break, usage))[:labels_per_client]:
            holders[c].append(int(client))
            usage[c] += 1
    parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
    for c, owners in enumerate(holders):
        rows = rng.permutation(np.flatnonzero(labels == classes[c]))
        if owners and rows.size < len(owners):
            raise ValueError(f"class {classes[c]} has {rows.size} rows for {len(owners)} clients")
        for client, piece in zip(owners, np.array_split(rows, len(owners)), strict=True):
            parts[client].append(piece)
    return [np.sort(np.concatenate(p)) for p in parts]


def imbalanced_st_indices(labels: np.ndarray, n_keep: int = 100,
                          minority: np.ndarray | None = None) -> np.ndarray:
    """The paper's "-ST" construction (Appendix B, after Qi et al.): every class in the first half of
    the classes keeps only its **last** ``n_keep`` rows in file order; the others keep all. Returns the
    kept row indices, increasing. ``minority`` overrides which classes are cut."""
    labels = np.asarray(labels)
    classes = np.unique(labels)
    minority = classes[: classes.size // 2] if minority is None else np.asarray(minority)
    keep = np.ones(labels.size, dtype=bool)
    for cls in minority:
        rows = np.flatnonzero(labels == cls)
        if rows.size < n_keep:
            raise ValueError(f"class {cls} has {rows.size} rows, fewer than n_keep={n_keep}")
        keep[rows[: rows.size - n_keep]] = False
    return np.flatnonzero(keep)
