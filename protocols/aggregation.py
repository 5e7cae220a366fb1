"""The secure-aggregation protocol (Algorithm 1 of VFB²) as a sans-IO state machine.

An :class:`AggregationNode` is one party's share of the protocol. It never touches a network: the caller
feeds it what arrives (:meth:`~AggregationNode.receive`) and what the party wants
(:meth:`~AggregationNode.announce`, :meth:`~AggregationNode.start`), and sends the :class:`Outgoing`
messages it returns. The blocking library call (:mod:`protocols.secure_aggregation`) and the VFB² runtime's
communication thread drive the same node, so both speak the same protocol and share every test.

One request ``(root, rid)``:

1. The root allocates ``rid`` (:meth:`~AggregationNode.announce`, or
   :meth:`~AggregationNode.claim_request_id` when every party already knows the request, as in a collective
   call) and, when the parties must compute something first, sends ``REQUEST`` with the sample indices to
   every other party, which turns into a :class:`Requested` event there.
2. Every party, the root included, calls ``start(root, rid, local_values)``: it draws fresh masks δ and
   contributes ``o + δ`` to tree 1 and ``δ`` to tree 2 of the root's :class:`~protocols.trees.TreePair`.
3. A party forwards a tree's accumulator to its parent in that tree once it has started and heard from all
   its children there; its state for the request is freed once both trees are forwarded.
4. The root emits :class:`Completed` once both sums are in; ``z = ξ1 - ξ2``.

Messages of different requests never mix: every message carries ``(root, rid)`` and every party keys its
accumulators by it. A child's message may arrive before the party has started the request (MPI orders
messages per sender only); it is kept and counted.

Wire format: one contiguous ``uint64`` array, a 4-word header ``[kind, root, rid, aux]`` followed by the
payload: ``B`` sample indices (int64 bits) for ``REQUEST``, ``B`` words of partial sums otherwise. One
buffer per message, no pickle; a forwarded accumulator is sent in the buffer it was summed in.

``aux`` is the *overflow flag*, masked like a value: every party counts its entries that could not be
encoded (see :mod:`protocols.masking`), draws one more fresh mask word ``ε`` and contributes
``count + ε`` (mod 2**64) up tree 1 and ``ε`` up tree 2; inner nodes add the words like the payload. Only
the root, which subtracts the two sums, learns the total count; a parent sees uniformly random words and
cannot tell which child (if any) overflowed. (In clear, the count per child told its parent exactly that.)
``aux`` is 0 in ``REQUEST``.

Validation (the receive boundary): :meth:`AggregationNode.receive` checks every header field against
what this node can expect (a known kind, a root in ``0..q - 1``, a sender that may send this kind, a
request id that is new for a ``REQUEST`` and not yet finished nor absurdly far ahead for a tree sum, a
payload of ``1..max_batch`` words, exactly ``batch`` indices (``REQUEST``) or ``batch × width`` values
(a partial sum of a k-wide contribution) where the job fixes them, that matches the other
contributions) and raises
:class:`~protocols.errors.ProtocolViolation` naming the sender otherwise. Children are checked against
the tree as soon as the party has started the request.

Request ids are per-root sequence numbers starting at 0. In collective use every party advances the same
counters in the same order; in the runtime only roots allocate them and the others learn them from
``REQUEST``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from protocols.errors import ProtocolError, ProtocolViolation
from protocols.masking import (
    AggregationOverflowError,
    FixedPointRing,
    Keystream,
    MaskingScheme,
    Words,
    as_real_vector,
)
from protocols.trees import TreePair, validate_tree_pair

__all__ = [
    "DEFAULT_MAX_BATCH",
    "HEADER_WORDS",
    "MAX_OPEN_PER_ROOT",
    "AggregationNode",
    "Completed",
    "Header",
    "Kind",
    "Outgoing",
    "ProtocolError",
    "ProtocolViolation",
    "Requested",
    "Step",
    "header_of",
]

HEADER_WORDS = 4
#: Largest payload (values per request) a node accepts by default: 2**24 values, a 128 MiB message. The
#: batched full passes of the runtime aggregate one value per training row.
DEFAULT_MAX_BATCH = 1 << 24
#: How far ahead of its oldest unfinished request of a root a tree sum may be by default: requests of one
#: root finish roughly in order at every party, so a request id beyond this is garbage, not a slow request.
#: It also bounds what a flood of far-ahead tree sums can make a party hold (``max_open``).
MAX_OPEN_PER_ROOT = 1 << 16
_WORD = (1 << 64) - 1


class Kind(IntEnum):
    """What a message carries (header word 0)."""

    REQUEST = 1  # root -> every other party: sample indices
    MASKED = 2  # up tree 1: partial sum of o + δ
    MASKS = 3  # up tree 2: partial sum of δ


_KINDS = {int(kind): kind for kind in Kind}
_NAMES = {int(kind): kind.name for kind in Kind}  # an enum's .name is a descriptor call: not per message
_REQUEST, _MASKED, _MASKS = int(Kind.REQUEST), int(Kind.MASKED), int(Kind.MASKS)


class Header(NamedTuple):
    kind: Kind
    root: int
    rid: int
    aux: int


def header_of(buffer: Words) -> Header:
    """Decode the header of a message buffer."""
    code, root, rid, aux = buffer[:HEADER_WORDS].tolist()
    kind = _KINDS.get(code)
    if kind is None:
        raise ProtocolError(f"unknown message kind {code} in header {buffer[:HEADER_WORDS]}")
    return Header(kind, root, rid, aux)


class Outgoing(NamedTuple):
    """A message to send: the whole ``uint64`` buffer (header + payload) goes to rank ``dest``."""

    dest: int
    buffer: Words


class Requested(NamedTuple):
    """A root asked this party to take part in request ``(root, rid)`` over these sample indices."""

    root: int
    rid: int
    indices: NDArray[np.int64]


@dataclass(frozen=True)
class Completed:
    """Both sums of request ``(root, rid)`` are in at the root."""

    root: int
    rid: int
    values: NDArray[np.float64]
    out_of_range: int

    def result(self) -> NDArray[np.float64]:
        """The aggregated values; raises if some party's entries could not be encoded."""
        if self.out_of_range:
            raise AggregationOverflowError(
                f"request ({self.root}, {self.rid}): {self.out_of_range} contributed value(s) were NaN/inf "
                f"or too large for the fixed-point encoding; the sum would be wrong. Scale the values "
                f"down or use fewer fraction bits."
            )
        return self.values


class Step(NamedTuple):
    """What a node call produced: messages to send, and at most one event for the caller."""

    outgoing: list[Outgoing]
    event: Requested | Completed | None = None


@dataclass(frozen=True, slots=True)
class _Role:
    """This party's place in one tree pair: parents and children (as a bitmask) in both trees."""

    parents: tuple[int, int]
    children: tuple[int, int]

    @classmethod
    def of(cls, pair: TreePair, rank: int) -> _Role:
        masks = tuple(sum(1 << c for c in tree.children[rank]) for tree in (pair.t1, pair.t2))
        return cls((pair.t1.parent[rank], pair.t2.parent[rank]), masks)


class _Request:
    """Per-(root, rid) state: the two accumulators (full message buffers) and who has been heard."""

    __slots__ = ("forwarded", "heard", "role", "totals")

    def __init__(self, role: _Role | None = None) -> None:
        self.role = role  # known once started
        self.totals: list[Words | None] = [None, None]
        self.heard = [0, 0]
        self.forwarded = [False, False]


class _Finished:
    """The request ids of one root that this party is done with: all below ``below``, plus ``above``.

    Requests finish roughly in order, so ``above`` stays small; a late or repeated tree sum for a
    finished request is then recognised as a duplicate instead of opening a new request that never ends.
    """

    __slots__ = ("above", "below")

    def __init__(self) -> None:
        self.below = 0
        self.above: set[int] = set()

    def add(self, rid: int) -> None:
        self.above.add(rid)
        while self.below in self.above:
            self.above.remove(self.below)
            self.below += 1

    def __contains__(self, rid: int) -> bool:
        return rid < self.below or rid in self.above


class AggregationNode:
    """One party's protocol state for all concurrent secure aggregations towards any root.

    ``tree_pairs[r]`` is the pair used for requests of root ``r`` (e.g.
    :func:`~protocols.trees.build_all_tree_pairs`); every pair is validated here. Not thread-safe: one
    thread (the library call, or the runtime's communication thread) drives a node.
    """

    def __init__(self, rank: int, size: int, tree_pairs: Sequence[TreePair], *,
                 masking: MaskingScheme | None = None, allow_leaky_q2: bool = False,
                 max_batch: int = DEFAULT_MAX_BATCH, roots: Collection[int] | None = None,
                 max_open: int = MAX_OPEN_PER_ROOT, batch: int | None = None, width: int = 1) -> None:
        if max_batch < 1 or max_open < 1:
            raise ValueError(f"max_batch and max_open must be at least 1, got {max_batch} and {max_open}")
        if width < 1:
            raise ValueError(f"width must be at least 1, got {width}")
        if batch is not None and not 1 <= batch <= max_batch // width:
            raise ValueError(f"batch must be in 1..{max_batch // width}, got {batch}")
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not a party of 0..{size - 1}")
        if len(tree_pairs) != size:
            raise ValueError(f"need one tree pair per root ({size}), got {len(tree_pairs)}")
        for root, pair in enumerate(tree_pairs):
            if pair.size != size or pair.root != root:
                raise ValueError(f"tree_pairs[{root}] spans {pair.size} parties with root {pair.root}; "
                                 f"expected {size} parties with root {root}")
            validate_tree_pair(pair, allow_leaky_q2=allow_leaky_q2)
        self.rank = rank
        self.size = size
        self.masking = masking if masking is not None else FixedPointRing()
        self._allow_leaky_q2 = allow_leaky_q2
        self._roles = [_Role.of(pair, rank) for pair in tree_pairs]
        #: per root, per tree, each party's subtree height (how long a wait for its sum may cascade)
        self._heights = [(pair.t1.heights(), pair.t2.heights()) for pair in tree_pairs]
        self._validated_pairs: set[TreePair] = set(tree_pairs)
        self._keystream = Keystream()
        self._next_rid = [0] * size
        self._requests: dict[tuple[int, int], _Request] = {}
        self.max_batch = max_batch
        #: request ids of one root this party accepts beyond its oldest unfinished one: what it may hold
        #: per root is at most ``max_open`` requests of two partial sums of ``max_batch`` values
        self.max_open = max_open
        self._finished = [_Finished() for _ in range(size)]
        self._requested: list[set[int]] = [set() for _ in range(size)]  # per root: REQUESTs not finished
        #: who may root a request (the dominators: label holders), checked on every message received.
        #: A party that could root one would read the model's score of any row it names (sign(z) = y on
        #: 83 % of a9a) and make every party compute for it.
        self.roots = frozenset(range(size) if roots is None else roots)
        #: every request's length, when the job fixes it (the runtime's B): a REQUEST of another length
        #: is its root's fault, a partial sum of another length its sender's. Without it, a root that
        #: sent REQUESTs of different lengths got the honest party whose sum disagreed blamed.
        self.batch = batch
        #: values per row of a partial sum (a network's cut layer k; 1 for w·x): a request for B rows
        #: names B indices and sums B·width values
        self.width = width
        if not self.roots <= set(range(size)):
            raise ValueError(f"roots {sorted(self.roots)} are not all parties of 0..{size - 1}")

    # ------------------------------------------------------------------------------ what a party does

    def claim_request_id(self, root: int) -> int:
        """The next request id of ``root`` (per-root sequence). Every party calls it in collective use."""
        rid = self._next_rid[root]
        self._next_rid[root] = rid + 1
        return rid

    def announce(self, indices: NDArray[np.integer]) -> tuple[int, list[Outgoing]]:
        """At a root: allocate a request id and build the ``REQUEST`` messages to every other party.

        The root then computes its own local values and calls :meth:`start` like everyone else.
        """
        if self.rank not in self.roots:
            raise ValueError(f"party {self.rank} is not one of the roots {sorted(self.roots)}")
        rid = self.claim_request_id(self.rank)
        payload = np.ascontiguousarray(indices, dtype=np.int64).view(np.uint64)
        outgoing = []
        for dest in range(self.size):
            if dest != self.rank:
                buffer = np.empty(HEADER_WORDS + payload.size, dtype=np.uint64)
                buffer[:HEADER_WORDS] = (Kind.REQUEST, self.rank, rid, 0)
                buffer[HEADER_WORDS:] = payload
                outgoing.append(Outgoing(dest, buffer))
        return rid, outgoing

    def start(self, root: int, rid: int, values: NDArray[np.float64], *,
              tree_pair: TreePair | None = None) -> Step:
        """Contribute this party's ``values`` to request ``(root, rid)``: mask, merge, forward if ready.

        ``tree_pair`` overrides the root's configured pair for this request (all parties must agree).
        """
        values = as_real_vector(values, "local values")
        role = self._role(root, tree_pair)
        key = (root, rid)
        state = self._requests.get(key)
        if state is None:
            state = self._requests[key] = _Request(role)
        elif state.role is not None:
            raise ProtocolError(f"request {key} started twice at party {self.rank}")
        else:
            state.role = role
            for tree in (0, 1):
                unexpected = state.heard[tree] & ~role.children[tree]
                if unexpected:
                    raise ProtocolViolation(_ranks(unexpected)[0], Kind(_MASKED + tree).name,
                                            f"party {self.rank} got tree-{tree + 1} sums for {key} from "
                                            f"non-children {_ranks(unexpected)}")
        size = HEADER_WORDS + values.size
        masked = np.empty(size, dtype=np.uint64)
        masks = np.empty(size, dtype=np.uint64)
        out_of_range = self.masking.share(values, self.size, self._keystream,
                                          masked[HEADER_WORDS:], masks[HEADER_WORDS:])
        flag_mask = self._keystream.word()  # the overflow count travels masked, like the values
        masked[3] = (out_of_range + flag_mask) & _WORD
        masks[3] = flag_mask
        totals = state.totals
        for tree, own in ((0, masked), (1, masks)):
            arrived = totals[tree]
            if arrived is None:
                totals[tree] = own
            else:
                self._add(arrived, own, key)
        return self._advance(key, state)

    def receive(self, source: int, buffer: Words, *, n_rows: int | None = None) -> Step:
        """Handle one message from ``source``. The node takes ownership of ``buffer``.

        Every header field and the payload length are checked first (see the module docstring);
        ``n_rows``, when given, also bounds the sample indices of a ``REQUEST`` (``0..n_rows - 1``).
        Raises :class:`~protocols.errors.ProtocolViolation` naming ``source``.
        """
        if not 0 <= source < self.size or source == self.rank:
            raise ValueError(f"party {self.rank} cannot receive from {source} (parties 0..{self.size - 1})")
        if not isinstance(buffer, np.ndarray) or buffer.dtype != np.uint64 or buffer.ndim != 1:
            raise ProtocolViolation(source, "aggregation message", "expected a 1-D uint64 buffer")
        if buffer.size <= HEADER_WORDS:
            raise ProtocolViolation(source, "aggregation message", f"{buffer.size} words is truncated (a "
                                    f"{HEADER_WORDS}-word header and at least one payload word)")
        code, root, rid, aux = buffer[:HEADER_WORDS].tolist()
        if code not in _KINDS:
            raise ProtocolViolation(source, "aggregation message", f"unknown message kind {code} in header "
                                    f"{buffer[:HEADER_WORDS]}")
        what = _NAMES[code]
        if root not in self.roots:
            why = (f"is not a party of 0..{self.size - 1}" if root >= self.size else "is not a dominator: "
                   f"only {', '.join(map(str, sorted(self.roots)))} may root an aggregation")
            raise ProtocolViolation(source, what, f"root {root} {why}")
        payload = buffer.size - HEADER_WORDS
        if payload > self.max_batch:
            raise ProtocolViolation(source, what, f"{payload} values exceed the limit of {self.max_batch}")
        if self.batch is not None:
            expected = self.batch if code == _REQUEST else self.batch * self.width
            if payload != expected:
                noun = "request" if code == _REQUEST else "partial sum"
                raise ProtocolViolation(source, what, f"{payload} values where every {noun} of this job "
                                        f"has {expected}")
        if code == _REQUEST:
            return self._on_request(source, root, rid, aux, buffer, n_rows)
        return self._on_tree_sum(source, code, root, rid, buffer, what, payload)

    def _on_tree_sum(self, source: int, code: int, root: int, rid: int, buffer: Words, what: str,
                     payload: int) -> Step:
        """A child's partial sum for tree ``code - _MASKED``, its header already checked by :meth:`receive`:
        here the checks that need this request's state, then the sum is added or kept until ``start``."""
        finished = self._finished[root]
        if source == root:
            raise ProtocolViolation(source, what, f"the root of request ({root}, {rid}) has no parent to "
                                    f"send a tree sum to")
        key = (root, rid)
        if rid in finished:
            raise ProtocolViolation(source, what, f"request {key} is already finished at party {self.rank} "
                                    f"(a duplicate or a late contribution)")
        if rid >= finished.below + self.max_open:
            raise ProtocolViolation(source, what, f"request id {rid} of root {root} is more than "
                                    f"{self.max_open} ahead of the oldest open one ({finished.below})")
        tree = code - _MASKED
        state = self._requests.get(key)
        if state is None:
            state = self._requests[key] = _Request()
        bit = 1 << source
        if state.heard[tree] & bit:
            raise ProtocolViolation(source, what, f"party {self.rank} got a second tree-{tree + 1} sum for "
                                    f"{key} from {source}")
        if state.role is not None and not state.role.children[tree] & bit:
            raise ProtocolViolation(source, what, f"party {source} is not a tree-{tree + 1} child of "
                                    f"{self.rank} for {key}")
        total = state.totals[tree]
        other = state.totals[1 - tree]
        expected = total if total is not None else other
        if expected is not None and expected.size != buffer.size:
            raise ProtocolViolation(source, what, f"request {key}: partial sums of "
                                    f"{expected.size - HEADER_WORDS} and {payload} values cannot be added "
                                    f"(parties disagree on B)")
        state.heard[tree] |= bit
        if total is None:
            state.totals[tree] = buffer
        else:
            self._add(total, buffer, key)
        return self._advance(key, state) if state.role is not None else Step([])

    def _on_request(self, source: int, root: int, rid: int, aux: int, buffer: Words,
                    n_rows: int | None) -> Step:
        if source != root:
            raise ProtocolViolation(source, "REQUEST", f"REQUEST for root {root} came from party {source}")
        if aux != 0:
            raise ProtocolViolation(source, "REQUEST", f"header word 3 is {aux}, not 0")
        requested = self._requested[root]
        if rid in requested or rid in self._finished[root]:
            raise ProtocolViolation(source, "REQUEST", f"request id {rid} of root {root} was requested "
                                    f"before (a duplicate or replay)")
        if rid >= self._finished[root].below + self.max_open:
            raise ProtocolViolation(source, "REQUEST", f"request id {rid} is more than {self.max_open} "
                                    f"ahead of the oldest open one ({self._finished[root].below}): more "
                                    f"requests open at once than the job allows")
        indices = buffer[HEADER_WORDS:].view(np.int64)
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or (n_rows is not None and high >= n_rows):
            limit = "" if n_rows is None else f"..{n_rows - 1}"
            raise ProtocolViolation(source, "REQUEST", f"sample indices {low}..{high} are not in 0{limit}")
        requested.add(rid)
        return Step([], Requested(root, rid, indices))

    # ---------------------------------------------------------------------------------------- queries

    def finished(self, root: int, rid: int) -> bool:
        """Whether this party is done with ``(root, rid)``: forwarded both sums (or, at the root, has
        the result); a root cannot have its result before every party is."""
        return rid in self._finished[root]

    def in_progress(self, root: int, rid: int) -> bool:
        """Whether this party still holds state for ``(root, rid)`` (not yet forwarded / completed)."""
        return (root, rid) in self._requests

    def awaited(self, root: int, rid: int) -> dict[int, int]:
        """The children whose partial sums this party still waits for in request ``(root, rid)``, each
        with the height of its subtree in the tree it is missing from (the smaller of the two): the level
        of a deadline on it (protocols/liveness.py). Empty when the request is not started here."""
        state = self._requests.get((root, rid))
        if state is None or state.role is None:
            return {}
        awaited: dict[int, int] = {}
        for tree in (0, 1):
            if state.forwarded[tree]:
                continue
            heights = self._heights[root][tree]
            for child in _ranks(state.role.children[tree] & ~state.heard[tree]):
                awaited[child] = min(awaited.get(child, heights[child]), heights[child])
        return awaited

    @property
    def open_requests(self) -> int:
        """How many requests this party holds state for (for back-pressure and leak checks)."""
        return len(self._requests)

    # -------------------------------------------------------------------------------------- internals

    def _role(self, root: int, tree_pair: TreePair | None) -> _Role:
        if tree_pair is None:
            if not 0 <= root < self.size:
                raise ValueError(f"root must be a party in 0..{self.size - 1}, got {root}")
            return self._roles[root]
        if tree_pair.size != self.size or tree_pair.root != root:
            raise ValueError(f"tree pair spans {tree_pair.size} parties with root {tree_pair.root}; "
                             f"expected {self.size} parties with root {root}")
        if tree_pair not in self._validated_pairs:
            validate_tree_pair(tree_pair, allow_leaky_q2=self._allow_leaky_q2)
            self._validated_pairs.add(tree_pair)
        return _Role.of(tree_pair, self.rank)

    def _add(self, total: Words, addend: Words, key: tuple[int, int]) -> None:
        if total.size != addend.size:
            raise ProtocolError(f"request {key}: partial sums of {total.size - HEADER_WORDS} and "
                                f"{addend.size - HEADER_WORDS} values cannot be added (parties disagree on "
                                f"B)")
        self.masking.accumulate(total[HEADER_WORDS:], addend[HEADER_WORDS:])
        total[3] = (int(total[3]) + int(addend[3])) & _WORD  # the masked overflow flag, mod 2**64

    def _advance(self, key: tuple[int, int], state: _Request) -> Step:
        role = state.role
        assert role is not None
        heard, children = state.heard, role.children
        root, rid = key
        if root == self.rank:
            if heard[0] != children[0] or heard[1] != children[1]:
                return Step([])
            del self._requests[key]
            self._finished[root].add(rid)
            masked, masks = state.totals
            values = self.masking.unmask(masked[HEADER_WORDS:], masks[HEADER_WORDS:])
            out_of_range = (int(masked[3]) - int(masks[3])) & _WORD
            if out_of_range > self.size * values.size:  # more than every entry of every party
                raise ProtocolError(f"request {key}: the overflow flags sum to {out_of_range}, more than "
                                    f"the {self.size * values.size} entries; a party sent corrupt flags")
            return Step([], Completed(root, rid, values, out_of_range))
        outgoing = []
        forwarded, totals = state.forwarded, state.totals
        for tree in (0, 1):
            if heard[tree] == children[tree] and not forwarded[tree]:
                buffer = totals[tree]
                buffer[0] = _MASKED + tree  # MASKED up tree 1, MASKS up tree 2
                buffer[1] = root
                buffer[2] = rid  # buffer[3] holds the summed (masked) overflow flags
                outgoing.append(Outgoing(role.parents[tree], buffer))
                forwarded[tree] = True
                totals[tree] = None
        if forwarded[0] and forwarded[1]:
            del self._requests[key]
            self._finished[root].add(rid)
            self._requested[root].discard(rid)
        return Step(outgoing)


def _ranks(mask: int) -> list[int]:
    return [r for r in range(mask.bit_length()) if mask >> r & 1]
