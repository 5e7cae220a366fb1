"""The dominator's key in a child process (protocols/label_he_key_process.py): the same exact gradients
and the same refusals as the in-process key, no secret half in the parent, a child that ends with its
parent's pipe, and a child started early (protocols/label_he_key_spawn.py) by the ranks that will
dominate under he, and only by them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from parties import rank as rank_entry
from protocols import label_he, label_he_key_spawn, label_he_pack
from protocols.errors import ProtocolViolation
from protocols.label_he_key_process import KeyProcess
from tests.conftest import REPO_ROOT
from vertical.algorithms.vfb2 import Block

pytest.importorskip("heu")


@pytest.fixture(scope="module")
def children():
    """Two key processes started at once, their keys made side by side (1-5 s each): the tests' shared
    one, and one the end-of-pipe test closes."""
    return [label_he_key_spawn.spawn("ou", 2048) for _ in range(2)]


@pytest.fixture(scope="module")
def key(children):
    return KeyProcess("ou", 2048, child=children[0])


def _block(rng: np.random.Generator) -> Block:
    X = sp.random(40, 6, density=0.5, random_state=rng, format="csr")
    X.data[:] = rng.uniform(-2, 2, X.data.size)
    return Block.from_matrix(X)


def test_gradients_through_the_key_process_are_exact_packed_and_unpacked(key):
    rng = np.random.default_rng(0)
    block, rows, thetas = _block(rng), rng.choice(40, 20, replace=False), rng.uniform(-1, 1, 20)
    truth = block.to_csr()[rows].T @ thetas
    plain = label_he.BlockGradient(0, key.public_bytes(), block=block)
    unpacked = plain.unmask(key.decrypt_masked(1, plain.masked(key.encrypt(thetas), rows), batch=20))
    packed_party = label_he_pack.PackedBlockGradient(0, key.public_bytes(), block=block, batch=20)
    reply = label_he_pack.decrypt_packed(key, 1, packed_party.masked_packed(key.encrypt(thetas), rows), 20,
                                         packed_party.layout)
    packed = packed_party.unmask_packed(reply)
    assert np.array_equal(unpacked, packed)  # packing is exact: the same fixed-point sums
    np.testing.assert_allclose(unpacked, truth, atol=1e-6)
    assert np.abs(truth).max() > 0.1


def test_the_key_process_refuses_what_the_in_process_key_refuses_naming_the_sender(key):
    thetas = np.linspace(-1, 1, 20)
    with pytest.raises(ProtocolViolation, match=r"^party 3 sent an invalid masked gradient: 20 values for a "
                                                r"batch of 20: B must exceed"):
        key.decrypt_masked(3, key.encrypt(thetas), batch=20)  # the batch's own ciphertexts: would solve ϑ
    with pytest.raises(ProtocolViolation, match=r"^party 2 sent an invalid masked gradient: not a cipher"):
        key.decrypt_masked(2, bytes(300), batch=20)
    with pytest.raises(ProtocolViolation, match=r"^party 1 sent an invalid masked gradient: 0 bytes"):
        key.decrypt_masked(1, b"", batch=20)
    block = _block(np.random.default_rng(1))  # still answers honest replies afterwards
    party = label_he.BlockGradient(0, key.public_bytes(), block=block)
    assert party.unmask(key.decrypt_masked(1, party.masked(key.encrypt(thetas), np.arange(20)), 20)).size == 6


def test_requests_from_several_threads_at_once_each_get_their_own_answer(key):
    """The dominator's decryption threads share the child, several requests in flight."""
    rng = np.random.default_rng(3)
    blocks = [_block(rng) for _ in range(4)]
    parties = [label_he.BlockGradient(0, key.public_bytes(), block=b) for b in blocks]
    thetas = rng.uniform(-1, 1, 20)
    payload = key.encrypt(thetas)
    replies = [p.masked(payload, np.arange(20)) for p in parties]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda r: key.decrypt_masked(1, r, batch=20), replies * 3))
    for k, (party, block) in enumerate(zip(parties, blocks, strict=True)):
        assert all(np.array_equal(answers[k], answers[k + 4 * t]) for t in range(3))
        np.testing.assert_allclose(party.unmask(answers[k]), block.to_csr()[:20].T @ thetas, atol=1e-6)


def test_the_parent_holds_no_secret_key_and_the_child_ends_with_its_pipe(children):
    key = KeyProcess("ou", 2048, child=children[1])
    assert not hasattr(key, "_decryptor")
    assert not hasattr(key._kit, "decryptor")  # a kit from the public key alone: nothing to decrypt with
    os.close(key._to_child)  # what the rank's exit does, however it exits
    assert key._child.wait(timeout=30) == 0
    with pytest.raises(RuntimeError, match="the HE key process ended"):
        key._answer()


def test_a_child_started_early_is_taken_once_then_a_new_one_is_started(monkeypatch):
    started = []
    monkeypatch.setattr(label_he_key_spawn, "spawn", lambda scheme, bits: started.append((scheme, bits)) or
                        len(started))
    assert label_he_key_spawn.start_early("paillier", 3072)
    assert not label_he_key_spawn.start_early("paillier", 3072)  # one waits already
    assert label_he_key_spawn.take("ou", 2048) == 2  # not the one started for another key
    assert label_he_key_spawn.take("paillier", 3072) == 1  # the early one
    assert label_he_key_spawn.take("paillier", 3072) == 3  # taken once: then a new one
    assert started == [("paillier", 3072), ("ou", 2048), ("paillier", 3072)]


@pytest.mark.parametrize(("plan", "expected"), [
    ({"label_privacy": "he", "he_scheme": "paillier", "he_key_bits": 4096, "active": 1},
     [("paillier", 4096)]),
    ({"label_privacy": "he", "he_scheme": "ou", "he_key_bits": 2048, "active": 0}, []),  # rank 0 passive
    ({"label_privacy": "dp", "he_scheme": "ou", "he_key_bits": 2048, "active": 1}, []),
    ({"label_privacy": "he", "he_scheme": "ou", "he_key_bits": "2048", "active": 1}, []),  # JobPlan says why
    ({"label_privacy": "he"}, []),
    ([], []),
])
def test_a_rank_starts_its_key_process_first_only_when_it_will_dominate_under_he(monkeypatch, plan, expected):
    """parties/rank.py reads the plan raw, before its imports; a plan it cannot read starts nothing."""
    started = []
    monkeypatch.setattr(label_he_key_spawn, "start_early", lambda scheme, bits: started.append((scheme, bits))
                        or True)
    import json

    assert rank_entry.start_he_key_early(json.dumps(plan)) == bool(expected)  # this process is rank 0
    assert rank_entry.start_he_key_early("{not json") is False
    assert started == expected


def test_a_tied_child_dies_with_its_parent():
    """A rank that ends while its key process still makes the key must not leave it holding the rank's
    output (mpiexec waits for every holder): the child is killed with the rank."""
    child = ("import sys, time; from protocols.label_he_key_child import die_with; "
             "die_with(int(sys.argv[1])); print('tied', flush=True); time.sleep(60)")
    parent = ("import os, subprocess, sys; c = subprocess.Popen([sys.executable, '-c', sys.argv[1], "
              "str(os.getpid())], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True); "
              "print(c.pid, c.stdout.readline().strip(), flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", parent, child], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, check=True).stdout.split()
    assert out[1] == "tied"
    deadline = time.monotonic() + 10
    while _alive(int(out[0])) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(int(out[0]))


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_only_the_main_thread_ties_its_child(monkeypatch):
    """The parent-death signal follows the thread that started the child: one started elsewhere (a
    runtime built in a thread) must not die when that thread ends."""
    seen = []
    monkeypatch.setattr(label_he_key_spawn.subprocess, "Popen", lambda args, **_: seen.append(args[-1]))
    label_he_key_spawn.spawn("ou", 2048)
    worker = threading.Thread(target=label_he_key_spawn.spawn, args=("ou", 2048))
    worker.start()
    worker.join()
    assert seen == [str(os.getpid()), "0"]
