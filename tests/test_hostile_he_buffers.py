"""A peer's HE buffers under ``--label-privacy he`` end the job naming the peer, never as a library error
(issue 26, finding 7: "an HEU error escapes its ProtocolViolation wrapper").

The audit fed 3,000 mutated ciphertext buffers to the receivers. Parsing was wrapped, but the library's
arithmetic on what it parsed was not: a buffer that loads as ciphertexts of another scheme raised HEU's
``RuntimeError('std::get: wrong index for variant')`` in the passive party's worker, a traceback naming
nobody. Both receivers of a peer's ciphertexts (the passive party's encrypted batch, the dominator's
masked gradient) are fed such buffers and mutated ones here.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from protocols import label_he
from protocols.errors import ProtocolViolation
from vertical.algorithms.vfb2 import Block

B = 16


@pytest.fixture(scope="module")
def parties(ou_key):
    """The dominator's OU key, and a passive party's side for it (sender of its key: party 0)."""
    key = ou_key
    X = sp.random(40, 5, density=0.5, random_state=0, format="csr")
    X.data = np.random.default_rng(0).integers(1, 4, X.nnz).astype(float)
    passive = label_he.BlockGradient(0, key.public_bytes(), block=Block.from_matrix(X), scheme="ou",
                                     key_bits=2048)
    return key, passive


def _foreign(count: int) -> bytes:
    """``count`` ciphertexts of another scheme (HEU's Mock): they load as a ciphertext array."""
    hnp, phe = label_he._heu()
    kit = hnp.setup(phe.SchemaType.Mock, 2048)
    return kit.encryptor().encrypt(kit.array(np.arange(count), phe.IntegerEncoder(phe.SchemaType.Mock, 1))
                                   ).serialize()


def test_ciphertexts_of_another_scheme_are_named_not_a_library_error(parties) -> None:
    key, passive = parties
    with pytest.raises(ProtocolViolation, match=r"^party 0 sent an invalid encrypted batch: does not "
                                                r"compute under its key \(std::get"):
        passive.masked(_foreign(B), np.arange(B))
    with pytest.raises(ProtocolViolation, match=r"^party 1 sent an invalid masked gradient: "):
        key.decrypt_masked(1, _foreign(4), B)
    honest = passive.masked(key.encrypt(np.full(B, 0.25)), np.arange(B))  # still works afterwards
    assert passive.unmask(key.decrypt_masked(1, honest, B)).shape == (5,)


def _mutations(buf: bytes, rng: np.random.Generator, n: int):
    for _ in range(n):
        b = bytearray(buf)
        kind = rng.integers(3)
        if kind == 0:  # a few random bytes
            for i in rng.integers(len(b), size=rng.integers(1, 8)):
                b[i] = rng.integers(256)
        elif kind == 1:  # truncated
            b = b[:rng.integers(1, len(b))]
        else:  # a word of ones or zeros
            i = rng.integers(len(b))
            b[i:i + 8] = bytes([255 * int(rng.integers(2))]) * 8
        yield bytes(b)


def test_mutated_buffers_are_computed_on_or_named_never_a_raw_exception(parties) -> None:
    """Whatever a mutated buffer does (most are refused, some still parse: a ciphertext is malleable),
    the receiver either computes or names the sender; any other exception fails here."""
    key, passive = parties
    rng = np.random.default_rng(26)
    batch = key.encrypt(rng.normal(size=B))
    named = 0
    for bad in _mutations(batch, rng, 30):
        try:
            passive.masked(bad, np.arange(B))
        except ProtocolViolation as err:
            assert str(err).startswith("party 0 sent an invalid encrypted batch: "), err
            named += 1
    reply = passive.masked(batch, np.arange(B))
    for bad in _mutations(reply, rng, 30):
        try:
            key.decrypt_masked(1, bad, B)
        except ProtocolViolation as err:
            assert str(err).startswith("party 1 sent an invalid masked gradient: "), err
            named += 1
    assert named >= 10  # the mutations do reach the checks
