"""Client partitions (label shards, Dirichlet, IID) and the client-contiguous data layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from horizontal import FederatedData, dirichlet_partition, iid_partition, shard_partition


def assert_exact_cover(parts: list[np.ndarray], n_rows: int) -> None:
    everything = np.concatenate(parts)
    assert everything.size == n_rows
    assert np.array_equal(np.sort(everything), np.arange(n_rows))


def test_fmnist_shaped_shards_give_every_client_300_rows_of_at_most_two_classes() -> None:
    labels = np.repeat(np.arange(10), 6000)                 # Fashion-MNIST: 6,000 per class
    parts = shard_partition(labels, n_clients=200, shards_per_client=2, rng=np.random.default_rng(0))
    assert_exact_cover(parts, labels.size)
    assert all(p.size == 300 for p in parts)                 # 400 shards of 150, one class each
    for p in parts:
        classes, counts = np.unique(labels[p], return_counts=True)
        assert classes.size <= 2
        assert all(c % 150 == 0 for c in counts)             # whole one-class shards only
    assert np.mean([np.unique(labels[p]).size for p in parts]) > 1.8


def test_unbalanced_classes_still_get_one_class_shards() -> None:
    rng = np.random.default_rng(1)
    labels = rng.choice(5, size=997, p=[0.4, 0.3, 0.15, 0.1, 0.05])
    parts = shard_partition(labels, n_clients=20, shards_per_client=2, rng=rng)
    assert_exact_cover(parts, labels.size)
    assert all(np.unique(labels[p]).size <= 2 for p in parts)


def test_partitions_are_reproducible_from_the_seed() -> None:
    labels = np.repeat(np.arange(4), 50)
    a = shard_partition(labels, 10, 2, np.random.default_rng(7))
    b = shard_partition(labels, 10, 2, np.random.default_rng(7))
    c = shard_partition(labels, 10, 2, np.random.default_rng(8))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_dirichlet_skew_grows_as_alpha_shrinks() -> None:
    labels = np.repeat(np.arange(10), 200)

    def mean_classes(alpha: float) -> float:
        parts = dirichlet_partition(labels, 20, alpha, np.random.default_rng(0), min_size=5)
        assert_exact_cover(parts, labels.size)
        assert min(p.size for p in parts) >= 5
        return float(np.mean([np.unique(labels[p]).size for p in parts]))

    assert mean_classes(0.1) < 5 < mean_classes(100.0)


def test_iid_partition_is_balanced() -> None:
    parts = iid_partition(103, 10, np.random.default_rng(0))
    assert_exact_cover(parts, 103)
    assert {p.size for p in parts} == {10, 11}


def test_partition_errors_are_clear() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="at least one row"):
        iid_partition(5, 6, rng)
    with pytest.raises(ValueError, match="alpha"):
        dirichlet_partition(np.zeros(10), 2, 0.0, rng)
    with pytest.raises(ValueError, match="classes"):
        shard_partition(np.arange(10), 2, 2, rng)
    with pytest.raises(ValueError, match="no Dirichlet"):
        dirichlet_partition(np.repeat(np.arange(2), 10), 10, 0.01, rng, min_size=2, max_tries=3)


def test_client_contiguous_layout_and_minibatches_from_own_rows() -> None:
    X = np.arange(20, dtype=np.float64).reshape(10, 2)       # row r holds (2r, 2r + 1)
    y = np.arange(10)
    parts = [np.array([9, 0]), np.array([3, 4, 5]), np.array([1, 2, 6, 7, 8])]
    data = FederatedData.from_partition(X, y, parts)
    assert data.n_clients == 3
    assert data.sizes.tolist() == [2, 3, 5]
    assert data.client(1)[1].tolist() == [3, 4, 5]
    gen = torch.Generator().manual_seed(0)
    clients = torch.tensor([0, 2])
    seen: list[set[int]] = [set(), set()]
    for _ in range(50):
        Xb, yb = data.sample_batches(clients, 4, gen)
        assert Xb.shape == (2, 4, 2) and yb.shape == (2, 4)
        assert torch.equal(Xb[..., 0], 2 * yb.to(Xb.dtype))   # features travel with their labels
        for j in range(2):
            seen[j] |= set(yb[j].tolist())
    assert seen == [{9, 0}, {1, 2, 6, 7, 8}]                  # every own row drawn, nothing else
    with pytest.raises(ValueError, match="equal client sizes"):
        data.sample_batches(clients, None, gen)
    with pytest.raises(ValueError, match="holds no rows"):
        FederatedData.from_partition(X, y, [np.array([0]), np.array([], dtype=int)])
