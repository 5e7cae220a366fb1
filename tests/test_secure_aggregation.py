"""Secure aggregation end to end: exactness, what each party receives, overflow, concurrency, MPI runs."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import scipy.sparse as sp
from mpi4py import MPI
from scipy import stats

from protocols.aggregation import (
    HEADER_WORDS,
    AggregationNode,
    Completed,
    Kind,
    ProtocolError,
    Requested,
    Step,
    header_of,
)
from protocols.errors import ProtocolViolation
from protocols.masking import AggregationOverflowError, FixedPointRing, RealValued
from protocols.secure_aggregation import SecureAggregator, local_scores
from protocols.transport import (
    InProcessNetwork,
    InProcessTransport,
    MpiTransport,
    RecordingTransport,
    run_parties,
)
from protocols.trees import InsecureTreePairError, build_all_tree_pairs, paper_example_pair
from tests.conftest import run_mpi

N_SAMPLES = 6000


def party_blocks(q: int, sparse: bool) -> list[tuple[np.ndarray, np.ndarray | sp.csr_array]]:
    """(w_l, X_l) per party: widths differ, as in a real vertical split."""
    out = []
    for party in range(q):
        rng = np.random.default_rng(10 * q + party)
        width = 3 + party
        w = rng.normal(size=width)
        if sparse:
            X = sp.random_array((N_SAMPLES, width), density=0.25, format="csr", rng=rng)
        else:
            X = rng.normal(size=(N_SAMPLES, width))
        out.append((w, X))
    return out


@pytest.mark.parametrize("q", range(3, 9))
def test_inner_product_is_exact_for_every_root_batch_and_format(q: int) -> None:
    ring = FixedPointRing()
    cases = [(root, batch, sparse) for root in range(q) for batch in (1, 4096) for sparse in (False, True)]
    blocks = {sparse: party_blocks(q, sparse) for sparse in (False, True)}
    index_sets = {(root, batch): np.random.default_rng(root + batch).integers(0, N_SAMPLES, batch)
                  for root, batch, _ in cases}

    def party(transport: InProcessTransport) -> list[np.ndarray | None]:
        aggregator = SecureAggregator(transport, seed=q)
        out = []
        for root, batch, sparse in cases:
            w, X = blocks[sparse][transport.rank]
            mine = index_sets[(root, batch)] if transport.rank == root else None
            out.append(aggregator.inner_product(w, X, mine, root=root))
        return out

    results = run_parties(q, party)
    for k, (root, batch, sparse) in enumerate(cases):
        indices = index_sets[(root, batch)]
        plain = sum(local_scores(X, w, indices) for w, X in blocks[sparse])
        z = results[root][k]
        assert z.shape == (batch,)
        assert np.abs(z - plain).max() <= q * ring.resolution / 2 + 1e-12 * np.abs(plain).max()
        assert all(results[p][k] is None for p in range(q) if p != root)


def test_paper_real_valued_masking_is_available_and_approximately_exact() -> None:
    q = 4
    values = [np.random.default_rng(p).normal(size=300) for p in range(q)]

    def party(transport: InProcessTransport) -> np.ndarray | None:
        return SecureAggregator(transport, masking=RealValued(scale=1e3)).sum(values[transport.rank], root=2)

    total = run_parties(q, party)[2]
    assert np.allclose(total, sum(values), rtol=0, atol=1e-9)


def test_sum_with_the_paper_pair_and_batches_of_one() -> None:
    def party(transport: InProcessTransport) -> list[np.ndarray | None]:
        aggregator = SecureAggregator(transport)
        return [aggregator.sum([float(transport.rank + k)], tree_pair=paper_example_pair()) for k in range(3)]

    at_root = run_parties(4, party)[0]
    assert [float(v[0]) for v in at_root] == [6.0, 10.0, 14.0]


def test_transcript_no_party_receives_an_unmasked_partial_product_and_words_look_uniform() -> None:
    q, batch = 5, 4096
    ring = FixedPointRing()
    blocks = party_blocks(q, sparse=False)
    indices = np.arange(batch)
    # partial products made large and far from uniform, so a leak would show
    encoded = [ring.encode(1e4 + local_scores(X, w, indices), q)[0] for w, X in blocks]
    recorders: list[RecordingTransport] = []

    def party(transport: InProcessTransport) -> list[np.ndarray | None]:
        recorder = RecordingTransport(transport)
        recorders.append(recorder)
        aggregator = SecureAggregator(recorder, seed=1)
        w, X = blocks[transport.rank]
        return [aggregator.sum(1e4 + local_scores(X, w, indices), root=root) for root in range(q)]

    run_parties(q, party)
    masked_words = []
    for recorder in recorders:
        me = recorder.rank
        assert recorder.received, f"party {me} received nothing"
        for source, buffer in recorder.received:
            header = header_of(buffer)
            assert header.kind in (Kind.MASKED, Kind.MASKS) and source != me
            payload = buffer[HEADER_WORDS:]
            masked_words.append(payload)
            for size in range(1, q):
                for others in itertools.combinations([p for p in range(q) if p != me], size):
                    plain = sum((encoded[p] for p in others), np.zeros(batch, np.uint64))
                    assert np.count_nonzero(payload == plain) == 0, (me, source, others)
    words = np.concatenate(masked_words)
    counts = np.bincount((words >> np.uint64(60)).astype(np.int64), minlength=16)
    assert stats.chisquare(counts).pvalue > 1e-4
    # every non-root party sends once per tree and request: 2 (q-1) messages per aggregation
    assert sum(len(r.received) for r in recorders) == q * 2 * (q - 1)


@pytest.mark.parametrize("batch", [1, 64])  # the scalar (B <= 8) and the vectorised masking paths
def test_masks_are_fresh_for_every_request(batch: int) -> None:
    recorders: list[RecordingTransport] = []

    def party(transport: InProcessTransport) -> None:
        recorder = RecordingTransport(transport)
        recorders.append(recorder)
        aggregator = SecureAggregator(recorder)
        for _ in range(2):
            aggregator.sum(np.ones(batch), root=0)  # the same values twice

    run_parties(4, party)
    root = next(r for r in recorders if r.rank == 0)
    by_sender: dict[tuple[int, Kind], list[np.ndarray]] = {}
    for source, buffer in root.received:
        by_sender.setdefault((source, header_of(buffer).kind), []).append(buffer[HEADER_WORDS:])
    for first, second in by_sender.values():
        assert not np.any(first == second)


@pytest.mark.parametrize("bad_value", [1e30, np.nan, np.inf])
def test_values_the_encoding_cannot_hold_make_the_root_raise_not_return_garbage(bad_value: float) -> None:
    def party(transport: InProcessTransport) -> object:
        values = np.ones(8)
        if transport.rank == 2:
            values[3] = bad_value
        try:
            return SecureAggregator(transport).sum(values, root=0)
        except AggregationOverflowError as error:
            return error

    outcome = run_parties(4, party)
    assert isinstance(outcome[0], AggregationOverflowError) and "1 contributed value" in str(outcome[0])
    assert outcome[1:] == [None, None, None]


def test_q2_is_refused_everywhere_unless_opted_in() -> None:
    def refused(transport: InProcessTransport) -> str:
        with pytest.raises(InsecureTreePairError, match="inherently leaky") as info:
            SecureAggregator(transport)
        return str(info.value)

    assert len(run_parties(2, refused)) == 2

    def opted_in(transport: InProcessTransport) -> np.ndarray | None:
        return SecureAggregator(transport, allow_leaky_q2=True).sum([1.5, transport.rank], root=1)

    assert np.array_equal(run_parties(2, opted_in)[1], [3.0, 1.0])


def test_public_edges_reject_bad_inputs_with_clear_messages() -> None:
    def party(transport: InProcessTransport) -> list[str]:
        aggregator = SecureAggregator(transport)
        X = np.ones((10, 3))
        problems = [
            lambda: aggregator.sum(np.ones((2, 2))),
            lambda: aggregator.sum(np.ones(3), root=7),
            lambda: aggregator.inner_product(np.ones(4), X, [0], root=transport.rank),
            lambda: aggregator.inner_product(np.ones(3), X, [10], root=transport.rank),
            lambda: aggregator.inner_product(np.ones(3), X, [0.5], root=transport.rank),
            lambda: aggregator.inner_product(np.ones(3), sp.coo_array(X), [0], root=transport.rank),
            lambda: aggregator.inner_product(np.ones(3), X, None, root=transport.rank),
        ]
        messages = []
        for problem in problems:
            with pytest.raises(ValueError) as info:
                problem()
            messages.append(str(info.value))
        return messages

    messages = run_parties(3, party)[0]
    expected = ["1-D array", "root must be a rank in 0..2", "3 columns but w_local has 4", "0..9",
                "integers", "CSR", "must pass the sample indices"]
    for message, fragment in zip(messages, expected, strict=True):
        assert fragment in message


def test_mpi_transport_frames_messages_longer_than_its_receive_buffer() -> None:
    """Over MPI_COMM_SELF (no mpiexec needed): short and framed messages, interleaved, arrive intact and
    in order, and each received buffer belongs to the caller (later receives do not overwrite it)."""
    comm = MPI.COMM_SELF.Dup()
    transport = MpiTransport(comm, capacity_words=8)
    sizes = [5, 9, 4, 8, 3000, 1, 64, 2]  # no empty message: the receiver rejects those
    sent = [np.arange(n, dtype=np.uint64) * np.uint64(2**40 + 7) + np.uint64(n) for n in sizes]
    for buffer in sent:
        transport.send(0, buffer)
    received = [transport.recv() for _ in sizes]
    transport.flush()
    comm.Free()
    assert [source for source, _ in received] == [0] * len(sizes)
    for (_, got), want in zip(received, sent, strict=True):
        assert got.dtype == np.uint64 and np.array_equal(got, want)


def test_mpi_transport_rejects_a_bad_tag_or_capacity() -> None:
    with pytest.raises(ValueError, match="tag must be in"):
        MpiTransport(MPI.COMM_SELF, tag=-1)
    with pytest.raises(ValueError, match="capacity_words"):
        MpiTransport(MPI.COMM_SELF, capacity_words=0)


# ----------------------------------------------------------------- the sans-IO core under concurrency


def test_two_roots_interleaved_requests_in_random_delivery_order_never_mix() -> None:
    """Roots 0 and 3 issue requests at once; messages (and parties' starts) happen in random order."""
    q, per_root = 6, 5
    pairs = build_all_tree_pairs(q, 4)
    nodes = [AggregationNode(p, q, pairs) for p in range(q)]
    blocks = party_blocks(q, sparse=False)
    rng = np.random.default_rng(0)
    pending: list[tuple[str, int, object]] = []  # ("msg", dest, (source, buffer)) or ("start", party, event)
    expected, results = {}, {}

    def enqueue(source: int, step) -> None:
        pending.extend(("msg", out.dest, (source, out.buffer)) for out in step.outgoing)
        if isinstance(step.event, Requested):
            pending.append(("start", source, step.event))  # the party starts later, at a random moment
        elif isinstance(step.event, Completed):
            results[(step.event.root, step.event.rid)] = step.event.result()

    for k in range(per_root):
        for root in (0, 3):
            indices = rng.integers(0, N_SAMPLES, 1 + 20 * k)
            rid, announcements = nodes[root].announce(indices)
            expected[(root, rid)] = sum(local_scores(X, w, indices) for w, X in blocks)
            enqueue(root, Step(announcements))
            pending.append(("start", root, Requested(root, rid, indices)))
    early_arrivals = 0
    while pending:
        kind, party, payload = pending.pop(int(rng.integers(0, len(pending))))
        node = nodes[party]
        if kind == "msg":
            source, buffer = payload
            header = header_of(buffer)
            early_arrivals += header.kind != Kind.REQUEST and not node.in_progress(header.root, header.rid)
            enqueue(party, node.receive(source, buffer))
        else:
            w, X = blocks[party]
            enqueue(party, node.start(payload.root, payload.rid, local_scores(X, w, payload.indices)))
    assert results.keys() == expected.keys()
    for key in expected:
        assert np.abs(results[key] - expected[key]).max() <= q * FixedPointRing().resolution
    assert all(node.open_requests == 0 for node in nodes)
    assert early_arrivals > 0  # the schedule did deliver children's sums before their parent started


def test_protocol_errors_are_detected() -> None:
    q = 4
    pairs = build_all_tree_pairs(q, 0)
    children = pairs[0].t1.children[0]
    stranger = next(p for p in range(1, q) if p not in children)

    def sum_message(rid: int, n: int = 3) -> np.ndarray:
        return np.array([Kind.MASKED, 0, rid, 0, *range(n)], dtype=np.uint64)

    root = AggregationNode(0, q, pairs)
    root.start(0, 0, np.ones(3))
    root.receive(children[0], sum_message(0))
    with pytest.raises(ProtocolError, match="second"):
        root.receive(children[0], sum_message(0))
    with pytest.raises(ProtocolError, match="not a tree-1 child"):
        root.receive(stranger, sum_message(0))
    with pytest.raises(ProtocolError, match="disagree on B"):
        root.receive(children[1], sum_message(0, n=2))
    root.receive(stranger, sum_message(1))  # arrives before the start: kept, checked at start
    with pytest.raises(ProtocolError, match="non-children"):
        root.start(0, 1, np.ones(3))
    with pytest.raises(ProtocolError, match="REQUEST for root 2 came from party 1"):
        root.receive(1, np.array([Kind.REQUEST, 2, 0, 0, 5], dtype=np.uint64))
    with pytest.raises(ProtocolError, match="unknown message kind"):
        root.receive(1, np.array([99, 0, 0, 0, 5], dtype=np.uint64))


# ------------------------------------------------------------------------------------ real mpiexec


@pytest.mark.mpi
@pytest.mark.parametrize("q", [3, 4, 6])
def test_secure_aggregation_over_real_mpi(q: int) -> None:
    proc = run_mpi(q, ["tests/mpi_scripts/secure_agg_check.py"], timeout=60)
    assert sorted(re.findall(r"OK (\d+)", proc.stdout)) == sorted(str(r) for r in range(q))


@pytest.mark.mpi
def test_documented_example_runs_under_mpiexec() -> None:
    proc = run_mpi(4, ["tests/mpi_scripts/secure_agg_example.py"], timeout=60)
    assert "matches the plain sum: True" in proc.stdout


# ------------------------------------------------------------------------------ hardening additions


@pytest.mark.parametrize("batch", [1, 16])
def test_overflow_flags_are_masked_so_a_parent_cannot_tell_which_child_overflowed(batch: int) -> None:
    """Each party's out-of-range count travels as a masked ring word (header word 3), like a value: the
    root still learns the total and refuses the result, but every flag word any party receives is
    uniform, whichever child overflowed (it used to be the child's count, in clear)."""
    q = 5
    pairs = build_all_tree_pairs(q, 2)
    parents = {p: pairs[0].t1.parent[p] for p in range(1, q)}
    inner = next(p for p in range(1, q) if len(pairs[0].t1.children[p]) >= 2)  # a non-root parent
    flag_words: dict[int, list[int]] = {}
    for overflowing in pairs[0].t1.children[inner]:
        recorders: list[RecordingTransport] = []

        def party(transport: InProcessTransport, overflowing: int = overflowing,
                  recorders: list[RecordingTransport] = recorders) -> object:
            recorder = RecordingTransport(transport)
            recorders.append(recorder)
            values = np.ones(batch)
            if transport.rank == overflowing:
                values[-1] = np.inf
            try:
                return SecureAggregator(recorder, tree_pairs=pairs).sum(values, root=0)
            except AggregationOverflowError as error:
                return error

        outcome = run_parties(q, party)
        assert isinstance(outcome[0], AggregationOverflowError) and "1 contributed value" in str(outcome[0])
        for recorder in recorders:
            seen = [int(buffer[3]) for _, buffer in recorder.received]
            assert len(set(seen)) == len(seen)  # fresh masks: no two flag words alike at one party
            flag_words.setdefault(overflowing, []).extend(seen)
        assert parents[overflowing] == inner
    # in clear these were 0 (no overflow below) or 1 (below the overflowing child); masked, every word
    # is uniform on 64 bits, whichever child overflowed (a word <= q * B has probability < 2**-57)
    words = [w for ws in flag_words.values() for w in ws]
    assert len(words) == 2 * 2 * (q - 1)
    assert all(w > q * batch for w in words)


def test_complex_input_is_refused_with_a_clear_error() -> None:
    def party(transport: InProcessTransport) -> None:
        aggregator = SecureAggregator(transport)
        with pytest.raises(TypeError, match="complex"):
            aggregator.sum(np.array([1.0 + 1.0j, 2.0]))
        with pytest.raises(TypeError, match="must be real"):
            aggregator.inner_product(np.ones(2, dtype=complex), np.ones((4, 2)), [0], root=0)
        with pytest.raises(TypeError, match="must be real"):
            aggregator.inner_product(np.ones(2), np.ones((4, 2), dtype=complex), [0], root=0)
        with pytest.raises(TypeError, match="complex"):
            aggregator.node.start(0, 99, np.array([1j]))

    run_parties(3, party)


def test_a_party_asked_for_rows_it_does_not_have_names_the_root() -> None:
    """The root announces row 7; party 1 has 5 rows: it refuses, naming the root."""
    network = InProcessNetwork(3, timeout=5)
    pairs = build_all_tree_pairs(3, 0)
    _, announcements = AggregationNode(0, 3, pairs).announce(np.array([7]))
    for message in announcements:
        network.transport(0).send(message.dest, message.buffer)
    aggregator = SecureAggregator(network.transport(1), tree_pairs=pairs)
    with pytest.raises(ProtocolViolation, match=r"^party 0 sent an invalid REQUEST: sample indices 7\.\.7"):
        aggregator.inner_product(np.ones(2), np.ones((5, 2)), None, root=0)
