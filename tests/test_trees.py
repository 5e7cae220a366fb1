"""Tree pairs: the paper's example, the q = 3 leaky and secure pairs (caveat 3 of
docs/secure-aggregation.md), the seeded construction, both checks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from protocols.trees import (
    InsecureTreePairError,
    Tree,
    TreePair,
    build_all_tree_pairs,
    build_tree_pair,
    check_no_leak,
    is_significantly_different,
    leakage_report,
    paper_example_pair,
    validate_tree_pair,
)


def test_paper_fig5_pair_passes_both_checks() -> None:
    pair = paper_example_pair()
    assert pair.root == 0 and pair.size == 4
    assert pair.t1.subtree(2) == {2, 3} and pair.t2.subtree(1) == {1, 3}  # the paper's {3,4} and {2,4}
    assert is_significantly_different(pair.t1, pair.t2)
    assert check_no_leak(pair)
    validate_tree_pair(pair)


def test_spec_q3_counterexample_is_rejected_and_the_leak_named() -> None:
    # ((1,2),3) and ((1,3),2), both aggregated at party 1: in parent-pointer form both are the star at 0.
    star = Tree((-1, 0, 0))
    pair = TreePair(star, star)
    report = leakage_report(pair)
    assert not report.ok
    root_view = report.parties[0]
    assert root_view.exposed_parties == (1, 2)  # the root learns o_2 and o_3 individually
    assert "learns o of parties [1, 2]" in str(report)
    with pytest.raises(InsecureTreePairError):
        validate_tree_pair(pair)


def test_spec_q3_secure_pair_star_and_chain_passes() -> None:
    pair = TreePair(Tree((-1, 0, 0)), Tree((-1, 2, 0)))  # T2: 1 -> 2 -> 0
    assert is_significantly_different(pair.t1, pair.t2)
    assert check_no_leak(pair)


def test_leak_check_names_a_non_root_party_that_unmasks_a_child() -> None:
    # Party 2 sends o_2 + δ_2 to party 1 in T1 and δ_2 to party 1 in T2.
    pair = TreePair(Tree((-1, 0, 1, 0)), Tree((-1, 0, 1, 1)))
    leaky = [p for p in leakage_report(pair).parties if p.leaks]
    assert [(p.party, p.exposed_parties) for p in leaky] == [(1, (2,))]
    assert not is_significantly_different(pair.t1, pair.t2)


def test_definition4_and_leak_check_are_different_tests() -> None:
    # Two opposite chains share the proper subtree {1, 2} but nobody can unmask anything.
    pair = TreePair(Tree((-1, 0, 1)), Tree((-1, 2, 0)))
    assert not is_significantly_different(pair.t1, pair.t2)
    assert check_no_leak(pair)


def _brute_force_subtree_sets(tree: Tree) -> set[frozenset[int]]:
    """Every {v} ∪ S(C) for a node v and a non-empty subset C of its children, proper and of size > 1."""
    sets = set()
    for v in range(tree.size):
        kids = tree.children[v]
        for k in range(1, len(kids) + 1):
            for chosen in itertools.combinations(kids, k):
                members = frozenset({v}.union(*(tree.subtree(c) for c in chosen)))
                if 1 < len(members) < tree.size:
                    sets.add(members)
    return sets


def _random_tree(rng: np.random.Generator, q: int, root: int) -> Tree:
    order = [root, *(int(p) for p in rng.permutation([p for p in range(q) if p != root]))]
    parent = [-1] * q
    for k in range(1, q):
        parent[order[k]] = order[int(rng.integers(0, k))]
    return Tree(tuple(parent))


def test_definition4_closure_matches_brute_force_enumeration() -> None:
    rng = np.random.default_rng(5)
    outcomes = set()
    for _ in range(400):
        q = int(rng.integers(3, 8))
        root = int(rng.integers(0, q))
        t1, t2 = _random_tree(rng, q, root), _random_tree(rng, q, root)
        expected = not (_brute_force_subtree_sets(t1) & _brute_force_subtree_sets(t2))
        assert is_significantly_different(t1, t2) == expected, (t1.parent, t2.parent)
        outcomes.add(expected)
    assert outcomes == {True, False}


@pytest.mark.parametrize("q", range(3, 13))
def test_seeded_pairs_pass_both_checks_for_every_root(q: int) -> None:
    pairs = build_all_tree_pairs(q, seed=7)
    assert [p.root for p in pairs] == list(range(q))
    for pair in pairs:
        assert pair.t1 != pair.t2
        assert is_significantly_different(pair.t1, pair.t2)
        assert check_no_leak(pair)


def test_construction_is_deterministic_and_depends_on_the_seed() -> None:
    assert build_tree_pair(8, 3, seed=1) == build_tree_pair(8, 3, seed=1)
    assert len({build_tree_pair(8, 3, seed=s) for s in range(10)}) > 1
    # heap-shaped: depth grows like log2(q), keeping the critical path short
    assert max(build_tree_pair(16, 0, seed=0).t1.depth(), build_tree_pair(16, 0, seed=0).t2.depth()) == 4


def test_q3_uses_a_star_and_a_chain() -> None:
    pair = build_tree_pair(3, 1, seed=0)
    assert set(pair.t1.children[1]) == {0, 2}
    assert pair.t2.depth() == 2


def test_q2_is_refused_with_the_reason_unless_opted_in() -> None:
    with pytest.raises(InsecureTreePairError, match="inherently leaky"):
        build_tree_pair(2, 0, seed=0)
    pair = build_tree_pair(2, 1, seed=0, allow_leaky_q2=True)
    assert pair.root == 1 and pair.t1.parent == (1, -1)
    validate_tree_pair(pair, allow_leaky_q2=True)
    with pytest.raises(InsecureTreePairError, match="q = 2"):
        validate_tree_pair(pair)


@pytest.mark.parametrize("parent", [(0, 1), (-1, -1, 0), (-1, 2, 1), (-1, 5, 0), (-1,)])
def test_malformed_trees_are_rejected(parent: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        Tree(parent)


def test_pairs_must_share_root_and_size() -> None:
    with pytest.raises(ValueError, match="same root"):
        TreePair(Tree((-1, 0, 0)), Tree((1, -1, 1)))
    with pytest.raises(ValueError, match="root must be a party"):
        build_tree_pair(4, 4, seed=0)
