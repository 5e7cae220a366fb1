"""Vertical partitions: random (the paper), contiguous (the AVFL code), user-given (validated)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from vertical.partition import block_of, blocks_from_columns, contiguous_blocks, random_blocks


def assert_partition(blocks: list[np.ndarray], n_features: int) -> None:
    joined = np.concatenate(blocks)
    assert np.array_equal(np.sort(joined), np.arange(n_features)), "blocks must be disjoint and cover all"
    for block in blocks:
        assert block.dtype == np.int64
        assert np.all(np.diff(block) > 0), "each block is sorted"


@pytest.mark.parametrize(("n_features", "q"), [(123, 4), (90, 8), (5, 5), (7, 1), (300, 7)])
def test_random_blocks_is_a_near_equal_partition(n_features: int, q: int) -> None:
    blocks = random_blocks(n_features, q, seed=3)
    assert len(blocks) == q
    assert_partition(blocks, n_features)
    sizes = [b.size for b in blocks]
    assert max(sizes) - min(sizes) <= 1


def test_random_blocks_is_deterministic_for_a_seed_and_random_across_seeds() -> None:
    first, again = random_blocks(123, 4, seed=11), random_blocks(123, 4, seed=11)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    other = random_blocks(123, 4, seed=12)
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))
    assert not np.array_equal(first[0], np.arange(first[0].size)), "not a contiguous split in disguise"


@pytest.mark.parametrize("q", [0, -1, 11])
def test_bad_party_counts_are_rejected(q: int) -> None:
    with pytest.raises(ValueError, match="number of parties q"):
        random_blocks(10, q, seed=0)
    with pytest.raises(ValueError, match="number of parties q"):
        contiguous_blocks(10, q)


def test_contiguous_blocks_give_the_remainder_to_the_first_ranks() -> None:
    blocks = contiguous_blocks(10, 3)
    assert [b.tolist() for b in blocks] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert_partition(contiguous_blocks(90, 8), 90)


def test_blocks_from_columns_sorts_and_accepts_a_partition() -> None:
    blocks = blocks_from_columns([[3, 0], [1], [4, 2]], 5)
    assert [b.tolist() for b in blocks] == [[0, 3], [1], [2, 4]]


@pytest.mark.parametrize(("columns", "message"), [
    ([[0, 1], [1, 2, 3]], "column 1 is held by both party 0 and party 1"),
    ([[0, 1], [2]], "1 column\\(s\\) are held by no party, e.g. column 3"),
    ([[0, 1, 4], [2, 3]], "party 0: column 4 is outside 0..3"),
    ([[0, -1], [1, 2, 3]], "party 0: column -1 is outside"),
    ([[0, 0, 1], [2, 3]], "party 0: column 0 is listed twice"),
    ([[0, 1, 2, 3], []], "party 1: expected a non-empty list"),
    ([[0.0, 1.0], [2, 3]], "party 0: column indices must be integers"),
    ([], "at least one party"),
])
def test_blocks_from_columns_names_the_problem(columns: list[list[int]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        blocks_from_columns(columns, 4)


def test_block_of_keeps_csr_and_matches_dense_slicing() -> None:
    rng = np.random.default_rng(0)
    dense = rng.normal(size=(20, 9)) * (rng.random((20, 9)) < 0.3)
    block = np.array([1, 4, 8])
    part = block_of(sp.csr_matrix(dense), block)
    assert sp.isspmatrix_csr(part) and part.has_sorted_indices
    assert np.array_equal(part.toarray(), dense[:, block])
    dense_part = block_of(dense, block)
    assert isinstance(dense_part, np.ndarray) and dense_part.flags.c_contiguous
    assert np.array_equal(dense_part, dense[:, block])


def test_auto_column_order_renumbers_only_wide_blocks() -> None:
    from vertical.partition import AUTO_FREQUENCY_WIDTH, order_columns

    rng = np.random.default_rng(0)
    for width in (1000, AUTO_FREQUENCY_WIDTH + 1):
        block = np.arange(width, dtype=np.int64) * 3
        counts = np.zeros(3 * width, dtype=np.int64)
        counts[block] = rng.integers(0, 50, size=width)
        ordered = order_columns(block, counts, "auto")
        if width <= AUTO_FREQUENCY_WIDTH:
            assert ordered is block
        else:
            assert np.all(np.diff(counts[ordered]) <= 0) and sorted(ordered.tolist()) == block.tolist()
        assert order_columns(block, counts, "index") is block
    with pytest.raises(ValueError, match="unknown column order"):
        order_columns(block, counts, "popular")
