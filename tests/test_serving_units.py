"""``vfl serve``'s pieces without MPI: request parsing, the wire checks, the micro-batcher."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import scipy.sparse as sp

from parties.serving import wire
from parties.serving.batching import MicroBatcher
from parties.serving.federation import BatchScores, contribution
from parties.serving.front import UNKNOWN_ID, BadRequest, answer, parse_request
from parties.serving.launch import check_options
from parties.serving.store import PartyModel
from protocols.errors import ProtocolViolation


@pytest.mark.parametrize("body, says", [
    (b"not json", "not JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"ids": [1], "extra": 1}', "JSON object"),
    (b'{"ids": []}', "list of 1 to 8"),
    (b'{"ids": [1, 2, 3, 4, 5, 6, 7, 8, 9]}', "list of 1 to 8"),
    (b'{"ids": [1.5]}', "integer"),
    (b'{"ids": [true]}', "integer"),
    (b'{"ids": ["7"]}', "integer"),
    (b'{"ids": [99999999999999999999]}', "integer"),
    (b'{"ids": [1], "output": "logit"}', "not available"),
    (b'{"ids": [1], "output": []}', "must be one of"),
])
def test_a_malformed_request_is_refused_with_one_line(body, says):
    with pytest.raises(BadRequest, match=says) as caught:
        parse_request(body, max_ids=8, task="binary")
    assert "\n" not in str(caught.value)


def test_outputs_default_to_what_the_task_has():
    ids, outputs = parse_request(b'{"ids": [3, 1]}', max_ids=8, task="binary")
    assert ids.tolist() == [3, 1] and outputs == ("score", "probability", "class")
    assert parse_request(b'{"ids": [3]}', max_ids=8, task="regression")[1] == ("score",)
    with pytest.raises(BadRequest, match="regression"):
        parse_request(b'{"ids": [3], "output": "class"}', max_ids=8, task="regression")


def test_an_id_not_held_by_every_party_gets_an_error_not_a_score():
    scores = BatchScores(np.array([0.5, np.nan]), np.array([True, False]))
    entries = answer(np.array([4, 5]), scores, ("score", "class"))
    assert entries == [{"id": 4, "score": 0.5, "class": 1}, {"id": 5, "error": UNKNOWN_ID}]


def test_a_party_looks_up_only_the_ids_it_holds():
    rows = sp.csr_matrix(np.arange(6.0).reshape(3, 2))
    ids = np.array([30, 10, 20])
    order = np.argsort(ids)
    model = PartyModel(1, np.ones(2), rows, ids[order], order, None)
    found = model.lookup(np.array([10, 11, 30, 99, -5]))
    assert found.tolist() == [1, -1, 0, -1, -1]
    assert model.embed(found[:1]).tolist() == [[5.0]]  # id 10 is row 1: [2, 3]·w


def test_the_request_a_passive_party_receives_is_checked_whole():
    message = wire.encode_request(np.array([7, 8, 9]))
    kind, ids = wire.decode_request(message, message.nbytes, max_batch=4)
    assert kind == wire.SCORE and ids.tolist() == [7, 8, 9]
    stop = wire.stop_message()
    assert wire.decode_request(stop, stop.nbytes, max_batch=4)[0] == wire.STOP
    for bad, nbytes in ((message, message.nbytes - 8), (message, 12), (message, 8),
                        (np.array([wire.SCORE, 5, 1, 2, 3, 4, 5]), 56),
                        (np.array([wire.SCORE, 0]), 16), (np.array([9, 1, 1]), 24)):
        with pytest.raises(ProtocolViolation, match="party 0 sent an invalid serving request"):
            wire.decode_request(bad, nbytes, max_batch=4)


def test_an_acknowledgement_of_a_passive_party_is_checked():
    wire.check_ack(2, np.array([3]), 8, 3)
    with pytest.raises(ProtocolViolation, match="party 2 sent an invalid serving acknowledgement"):
        wire.check_ack(2, np.array([4]), 8, 3)
    with pytest.raises(ProtocolViolation, match="party 1 sent"):
        wire.check_ack(1, np.array([3]), 4, 3)


def test_a_party_contributes_nothing_for_an_id_it_does_not_hold_and_says_so_in_the_count():
    rows = sp.csr_matrix(np.array([[1.0, 2.0], [3.0, 4.0]]))
    model = PartyModel(1, np.array([1.0, 10.0]), rows, np.array([10, 20]), np.array([0, 1]), None)
    values = contribution(model, np.array([20, 99, 10]))
    assert values.tolist() == [43.0, 0.0, 21.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize("options, says", [((-1, 1, 8, 1), "--port"), ((80, -1, 8, 1), "--window-ms"),
                                           ((80, 1, 0, 1), "--max-batch"), ((80, 1, 8, 0), "--peer-timeout")])
def test_serve_options_out_of_range_are_refused(options, says):
    with pytest.raises(ValueError, match=says):
        check_options(*options)


def _session_keys(session: bytes, job: bytes = b"job") -> tuple:
    """Leader's and party 1's serving request links of one session, under fixed test keys."""
    import hashlib

    from parties.serving.sealing import planes
    from protocols.channels import ChannelKeys, public_key

    privates = [hashlib.sha256(f"serve key {r}".encode()).digest() for r in range(2)]
    publics = tuple(public_key(p) for p in privates)
    plane = planes(session)[0]
    return tuple(ChannelKeys(privates[r], publics, job).channels(r, plane) for r in range(2))


def test_a_sealed_request_opens_once_at_its_party_and_nowhere_else():
    """The serving planes are keyed by the session: a frame recorded in one start of the service (or
    sealed for training's planes) does not open in another; a replay or a flipped bit names the leader."""
    from parties.serving.sealing import session_id

    contributions = np.arange(64, dtype=np.uint8).reshape(2, 32)
    session = session_id(contributions)
    leader, party = _session_keys(session)
    request = wire.encode_request(np.array([7, 8, 9]))
    sealed = wire.on_wire(leader, 1, wire.TAG_REQUEST, request)
    assert not np.isin(np.array([7, 8, 9], dtype=np.int64).view(np.uint64), sealed).any()  # not in clear
    buffer = np.zeros(2 + 8 + wire.overhead(party), dtype=np.int64)
    buffer.view(np.uint64)[:sealed.size] = sealed
    words, nbytes = wire.opened(party, wire.LEADER, wire.TAG_REQUEST, buffer, sealed.nbytes)
    kind, ids = wire.decode_request(words, nbytes, 8)
    assert kind == wire.SCORE and ids.tolist() == [7, 8, 9]
    with pytest.raises(ProtocolViolation, match="party 0 sent an invalid sealed message: counter 0, expect"):
        wire.opened(party, wire.LEADER, wire.TAG_REQUEST, buffer, sealed.nbytes)  # replayed
    contributions[1, 0] ^= 1  # another start of the service: one party drew other bytes
    _, later = _session_keys(session_id(contributions))
    with pytest.raises(ProtocolViolation, match="party 0 sent an invalid sealed message: authentication"):
        wire.opened(later, wire.LEADER, wire.TAG_REQUEST, buffer, sealed.nbytes)
    _, fresh = _session_keys(session)
    buffer[3] ^= 1  # one bit of the ciphertext
    with pytest.raises(ProtocolViolation, match="party 0 sent an invalid sealed message: authentication"):
        wire.opened(fresh, wire.LEADER, wire.TAG_REQUEST, buffer, sealed.nbytes)


def test_serving_and_training_frames_never_open_in_each_other():
    import hashlib

    from parties.serving.sealing import planes
    from protocols.channels import ChannelKeys, public_key

    privates = [hashlib.sha256(f"serve key {r}".encode()).digest() for r in range(2)]
    keys = [ChannelKeys(p, tuple(public_key(k) for k in privates), b"job") for p in privates]
    serving = planes(bytes(32)) + planes(bytes(32), b"predict")
    training = (b"data", b"full-theta", b"full-passes")
    message = np.arange(4, dtype=np.uint64)
    for sealed_on in serving + training:
        sealed = keys[0].channels(0, sealed_on).seal(1, wire.TAG_REQUEST, message)
        for opened_on in serving + training:
            receiver = keys[1].channels(1, opened_on)
            if opened_on == sealed_on:
                assert receiver.open(0, wire.TAG_REQUEST, sealed).tolist() == message.tolist()
            else:
                with pytest.raises(ProtocolViolation, match="authentication failed"):
                    receiver.open(0, wire.TAG_REQUEST, sealed)


def test_an_address_in_use_is_refused_in_one_line_before_any_rank_starts():
    import socket

    from parties.serving.launch import check_address

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}: "):
            check_address("127.0.0.1", port)
    check_address("127.0.0.1", 0)


def _fake_score(calls: list, delay: float):
    async def score(ids: np.ndarray) -> BatchScores:
        calls.append(ids.copy())
        await asyncio.sleep(delay)
        return BatchScores(ids * 2.0, ids % 7 != 0)

    return score


def test_concurrent_requests_share_a_batch_and_each_gets_its_own_rows():
    async def scenario():
        calls: list = []
        batcher = MicroBatcher(_fake_score(calls, 0.01), window=0.05, max_rows=64)
        runner = asyncio.create_task(batcher.run())
        requests = [np.arange(k, k + 1 + k % 3) for k in range(40)]
        results = await asyncio.gather(*(batcher.submit(ids) for ids in requests))
        runner.cancel()
        return calls, requests, results

    calls, requests, results = asyncio.run(scenario())
    for ids, got in zip(requests, results, strict=True):
        np.testing.assert_array_equal(got.z, ids * 2.0)
        np.testing.assert_array_equal(got.held, ids % 7 != 0)
    assert len(calls) < len(requests) / 4  # gathered, not one aggregation each
    assert max(c.size for c in calls) <= 64


def test_a_lone_request_does_not_wait_for_the_window():
    async def scenario():
        batcher = MicroBatcher(_fake_score([], 0.0), window=1.0, max_rows=64)
        runner = asyncio.create_task(batcher.run())
        start = time.perf_counter()
        await batcher.submit(np.array([3]))
        elapsed = time.perf_counter() - start
        runner.cancel()
        return elapsed

    assert asyncio.run(scenario()) < 0.5


def test_a_failed_batch_fails_each_of_its_requests():
    async def failing(ids):
        raise RuntimeError("party 2 did not answer")

    async def scenario():
        batcher = MicroBatcher(failing, window=0.01, max_rows=8)
        runner = asyncio.create_task(batcher.run())
        outcome = await asyncio.gather(batcher.submit(np.array([1])), batcher.submit(np.array([2])),
                                       return_exceptions=True)
        runner.cancel()
        return outcome

    assert all(isinstance(r, RuntimeError) for r in asyncio.run(scenario()))


def _network_party(rank: int, classes: int | None = None) -> PartyModel:
    """A party holding ids 10, 20, 30 whose network embeds a row as (its sum, its first value) (k = 2);
    with ``classes``, the leader's top: softmax over the logits (z_0, z_1, 0, ...)."""
    from types import SimpleNamespace

    rows = sp.csr_matrix(np.arange(6.0).reshape(3, 2) + rank)
    ids = np.array([30, 10, 20])
    order = np.argsort(ids)

    def top(z):
        logits = np.column_stack([z, np.zeros((len(z), classes - 2))])
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    network = SimpleNamespace(k=2, embed=lambda block: np.column_stack([block.sum(axis=1).A1,
                                                                        block[:, 0].toarray().ravel()]),
                              top=None if classes is None else SimpleNamespace(n_classes=classes,
                                                                               predict_proba=top))
    return PartyModel(rank, np.zeros(2), rows, ids[order], order, None if classes is None else "multiclass",
                      network)


def test_a_network_party_contributes_k_values_an_id_and_the_leader_applies_its_top():
    """(k+1)·n values: each held id's embedding (k together, 0s for an id it lacks), then the held
    flags; the leader's top turns the sum into class probabilities, none for an id some party lacks."""
    from parties.serving.federation import batch_scores

    leader, other = _network_party(0, classes=3), _network_party(1)
    asked = np.array([20, 99, 30])
    assert contribution(other, asked).tolist() == [11.0, 5.0, 0.0, 0.0, 3.0, 1.0, 1.0, 0.0, 1.0]
    total = contribution(leader, asked) + contribution(other, asked)
    scores = batch_scores(leader, total, asked.size, parties=2)
    assert scores.held.tolist() == [True, False, True] and np.isnan(scores.probabilities[1]).all()
    z = np.array([[9.0 + 11.0, 4.0 + 5.0], [1.0 + 3.0, 0.0 + 1.0]])  # ids 20 and 30, both parties
    expected = np.exp(np.column_stack([z, [0.0, 0.0]]))
    np.testing.assert_allclose(scores.probabilities[[0, 2]], expected / expected.sum(axis=1, keepdims=True))
    outputs = parse_request(b'{"ids": [1]}', max_ids=8, task="multiclass")[1]
    entries = answer(asked, scores.take(0, 3), outputs)
    assert entries[1] == {"id": 99, "error": UNKNOWN_ID}
    assert entries[0]["class"] == 0 and entries[0]["probabilities"] == pytest.approx(scores.probabilities[0])
    assert set(entries[2]) == {"id", "class", "probabilities"}
    for asked_for in ("score", "probability"):  # a multiclass network has neither
        with pytest.raises(BadRequest, match=f"{asked_for!r} is not available for a multiclass model"):
            parse_request(f'{{"ids": [1], "output": "{asked_for}"}}'.encode(), max_ids=8, task="multiclass")


def test_a_network_round_too_wide_for_the_sum_is_refused_before_any_rank_starts():
    from types import SimpleNamespace

    from parties.serving.launch import MAX_SUM_VALUES, check_sum_width

    run = SimpleNamespace(model="mlp", bottom="*-64-16", parties=3)
    check_sum_width(run, MAX_SUM_VALUES // 17)
    with pytest.raises(ValueError, match=r"k \+ 1 = 17 values a row.*--max-batch at most 123361") as err:
        check_sum_width(run, MAX_SUM_VALUES // 17 + 1)
    assert "\n" not in str(err.value)
    check_sum_width(SimpleNamespace(model="linear"), 1 << 16)  # a linear round is 2 values a row
