"""Aggregation tree pairs for Algorithm 1 of VFB²: construction from a shared seed, and both security checks.

A secure aggregation towards a root party ``r`` sends every party's masked value ``o_l + δ_l`` up a tree
``T1`` and its mask ``δ_l`` up a second tree ``T2``; the root subtracts the two sums. Both trees are rooted
at ``r`` (the party that needs the result), so a job needs one pair per possible root.

Representation: a tree on parties ``0..q-1`` is a tuple of parent pointers, ``parent[root] ==
-1``. Every party keeps one accumulator holding its own value plus the sums its children forward, and
forwards it to its parent once all children are in.

Two checks decide whether a pair may be used:

* **Definition 4** ("significantly different", Gu et al. 2020a): no proper subtree of size > 1 of ``T1``
  has the same party set as one of ``T2``. *Decision*: a parent-pointer node folds its children in
  whatever order their messages arrive, so it stands for every binary tree that folds them one by one. We
  therefore count as a subtree every set ``{v} ∪ S(c_1) ∪ … ∪ S(c_k)`` for a node ``v`` and any non-empty
  subset of its children (``S(c)`` = ``c`` and its descendants). This is the strictest reading; it makes
  two identical trees fail, as they should. It is decided exactly in polynomial time (see
  :func:`is_significantly_different`).
* **Leak check** (rank test): model a single request with the ``2q`` unknowns ``(o_1..o_q, δ_1..δ_q)``.
  Each party observes its own ``o_v`` and ``δ_v`` and the linear forms its children send in both trees.
  The pure-``o`` combinations it can derive form the subspace ``rowspace(M) ∩ {δ = 0}`` whose dimension is
  ``rank(M) - rank(M_δ)``. It must be no larger than the unavoidable: ``span{e_v}``, plus the all-ones
  vector at the root (the output itself). Definition 4 alone is not sufficient (caveat 3 of
  docs/secure-aggregation.md).

Construction: for ``q >= 4``, heap-shaped binary trees over a random permutation of the
non-root parties, drawn from a generator seeded by ``(seed, q, root)`` and retried until both checks pass
(about half the candidates do). For ``q = 3``, heap trees are both stars and always leak, so ``T1`` is the
star and ``T2`` a chain whose order the seed picks. ``q = 2`` is inherently leaky: the root learns the
other party's value from the output alone, whatever the trees; it is refused unless asked for explicitly.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "InsecureTreePairError",
    "LeakageReport",
    "PartyLeakage",
    "Tree",
    "TreePair",
    "build_all_tree_pairs",
    "build_tree_pair",
    "check_no_leak",
    "is_significantly_different",
    "leakage_report",
    "paper_example_pair",
    "validate_tree_pair",
]

#: Candidates drawn before giving up; with about half of the candidates passing, never reached in practice.
MAX_ATTEMPTS = 10_000

Q2_REFUSAL = (
    "q = 2 is inherently leaky: the root learns z = o_root + o_other and knows o_root, so it learns the "
    "other party's partial product o_other exactly, whatever the trees (docs/secure-aggregation.md, "
    "caveat 2). Pass allow_leaky_q2=True to accept this explicitly."
)


class InsecureTreePairError(ValueError):
    """A tree pair fails Definition 4 or the leak check (or is the q = 2 pair without the opt-in)."""


@dataclass(frozen=True)
class Tree:
    """A rooted tree over parties ``0..q-1`` in parent-pointer form (``parent[root] == -1``)."""

    parent: tuple[int, ...]
    root: int = field(init=False)
    children: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _subtree_masks: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parent = tuple(int(p) for p in self.parent)
        q = len(parent)
        roots = [v for v, p in enumerate(parent) if p == -1]
        if q < 2 or len(roots) != 1:
            raise ValueError(f"a tree needs >= 2 parties and exactly one root (parent -1), got {parent}")
        if any(not (p == -1 or 0 <= p < q) or p == v for v, p in enumerate(parent)):
            raise ValueError(f"parent pointers must be -1 or another party in 0..{q - 1}, got {parent}")
        children: list[list[int]] = [[] for _ in range(q)]
        for v, p in enumerate(parent):
            if p != -1:
                children[p].append(v)
        order = _top_down_order(roots[0], children)
        if len(order) != q:
            raise ValueError(f"parent pointers contain a cycle (not every party reaches the root): {parent}")
        masks = [0] * q
        for v in reversed(order):
            masks[v] = (1 << v) | _union(masks[c] for c in children[v])
        object.__setattr__(self, "parent", parent)
        object.__setattr__(self, "root", roots[0])
        object.__setattr__(self, "children", tuple(tuple(c) for c in children))
        object.__setattr__(self, "_subtree_masks", tuple(masks))

    @property
    def size(self) -> int:
        return len(self.parent)

    def subtree(self, v: int) -> frozenset[int]:
        """The parties whose values party ``v`` forwards: ``v`` and all its descendants."""
        return frozenset(_bits(self._subtree_masks[v]))

    def heights(self) -> tuple[int, ...]:
        """Per party, the height of its subtree (0 for a leaf): how many hops of waiting can lie below it
        (a parent waiting for a child's sum staggers its deadline by it, protocols/liveness.py)."""
        heights = [0] * self.size
        for v in reversed(_top_down_order(self.root, self.children)):
            heights[v] = max((heights[c] + 1 for c in self.children[v]), default=0)
        return tuple(heights)

    def depth(self) -> int:
        """Longest path from a party to the root, in hops (the critical path of one aggregation)."""
        depths = [0] * self.size
        for v in _top_down_order(self.root, self.children):
            if v != self.root:
                depths[v] = depths[self.parent[v]] + 1
        return max(depths)

    @classmethod
    def heap(cls, root: int, order: Sequence[int]) -> Tree:
        """The binary heap over ``[root, *order]``: position ``k``'s parent is position ``(k - 1) // 2``."""
        nodes = [root, *order]
        parent = [-1] * len(nodes)
        for k in range(1, len(nodes)):
            parent[nodes[k]] = nodes[(k - 1) // 2]
        return cls(tuple(parent))


@dataclass(frozen=True)
class TreePair:
    """The two aggregation trees of one root: masked values go up ``t1``, masks up ``t2``."""

    t1: Tree
    t2: Tree

    def __post_init__(self) -> None:
        if self.t1.size != self.t2.size or self.t1.root != self.t2.root:
            raise ValueError(
                f"both trees must span the same parties with the same root; got sizes "
                f"{self.t1.size}/{self.t2.size} and roots {self.t1.root}/{self.t2.root}"
            )

    @property
    def root(self) -> int:
        return self.t1.root

    @property
    def size(self) -> int:
        return self.t1.size

    def tree(self, index: int) -> Tree:
        """``t1`` for index 0, ``t2`` for index 1 (the wire format numbers trees this way)."""
        return (self.t1, self.t2)[index]


# ---------------------------------------------------------------------------------------------- checks


def is_significantly_different(t1: Tree, t2: Tree) -> bool:
    """Definition 4: no proper subtree of size > 1 of ``t1`` has the party set of a subtree of ``t2``.

    Subtrees are read in the arrival-order-free sense of the module docstring. There can be exponentially
    many of them, so instead of listing them we look, for every pair of anchors ``(v in t1, u in t2)``, for
    the *smallest* party set that is a subtree anchored at ``v`` in ``t1`` and at ``u`` in ``t2`` at once:
    start from the parties any such set must contain and add the child subtrees that each tree forces,
    until stable. A common subtree exists iff one of these closures is proper (smaller than all parties).
    """
    if t1.size != t2.size:
        raise ValueError(f"trees span different numbers of parties: {t1.size} vs {t2.size}")
    everyone = (1 << t1.size) - 1
    for v in range(t1.size):
        for u in range(t2.size):
            # every common subtree anchored at (v, u) holds both anchors, and at v == u some child of v
            below_v = [(1 << v) | t1._subtree_masks[c] for c in t1.children[v]]
            seeds = [(1 << v) | (1 << u)] if u != v else below_v
            for seed in seeds:
                closed = _common_closure(seed, v, t1, u, t2)
                if closed is not None and closed != everyone:
                    return False
    return True


@dataclass(frozen=True)
class PartyLeakage:
    """What one party can derive about the parties' partial products from one request it takes part in."""

    party: int
    derivable_dimensions: int
    allowed_dimensions: int
    exposed_parties: tuple[int, ...]

    @property
    def leaks(self) -> bool:
        return self.derivable_dimensions > self.allowed_dimensions


@dataclass(frozen=True)
class LeakageReport:
    """Per-party outcome of the rank test; ``ok`` when no party learns more than the unavoidable."""

    root: int
    parties: tuple[PartyLeakage, ...]

    @property
    def ok(self) -> bool:
        return not any(p.leaks for p in self.parties)

    def __str__(self) -> str:
        lines = [f"leak check for root {self.root}: {'ok' if self.ok else 'LEAKS'}"]
        for p in self.parties:
            if p.leaks:
                exposed = f"; learns o of parties {list(p.exposed_parties)}" if p.exposed_parties else ""
                lines.append(f"  party {p.party} derives {p.derivable_dimensions} independent combinations "
                             f"of partial products (allowed {p.allowed_dimensions}){exposed}")
        return "\n".join(lines)


def leakage_report(pair: TreePair) -> LeakageReport:
    """Run the module docstring's leak check (rank test) for every party of ``pair`` (one request, fresh
    masks)."""
    q = pair.size
    reports = []
    for v in range(q):
        observations = _observations(pair, v)
        rank_all = np.linalg.matrix_rank(observations)
        derivable = int(rank_all - np.linalg.matrix_rank(observations[:, q:]))
        allowed = 2 if v == pair.root else 1
        exposed = []
        for other in range(q):
            if other == v:
                continue
            probe = np.zeros((1, 2 * q))
            probe[0, other] = 1.0
            if np.linalg.matrix_rank(np.vstack([observations, probe])) == rank_all:
                exposed.append(other)
        reports.append(PartyLeakage(v, derivable, allowed, tuple(exposed)))
    return LeakageReport(pair.root, tuple(reports))


def check_no_leak(pair: TreePair) -> bool:
    """True when no party can derive more than its own product (and, at the root, the output)."""
    return leakage_report(pair).ok


def validate_tree_pair(pair: TreePair, *, allow_leaky_q2: bool = False) -> None:
    """Raise :class:`InsecureTreePairError` unless ``pair`` passes both checks (q = 2: only on opt-in)."""
    if pair.size == 2:
        if not allow_leaky_q2:
            raise InsecureTreePairError(Q2_REFUSAL)
        return
    if not is_significantly_different(pair.t1, pair.t2):
        raise InsecureTreePairError(
            f"trees {pair.t1.parent} and {pair.t2.parent} share a proper subtree (fail Definition 4)"
        )
    report = leakage_report(pair)
    if not report.ok:
        raise InsecureTreePairError(str(report))


# ---------------------------------------------------------------------------------------- construction


def build_tree_pair(q: int, root: int, seed: int, *, allow_leaky_q2: bool = False) -> TreePair:
    """A validated tree pair for ``q`` parties rooted at ``root``, the same at every party given ``seed``."""
    _check_q_root(q, root)
    if q == 2:
        if not allow_leaky_q2:
            raise InsecureTreePairError(Q2_REFUSAL)
        only = Tree.heap(root, [1 - root])
        return TreePair(only, only)
    rng = np.random.default_rng([int(seed) & 0xFFFF_FFFF_FFFF_FFFF, q, root])
    others = [p for p in range(q) if p != root]
    if q == 3:
        chain = [int(p) for p in rng.permutation(others)]  # chain[0] -> chain[1] -> root
        t2 = Tree(tuple(-1 if p == root else (chain[1] if p == chain[0] else root) for p in range(q)))
        pair = TreePair(Tree.heap(root, others), t2)
        validate_tree_pair(pair)
        return pair
    for _ in range(MAX_ATTEMPTS):
        pair = TreePair(Tree.heap(root, _permuted(rng, others)), Tree.heap(root, _permuted(rng, others)))
        if is_significantly_different(pair.t1, pair.t2) and check_no_leak(pair):
            return pair
    raise RuntimeError(f"no secure tree pair found for q={q}, root={root} in {MAX_ATTEMPTS} candidates")


@functools.lru_cache(maxsize=64)
def build_all_tree_pairs(q: int, seed: int, *, allow_leaky_q2: bool = False) -> tuple[TreePair, ...]:
    """One validated pair per root, indexed by root. Deterministic, so every party builds the same set."""
    return tuple(build_tree_pair(q, r, seed, allow_leaky_q2=allow_leaky_q2) for r in range(q))


def paper_example_pair() -> TreePair:
    """The paper's Fig. 5 pair (q = 4, root = party 1), with parties 1..4 numbered 0..3.

    T1: 1 aggregates {1, 2}, 3 aggregates {3, 4}, then 1 adds 3's sum. T2: 1 aggregates {1, 3}, 2
    aggregates {2, 4}, then 1 adds 2's sum.
    """
    return TreePair(Tree((-1, 0, 0, 2)), Tree((-1, 0, 0, 1)))


# ------------------------------------------------------------------------------------------- internals


def _check_q_root(q: int, root: int) -> None:
    if q < 2:
        raise ValueError(f"secure aggregation needs at least 2 parties, got q={q}")
    if not 0 <= root < q:
        raise ValueError(f"root must be a party in 0..{q - 1}, got {root}")


def _permuted(rng: np.random.Generator, items: list[int]) -> list[int]:
    return [int(p) for p in rng.permutation(items)]


def _top_down_order(root: int, children: Sequence[Sequence[int]]) -> list[int]:
    order, stack = [], [root]
    while stack:
        v = stack.pop()
        order.append(v)
        stack.extend(children[v])
    return order


def _bits(mask: int) -> Iterator[int]:
    v = 0
    while mask:
        if mask & 1:
            yield v
        mask >>= 1
        v += 1


def _union(masks: Iterator[int]) -> int:
    out = 0
    for m in masks:
        out |= m
    return out


def _close_in(tree: Tree, anchor: int, members: int) -> int | None:
    """Smallest ``{anchor} ∪ (union of child subtrees of anchor)`` containing ``members``, or None."""
    closed = members | (1 << anchor)
    for a in _bits(members & ~(1 << anchor)):
        child = a
        while child != -1 and tree.parent[child] != anchor:
            child = tree.parent[child]
        if child == -1:  # a is not below the anchor
            return None
        closed |= tree._subtree_masks[child]
    return closed


def _common_closure(seed: int, v: int, t1: Tree, u: int, t2: Tree) -> int | None:
    current = seed
    while True:
        in_t1 = _close_in(t1, v, current)
        in_both = None if in_t1 is None else _close_in(t2, u, in_t1)
        if in_both is None or in_both == current:
            return in_both
        current = in_both


def _observations(pair: TreePair, v: int) -> np.ndarray:
    """Linear forms over ``(o_0..o_{q-1}, δ_0..δ_{q-1})`` that party ``v`` observes in one request."""
    q = pair.size
    rows = [np.eye(2 * q)[v], np.eye(2 * q)[q + v]]
    for child in pair.t1.children[v]:
        row = np.zeros(2 * q)
        members = list(pair.t1.subtree(child))
        row[members] = 1.0
        row[[q + m for m in members]] = 1.0
        rows.append(row)
    for child in pair.t2.children[v]:
        row = np.zeros(2 * q)
        row[[q + m for m in pair.t2.subtree(child)]] = 1.0
        rows.append(row)
    return np.vstack(rows)
