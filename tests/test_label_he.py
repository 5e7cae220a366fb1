"""``--label-privacy he``: exact within the fixed point, refused where a batch gradient would give ϑ
away, the same training as plain mini-batch SGD, and a passive party's transcript holds no ϑ.

One key pair per scheme for the unit tests, shared by every HE test module (tests/conftest.py: OU key
generation takes 1-10 s on a loaded machine); the MPI tests share one HE job in sync mode, compared
with plain mini-batch SGD on the same rows in one process.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from experiments.label_attacks import Transcript, attack_all
from parties.config import ConfigError, RunConfig
from parties.plan import check_he_batch, check_he_features, resolve
from parties.runtime import (
    AUDIT_FULL_THETA,
    AUDIT_HE_FULL_GRADIENT,
    AUDIT_HE_GRADIENT,
    TAG_HE_BATCH,
    TAG_HE_DECRYPTED,
    TAG_HE_MASKED,
    TAG_THETA,
    PassBatches,
    check_envelope,
)
from protocols import label_he
from protocols.errors import ProtocolViolation
from tests.conftest import run_mpi
from tests.test_runtime import CANCER, LAM, metrics, train
from vertical.algorithms.vfb2 import Block
from vertical.datasets import load
from vertical.datasets.party_files import find_party_file, load_party_file
from vertical.label_privacy import gaussian_noise_multiplier
from vertical.problems import get_problem

# --------------------------------------------------------------------------------- the HE protocol


@pytest.fixture(scope="module")
def key(ou_key):
    return ou_key


def _block(rng, integral: bool) -> Block:
    X = sp.random(60, 9, density=0.5, random_state=int(integral), format="csr")
    X.data = rng.integers(1, 4, X.nnz).astype(float) if integral else rng.normal(0, 3, X.nnz)
    X.data[X.indices == 3] = 0.0  # a column no row uses: its gradient must still come back (as 0)
    X.eliminate_zeros()
    return Block.from_matrix(X)


@pytest.mark.parametrize("integral", [True, False])
def test_round_trip_is_exact_within_the_fixed_point_resolution(key, integral):
    rng = np.random.default_rng(3)
    block = _block(rng, integral)
    party = label_he.BlockGradient(0, key.public_bytes(), block=block)
    rows = rng.integers(0, block.n_rows, 20)
    thetas = rng.uniform(-1, 1, 20)
    gradient = party.unmask(key.decrypt_masked(1, party.masked(key.encrypt(thetas), rows), batch=20))
    X = block.to_csr()[rows]
    # the only errors are the roundings of ϑ (and of non-integral x) to the fixed-point grid
    quantised = np.rint(thetas * 2.0**label_he.THETA_BITS) / 2.0**label_he.THETA_BITS
    if integral:
        assert party.feature_bits == 0
        assert np.array_equal(gradient, X.T @ quantised)  # exact: integers all the way
    else:
        tolerance = (20 * 2.0**-label_he.THETA_BITS * np.abs(X).max()
                     + 20 * 2.0**-label_he.FEATURE_BITS)
        assert np.max(np.abs(gradient - X.T @ thetas)) < tolerance
    assert gradient.shape == (block.n_cols,) and gradient[3] == 0.0  # every column, also empty ones


@pytest.fixture(scope="module")
def paillier_key(paillier_2048_key):
    return paillier_2048_key


@pytest.mark.parametrize("scheme", ["ou", "paillier"])
def test_unmasking_is_exact_for_either_scheme_and_either_sign(key, paillier_key, scheme):
    """Integer features up to 100 and ϑ's of both signs up to ±100: g = X_Bᵀϑ below 2^53, so the float
    result must equal the integer sum exactly, whichever mask (uniform mod n, or 681 bits) hid it."""
    owner = key if scheme == "ou" else paillier_key
    rng = np.random.default_rng(11)
    X = sp.random(60, 9, density=0.6, random_state=3, format="csr")
    X.data = rng.integers(-100, 101, X.nnz).astype(float)
    party = label_he.BlockGradient(0, owner.public_bytes(), block=Block.from_matrix(X), scheme=scheme)
    for _ in range(3):
        rows = rng.choice(60, 20, replace=False)
        thetas = rng.integers(-100 * 2**20, 100 * 2**20, 20) / 2**20  # on the fixed-point grid
        gradient = party.unmask(owner.decrypt_masked(1, party.masked(owner.encrypt(thetas), rows), batch=20))
        assert np.array_equal(gradient, X[rows].T @ thetas)
        assert (gradient < 0).any() and (gradient > 0).any()


def test_masks_prepared_ahead_are_each_used_once_and_the_gradient_stays_exact(key):
    """Masks encrypted ahead of need (while the party waits for a decryption) are taken by the next masked
    pass and never again: over many passes, with and without a prepared set, no mask value repeats and
    no mask ciphertext is sent twice; at most PREPARED_PASSES sets wait. B = 300 > MASK_ROWS, and column 1
    has non-zeros only after the first piece's rows, column 3 none: both still sum exactly."""
    rng = np.random.default_rng(5)
    X = sp.random(300, 9, density=0.5, random_state=5, format="csr").toarray()
    X[X != 0] = rng.integers(1, 4, np.count_nonzero(X))
    X[:label_he.MASK_ROWS + 10, 1] = 0
    X[:, 3] = 0
    party = label_he.BlockGradient(0, key.public_bytes(), block=Block.from_matrix(sp.csr_matrix(X)))
    rows, seen, sent = np.arange(300), set(), set()
    for k in range(6):
        if k % 3:  # passes 1, 2, 4, 5 run on prepared masks, 0 and 3 draw on demand
            for _ in range(3):
                party.prepare_masks()
            assert len(party._prepared) == label_he.PREPARED_PASSES
            prepared = party._prepared[0][0]
        thetas = rng.integers(-100, 100, 300).astype(float)
        masked = party.masked(key.encrypt(thetas), rows)
        if k % 3:
            assert party._masks == prepared and not party._prepared  # taken, and gone from the pool
        assert seen.isdisjoint(party._masks) and len(set(party._masks)) == 9
        seen |= set(party._masks)
        cts = label_he._heu()[0].CiphertextArray.load_from(masked)
        texts = {str(cts[j]) for j in range(cts.size)}
        assert sent.isdisjoint(texts) and len(texts) == 9
        sent |= texts
        gradient = party.unmask(key.decrypt_masked(1, masked, batch=300))
        assert np.array_equal(gradient, X.T @ thetas) and gradient[3] == 0.0


def _with_masks(party, value: int):
    """Make ``party`` draw every mask equal to ``value`` (an extreme the uniform draw could give)."""
    n = party._modulus
    party.draw_masks = lambda count: ([value] * count,
                                      [value if n is None or value <= n // 2 else value - n] * count)


def test_unmasking_at_the_masks_extremes_wraps_exactly_where_the_docs_say(key, paillier_key):
    """Paillier: g + r mod n is g + r unless it leaves [0, n): g ≥ 0 with r ≥ n − g, or g < 0 with
    r < |g| (probability |g|/n each); then the passive party ends the job naming the dominator. OU: the
    widest mask with the most negative and the most positive g still unmasks exactly."""
    X = sp.csr_matrix(np.eye(20, 3))  # column j holds row j alone: g_j = ϑ_j
    thetas = np.zeros(20)
    for scheme, owner in (("ou", key), ("paillier", paillier_key)):
        party = label_he.BlockGradient(0, owner.public_bytes(), block=Block.from_matrix(X), scheme=scheme)
        top = party._modulus - 1 if scheme == "paillier" else (1 << label_he.ou_mask_bits(2048)) - 1
        for mask, g, exact in ((0, 0.5, True), (0, -0.5, scheme == "ou"), (top, -0.5, True),
                               (top, 0.5, scheme == "ou")):
            _with_masks(party, mask)
            thetas[:3] = g
            reply = owner.decrypt_masked(1, party.masked(owner.encrypt(thetas), np.arange(20)), batch=20)
            if exact:
                assert np.array_equal(party.unmask(reply), np.full(3, g)), (scheme, mask, g)
            else:
                with pytest.raises(ProtocolViolation, match="party 0 sent an invalid decrypted gradient"):
                    party.unmask(reply)


def test_masks_are_uniform_modulo_n_for_paillier_and_use_the_full_width_for_ou(key, paillier_key):
    block = _block(np.random.default_rng(1), True)
    party = label_he.BlockGradient(0, paillier_key.public_bytes(), block=block, scheme="paillier")
    n = party._modulus
    masks, encoded = party.draw_masks(4000)
    assert all(0 <= r < n and (e - r) % n == 0 and -(n // 2) <= e <= n // 2
               for r, e in zip(masks, encoded, strict=True))
    fractions = np.sort([(r >> (n.bit_length() - 53)) / 2.0**53 / (n >> (n.bit_length() - 53)) * 2.0**53
                         for r in masks])
    # Kolmogorov–Smirnov distance to the uniform on [0, 1): 1.95/√N is its 0.1 % level
    ecdf = np.arange(1, fractions.size + 1) / fractions.size
    assert np.max(np.abs(ecdf - fractions)) < 1.95 / math.sqrt(fractions.size)
    ou = label_he.BlockGradient(0, key.public_bytes(), block=block, scheme="ou")
    masks, encoded = ou.draw_masks(4000)
    assert masks == encoded and max(masks).bit_length() == label_he.ou_mask_bits(2048) == 681


def test_a_dominators_scaled_plaintexts_read_features_under_the_old_mask_and_nothing_under_paillier(
        paillier_key):
    """The dominator encrypts 2^(212+48i) instead of ϑ_i: under a 208-bit mask the decrypted column
    sums hold every x_ij in its own 48 bits; under a mask uniform mod n they hold nothing."""
    from tests.mpi_scripts.hostile_he import OLD_MASK_BITS, read_features, scaled_plaintexts

    rng = np.random.default_rng(7)
    X = sp.csr_matrix(rng.normal(size=(16, 3)))
    party = label_he.BlockGradient(0, paillier_key.public_bytes(), block=Block.from_matrix(X),
                                   scheme="paillier")
    k = paillier_key
    ones = k._encryptor.encrypt(k._kit.array(np.ones(16, dtype=np.int64), k._encoder))
    payload = k._kit.evaluator().mul(ones, k._kit.array(np.array(scaled_plaintexts(16), dtype=object),
                                                        k._big)).serialize()
    truth = np.rint(X.toarray() * 2.0**label_he.FEATURE_BITS).astype(np.int64)

    def read(masked: bytes) -> np.ndarray:
        cts = label_he._heu()[0].CiphertextArray.load_from(masked)
        values = k._decryptor.decrypt(cts).to_numpy(k._big).ravel()
        return np.array([read_features(int(v), 16) for v in values]).T  # signed, as HEU decrypts

    old = [int.from_bytes(np.random.bytes(OLD_MASK_BITS // 8), "little") for _ in range(3)]
    party.draw_masks = lambda count: (old, old)
    assert np.array_equal(read(party.masked(payload, np.arange(16))), truth)  # the first version: all of x
    del party.draw_masks
    guessed = read(party.masked(payload, np.arange(16)))
    assert np.mean(guessed == truth) < 0.05
    assert abs(np.corrcoef(guessed.ravel(), truth.ravel())[0, 1]) < 0.5


def test_a_paillier_ciphertext_with_jacobi_symbol_minus_one_is_refused(paillier_key):
    """Honest HEU ciphertexts (and their sums) have Jacobi symbol +1 mod n; one with −1 decrypts the same
    but would show, in the reply's symbol, the parity of its row's features: refused before replying."""
    from tests.mpi_scripts.hostile_he import flip_jacobi

    block = _block(np.random.default_rng(2), True)
    party = label_he.BlockGradient(0, paillier_key.public_bytes(), block=block, scheme="paillier")
    payload = paillier_key.encrypt(np.linspace(-1, 1, 20))
    honest = party.masked(payload, np.arange(20))
    party.unmask(paillier_key.decrypt_masked(1, honest, batch=20))  # an honest batch passes
    forged = flip_jacobi(payload, party._modulus, 5)
    k = paillier_key
    same = [k._decryptor.decrypt(label_he._heu()[0].CiphertextArray.load_from(p)).to_numpy(k._big).ravel()
            for p in (payload, forged)]
    assert list(same[0]) == list(same[1])  # the same plaintexts: only the randomness changed
    with pytest.raises(ProtocolViolation, match=r"party 0 sent an invalid encrypted batch: .*Jacobi symbol"):
        party.masked(forged, np.arange(20))


def _binary_paillier_party(key, seed: int) -> tuple[np.ndarray, label_he.BlockGradient]:
    """A passive party's 20 x 9 binary block under ``key``, whose row 5 has a 1 and a 0 (the row the
    forgeries below target), and the party."""
    X = (np.random.default_rng(seed).random((20, 9)) < 0.4).astype(float)
    X[5, :2] = [1.0, 0.0]
    return X, label_he.BlockGradient(0, key.public_bytes(), block=Block.from_matrix(X), scheme="paillier")


def test_a_negated_paillier_ciphertext_would_show_its_rows_features_and_is_refused(paillier_key):
    """HEU keeps a sign with each ciphertext, through its arithmetic: a dominator that negates row r's
    ciphertext (same plaintext, same Jacobi symbol) would read, in the sign of each column's masked reply,
    whether x_rj is odd: row r's binary features, with the gradients still right. Without the check
    the attack works (so the check below is what stops it); with it the batch is refused before any
    reply, naming the dominator."""
    from tests.mpi_scripts.hostile_he import negate

    X, party = _binary_paillier_party(paillier_key, 5)
    payload = paillier_key.encrypt(np.linspace(-1, 1, 20))
    forged = negate(payload, 5)
    load = label_he._heu()[0].CiphertextArray.load_from
    k = paillier_key
    plain = [k._decryptor.decrypt(load(p)).to_numpy(k._big).ravel() for p in (payload, forged)]
    assert list(plain[0]) == list(plain[1])  # the same plaintexts

    checked = party._check_probes
    party._check_probes = lambda cts: None  # the passive party without the sign probe
    reply = load(party.masked(forged, np.arange(20)))
    signs = np.array([str(reply[j]).startswith("-") for j in range(9)])
    assert np.array_equal(signs, X[5] == 1.0)  # the dominator reads row 5 from the signs alone
    honest = party.unmask(paillier_key.decrypt_masked(1, party.masked(forged, np.arange(20)), batch=20))
    assert np.allclose(honest, X.T @ np.linspace(-1, 1, 20), atol=1e-6)  # and nothing looks wrong

    party._check_probes = checked
    with pytest.raises(ProtocolViolation, match=r"party 0 sent an invalid encrypted batch: holds a negative"):
        party.masked(forged, np.arange(20))
    party.unmask(paillier_key.decrypt_masked(1, party.masked(payload, np.arange(20)), batch=20))


@pytest.mark.parametrize("forgery", ["zero", "n"])
def test_a_paillier_ciphertext_sharing_a_factor_with_n_is_refused(paillier_key, forgery):
    """A dominator's "ciphertext" 0 or n (no encryption: not a unit mod n²) would make every column
    reply that includes its row share a factor with n, which its key holder sees (gcd) while nothing
    fails: the row's binary features again. Its Jacobi symbol is 0, so the probes refuse the batch."""
    import math

    from tests.mpi_scripts.hostile_he import replace

    X, party = _binary_paillier_party(paillier_key, 6)
    n = party._modulus
    forged = replace(paillier_key.encrypt(np.linspace(-1, 1, 20)), 5, 0 if forgery == "zero" else n)
    checked = party._check_probes
    party._check_probes = lambda cts: None
    reply = label_he._heu()[0].CiphertextArray.load_from(party.masked(forged, np.arange(20)))
    shares = np.array([math.gcd(int(str(reply[j])), n) > 1 for j in range(9)])
    assert np.array_equal(shares, X[5] == 1.0)  # without the probes: row 5 read from the replies
    party._check_probes = checked
    with pytest.raises(ProtocolViolation, match=r"party 0 sent an invalid encrypted batch: .*Jacobi symbol"):
        party.masked(forged, np.arange(20))


def test_the_active_party_sees_only_masked_values(key):
    """Two batches with the same gradient decrypt to unrelated numbers: the mask is fresh each time."""
    block = _block(np.random.default_rng(4), True)
    party = label_he.BlockGradient(0, key.public_bytes(), block=block)
    rows = np.arange(20)
    payload = key.encrypt(np.full(20, 0.25))
    first = key.decrypt_masked(1, party.masked(payload, rows), batch=20)
    party.unmask(first)
    second = key.decrypt_masked(1, party.masked(payload, rows), batch=20)
    assert not np.array_equal(first, second)
    # high words of (g + r) mod 2^128 spread over the whole range, as uniform words would
    assert np.ptp(second[1::2].astype(np.float64)) > 2.0**60


def test_a_bad_message_is_refused_naming_its_sender(key):
    block = _block(np.random.default_rng(5), True)
    party = label_he.BlockGradient(0, key.public_bytes(), block=block)
    payload = key.encrypt(np.zeros(20))
    with pytest.raises(ProtocolViolation, match="party 0 sent an invalid encrypted batch"):
        party.masked(payload, np.arange(19))  # 20 ciphertexts for 19 rows
    with pytest.raises(ProtocolViolation, match="party 0 sent an invalid encrypted batch"):
        party.masked(b"\x93" + payload[1:-7], np.arange(20))
    with pytest.raises(ProtocolViolation, match="party 2 sent an invalid masked gradient"):
        key.decrypt_masked(2, b"not a ciphertext", batch=20)
    words = label_he.pack_batch(0, np.array([0, 60]), b"xx")
    with pytest.raises(ProtocolViolation, match=r"row 60 is not in 0\.\.59"):
        label_he.unpack_batch(0, words, n_rows=60, batch=2)
    with pytest.raises(ProtocolViolation, match="public key"):
        label_he.BlockGradient(0, b"\x00" * 40, block=block)


def test_the_active_party_never_decrypts_a_gradient_that_determines_theta(key):
    """A gradient of B or more values is a system the passive party could solve for the batch's ϑ."""
    block = _block(np.random.default_rng(6), True)  # 9 columns
    party = label_he.BlockGradient(0, key.public_bytes(), block=block)
    masked = party.masked(key.encrypt(np.zeros(9)), np.arange(9))
    with pytest.raises(ProtocolViolation, match="9 values for a batch of 9"):
        key.decrypt_masked(1, masked, batch=9)


def test_he_messages_pass_the_envelope_only_in_he_mode_and_in_their_direction():
    ok = dict(active_ranks=[0], synchronous=False, he=True)
    check_envelope(0, TAG_HE_BATCH, 64, rank=1, **ok)  # dominator → passive party
    check_envelope(0, TAG_HE_DECRYPTED, 64, rank=1, **ok)
    check_envelope(1, TAG_HE_MASKED, 64, rank=0, **ok)  # passive party → dominator
    for source, tag, rank, he in ((0, TAG_HE_BATCH, 1, False), (1, TAG_HE_BATCH, 2, True),
                                  (1, TAG_HE_MASKED, 2, True), (0, TAG_HE_MASKED, 1, True)):
        with pytest.raises(ProtocolViolation, match=f"party {source} may not send it to party {rank}"):
            check_envelope(source, tag, 64, rank=rank, active_ranks=[0], synchronous=False, he=he)


def test_he_mode_refuses_what_would_reveal_theta():
    base = dict(dataset="breast-cancer", parties=3, active=1, algorithm="sgd", label_privacy="he",
                batch_size=16)
    resolve(RunConfig(**base))  # breast-cancer: 30 features, widest block of 3 parties 10 columns
    resolve(RunConfig(**{**base, "algorithm": "svrg"}))
    for bad, message in ((dict(batch_size=1), "at least 16"), (dict(batch_size=8), "at least 16"),
                         (dict(algorithm="saga"), "sgd or svrg"),
                         (dict(algorithm="saga-scalar"), "sgd or svrg"),
                         (dict(updates="lazy"), "eager"), (dict(he_key_bits=1024), "he-key-bits")):
        with pytest.raises(ConfigError, match=message):
            resolve(RunConfig(**{**base, **bad}))
    # a passive block of 40 columns: B = 40 would leave 40 equations for 40 unknowns
    with pytest.raises(ConfigError, match=r"at least 41 here.*40 columns"):
        check_he_batch(RunConfig(**{**base, "batch_size": 40}), 40, 1000)
    check_he_batch(RunConfig(**{**base, "batch_size": 41}), 40, 1000)
    # SVRG's snapshot gives X_lᵀϑ_0 over all n rows: n ≤ d_l equations determine ϑ_0 (news20's shape)
    with pytest.raises(ConfigError, match="snapshot's X_lᵀϑ_0 would determine ϑ_0"):
        check_he_batch(RunConfig(**{**base, "batch_size": 41, "algorithm": "svrg"}), 40, 40)
    check_he_batch(RunConfig(**{**base, "batch_size": 41, "algorithm": "svrg"}), 40, 41)
    with pytest.raises(ConfigError, match="scale the features"):  # as given: 3e6 is past the fixed point
        check_he_features(RunConfig(**base, standardize="off"), [sp.csr_matrix(np.full((2, 2), 3e6))])
    check_he_features(RunConfig(**base), [sp.csr_matrix(np.full((2, 2), 3e6))])  # scaled by each party: 1


def test_noisy_thetas_add_a_noise_drawn_without_looking_at_theta_on_the_fixed_point_grid():
    """--epsilon: ϑ̃·2^32 = rint(ϑ·2^32) + rint(N·2^32), exactly (the sum of two integers), so the noise
    is independent of ϑ's float representation; its spread is σ."""
    grid = 2.0**label_he.THETA_BITS
    thetas = np.random.default_rng(1).uniform(-1, 1, 20_000)
    noisy = label_he.noisy_thetas(thetas, 3.0, np.random.default_rng(2))
    again = label_he.noisy_thetas(thetas + 1e-12, 3.0, np.random.default_rng(2))  # ϑ moved within a step
    expected = np.rint(thetas * grid) + np.rint(np.random.default_rng(2).normal(0.0, 3.0, thetas.size) * grid)
    assert np.array_equal(noisy * grid, expected) and np.array_equal(noisy * grid, np.rint(noisy * grid))
    assert np.array_equal(again - np.rint(thetas * grid + 1e-12 * grid) / grid,
                          noisy - np.rint(thetas * grid) / grid)
    assert abs(np.std(noisy - thetas) / 3.0 - 1) < 0.03
    with pytest.raises(OverflowError, match="noise"):
        label_he.noisy_thetas(thetas[:3], 2.0**(label_he.VALUE_BITS + 4), np.random.default_rng(0))


# ------------------------------------------------------------------------------------- real jobs


B, EPOCHS = 16, 1
#: The SVRG job: half an epoch in two outer loops (a snapshot at the start of each quarter epoch).
SVRG_EPOCHS, SVRG_EVAL_EVERY = 0.5, 0.25


class Jobs:
    """A module's MPI jobs, all submitted when the first test needs one and run three at a time: a job is
    mostly waits (rank start-up, the dominator's key process, lock-step exchanges), so on two cores three
    together take well under the time of one after another. They are submitted in the order the tests
    read them; each test waits for its own and asserts on it alone (``-k`` on one test runs them all)."""

    def __init__(self, starts: dict[str, Callable[[], object]], workers: int = 3) -> None:
        self._pool = ThreadPoolExecutor(workers)
        self._futures = {name: self._pool.submit(start) for name, start in starts.items()}

    def __getitem__(self, name: str):
        return self._futures[name].result()

    def trained(self, name: str) -> Path:
        """The folder of ``vfl train`` job ``name``, which must have exited 0."""
        out, proc = self[name]
        if proc.returncode != 0:
            pytest.fail(f"vfl train failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def train_job(out: Path, *args: str) -> Callable[[], tuple[Path, subprocess.CompletedProcess]]:
    return lambda: (out, train(out, *args, check=False))


def hostile_job(out: Path, *args: str) -> Callable[[], subprocess.CompletedProcess]:
    out.mkdir(parents=True, exist_ok=True)
    return lambda: run_mpi(3, ["tests/mpi_scripts/hostile_he.py", args[0], str(out), *args[1:]], timeout=300,
                           check=False)


def tamper_job(scenario: str) -> Callable[[], subprocess.CompletedProcess]:
    return lambda: run_mpi(3, ["tests/mpi_scripts/tamper_he.py", scenario], timeout=180, check=False)


#: the huge-ε job's batch and step, and the ε = 0.2 job's batch
HUGE_EPSILON_BATCH, HUGE_EPSILON_GAMMA, EPSILON_BATCH = 64, 0.04, 64
HOSTILE = {"passive-none": ("passive", "none"), "passive-1": ("passive", "1"),
           "dominator-paillier": ("dominator", "paillier"), "dominator-ou": ("dominator", "ou"),
           "jacobi": ("jacobi",), "sign": ("sign",)}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("he-jobs")
    he = ("-n", "3", "-m", "1", "--label-privacy", "he")
    sync_sgd = (*he, "--algorithm", "sgd", "--mode", "sync")
    starts = {
        "svrg": train_job(root / "he-svrg", *he, "--algorithm", "svrg", "--mode", "sync", "-B", str(B),
                          "--epochs", str(SVRG_EPOCHS), "--eval-every", str(SVRG_EVAL_EVERY),
                          "--snapshot-every", str(SVRG_EVAL_EVERY), "--audit", *CANCER),
        "sgd": train_job(root / "he", *sync_sgd, "-B", str(B), "--epochs", str(EPOCHS), "--audit", *CANCER),
        **{f"tamper-{scenario}": tamper_job(scenario) for scenario in ("wide", "full-wide", "full-huge")},
        "huge-epsilon": train_job(root / "huge-epsilon", *sync_sgd, "-B", str(HUGE_EPSILON_BATCH), "--epochs",
                                  "1", "--epsilon", "1e4", *CANCER[:-2], "--gamma", str(HUGE_EPSILON_GAMMA)),
        "epsilon": train_job(root / "epsilon", *he, "--algorithm", "sgd", "-B", str(EPSILON_BATCH),
                             "--epochs", "3", "--epsilon", "0.2", "--audit", *CANCER[:-2], "--gamma", "1e-4"),
        **{name: hostile_job(root / name, *args) for name, args in HOSTILE.items()},
    }
    started = Jobs(starts)
    yield started
    started.close()


@pytest.fixture(scope="module")
def he_run(jobs):
    return jobs.trained("sgd")


def plain_mini_batch_sgd(out) -> list[np.ndarray]:
    """Plain mini-batch VFB²-SGD in one process on the job's own party files: the rows the dominator
    (rank 0, seed 0) draws, ϑ in clear, every block stepped right away (what sync mode does)."""
    parties = [load_party_file(find_party_file(out / "parties", r)) for r in range(3)]
    y, n = parties[0].y_train, parties[0].y_train.size
    problem = get_problem("logistic", lam=LAM)
    gamma = float(CANCER[CANCER.index("--gamma") + 1])
    ws = [np.zeros(p.X_train.shape[1]) for p in parties]
    for rows in np.random.default_rng([0, 0]).integers(0, n, size=(math.ceil(EPOCHS * n / B), B)):
        theta = problem.theta(sum(p.X_train[rows] @ w for p, w in zip(parties, ws, strict=True)), y[rows])
        for p, w in zip(parties, ws, strict=True):
            w -= gamma * LAM * w  # λ∇g(w) for g = ||w||²/2, then the mean of the B loss parts
            w -= gamma / B * (p.X_train[rows].T @ theta)
    return ws


@pytest.fixture(scope="module")
def he_svrg_run(jobs):
    return jobs.trained("svrg")


def plain_mini_batch_svrg(out) -> list[np.ndarray]:
    """Plain mini-batch VFB²-SVRG in one process: at the start of each outer loop ϑ_0 and μ = X_lᵀϑ_0/n
    at the current w, then steps w −= γ (X_Bᵀ(ϑ − ϑ_0,B)/B + μ + λw), drawn in the runtime's chunks."""
    parties = [load_party_file(find_party_file(out / "parties", r)) for r in range(3)]
    y, n = parties[0].y_train, parties[0].y_train.size
    problem = get_problem("logistic", lam=LAM)
    gamma = float(CANCER[CANCER.index("--gamma") + 1])
    ws = [np.zeros(p.X_train.shape[1]) for p in parties]
    rng = np.random.default_rng([0, 0])
    for _ in range(round(SVRG_EPOCHS / SVRG_EVAL_EVERY)):
        theta0 = problem.theta(sum(p.X_train @ w for p, w in zip(parties, ws, strict=True)), y)
        mus = [p.X_train.T @ theta0 / n for p in parties]
        for rows in rng.integers(0, n, size=(math.ceil(SVRG_EVAL_EVERY * n / B), B)):
            theta = problem.theta(sum(p.X_train[rows] @ w for p, w in zip(parties, ws, strict=True)), y[rows])
            for p, w, mu in zip(parties, ws, mus, strict=True):
                w -= gamma * (mu + LAM * w)
                w -= gamma / B * (p.X_train[rows].T @ (theta - theta0[rows]))
    return ws


@pytest.mark.mpi
def test_he_svrg_equals_plain_mini_batch_svrg_and_passive_parties_get_only_mu(he_svrg_run):
    """SVRG under HE: the same iterates as plain mini-batch SVRG, and a passive party's transcript
    holds no ϑ (neither the batches' nor the snapshots' ϑ_0): one X_lᵀϑ_0 per snapshot instead."""
    for rank, plain in enumerate(plain_mini_batch_svrg(he_svrg_run)):
        he = np.load(he_svrg_run / f"party-{rank}.ckpt.npz")["w"]
        assert np.max(np.abs(plain)) > 0.01
        assert np.max(np.abs(he - plain)) < 1e-6, rank
    for passive in (1, 2):
        t = Transcript.load(he_svrg_run / f"audit-{passive}.npz")
        assert not t.of_tag(TAG_THETA) and not t.of_tag(AUDIT_FULL_THETA)
        assert len(t.of_tag(AUDIT_HE_FULL_GRADIENT)) == round(SVRG_EPOCHS / SVRG_EVAL_EVERY) == 2
        X = load_party_file(find_party_file(he_svrg_run / "parties", passive), expect_labels=False).X_train
        found = attack_all(he_svrg_run / f"audit-{passive}.npz", load("breast-cancer", seed=0).y_train, X)
        assert found["theta_sign"]["coverage"] == found["full_theta"]["coverage"] == 0.0
        # what HE does not hide: the snapshot's X_lᵀϑ_0, inverted like a batch gradient (docs)
        assert found["full_gradient"]["coverage"] == 1.0
        assert found["full_gradient"]["accuracy"] > found["full_gradient"]["majority"]


@pytest.mark.mpi
def test_he_training_equals_plain_mini_batch_training(he_run):
    for rank, plain in enumerate(plain_mini_batch_sgd(he_run)):
        he = np.load(he_run / f"party-{rank}.ckpt.npz")["w"]
        assert np.max(np.abs(plain)) > 0.01
        assert np.max(np.abs(he - plain)) < 1e-6, rank
    assert metrics(he_run)[-1]["updates"] == math.ceil(EPOCHS * 455 / B)


@pytest.mark.mpi
def test_a_passive_party_receives_no_theta(he_run):
    y = load("breast-cancer", seed=0).y_train
    for passive in (1, 2):
        t = Transcript.load(he_run / f"audit-{passive}.npz")
        assert not t.of_tag(TAG_THETA) and not t.of_tag(AUDIT_FULL_THETA)
        assert len(t.of_tag(TAG_HE_BATCH)) == len(t.of_tag(TAG_HE_DECRYPTED)) == len(
            t.of_tag(AUDIT_HE_GRADIENT)) > 20
        X = load_party_file(find_party_file(he_run / "parties", passive), expect_labels=False).X_train
        found = attack_all(he_run / f"audit-{passive}.npz", y, X)
        # the ϑ attacks have nothing to read: the party is left with the majority guess, chance
        assert found["theta_sign"]["coverage"] == found["full_theta"]["coverage"] == 0.0
        # what HE does not hide (docs/label-privacy.md): the batch gradients X_Bᵀϑ the party must
        # learn to update its block; at w ≈ 0, ϑ ≈ −y/2 and their least-squares inversion recovers
        # what the party's own features can predict of the labels
        assert found["batch_gradient"]["accuracy"] > found["batch_gradient"]["majority"] + 0.2


@pytest.mark.mpi
def test_the_dominator_ends_the_job_rather_than_decrypt_a_gradient_that_reveals_theta(jobs):
    """Passive party 1 answers an encrypted batch of B rows with B ciphertexts (from which it could
    solve for ϑ once decrypted): the dominator refuses in a real job and names party 1. The same
    script's ``garbage`` forgery is refused the same way (not run here: one job is enough for CI)."""
    proc = jobs["tamper-wide"]
    output = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 139, -11) and "NOT REJECTED" not in output, output
    assert "party 1 sent an invalid masked gradient: 16 values for a batch of 16" in output, output


@pytest.mark.mpi
@pytest.mark.parametrize("scenario, message", [
    ("full-wide", "party 1 sent an invalid masked gradient: 40 values for a batch of 40"),
    ("full-huge", "party 1 sent an invalid masked full gradient: announced 1099511627776 words"),
])
def test_the_leader_refuses_a_forged_answer_to_the_snapshots_encrypted_full_pass(jobs, scenario, message):
    """SVRG under HE: passive party 1 answers the snapshot's encrypted ϑ_0 with the n ciphertexts
    themselves (decrypted, they would be ϑ_0), or announces an answer too large to allocate."""
    proc = jobs[f"tamper-{scenario}"]
    output = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 139, -11) and "NOT REJECTED" not in output, output
    assert message in output, output


def noiseless_replay(out, batch: int, gamma: float) -> list[np.ndarray]:
    """Plain mini-batch SGD in one process on the job's party files and its pass batches (dominator 0,
    seed 0), every block stepped right away, ϑ without noise: what the job's blocks are up to ϑ̃ − ϑ."""
    parties = [load_party_file(find_party_file(out / "parties", r)) for r in range(3)]
    y, n = parties[0].y_train, parties[0].y_train.size
    problem = get_problem("logistic", lam=LAM)
    ws = [np.zeros(p.X_train.shape[1]) for p in parties]
    for rows in PassBatches(n, batch, 1, 0, seed=0).take(metrics(out)[-1]["updates"]):
        theta = problem.theta(sum(p.X_train[rows] @ w for p, w in zip(parties, ws, strict=True)), y[rows])
        for p, w in zip(parties, ws, strict=True):
            w -= gamma * LAM * w
            w -= gamma / batch * (p.X_train[rows].T @ theta)
    return ws


@pytest.mark.mpi
def test_with_epsilon_every_party_steps_with_the_noisy_thetas_at_a_huge_epsilon(jobs):
    """--epsilon at a huge ε (σ ≈ 0.01 on each ϑ): every block is plain mini-batch SGD on the pass
    batches up to that noise (the other test shows the active block takes it too). One epoch of 8
    batches at twice the usual step moves the blocks as far as two epochs do (HE batches are slow)."""
    batch, gamma = HUGE_EPSILON_BATCH, HUGE_EPSILON_GAMMA
    out = jobs.trained("huge-epsilon")
    ws = noiseless_replay(out, batch, gamma)
    assert 0.005 < json.loads((out / "config.json").read_text())["noise_multiplier"] < 0.05
    for rank in range(3):
        he = np.load(out / f"party-{rank}.ckpt.npz")["w"]
        assert np.max(np.abs(ws[rank])) > 0.05
        assert 1e-6 < np.max(np.abs(he - ws[rank])) < 1e-2, rank


@pytest.mark.mpi
def test_with_epsilon_a_passive_party_gets_its_batch_gradient_only_from_noisy_thetas(jobs):
    """--epsilon: each ϑ is encrypted with N(0, σ²) added, so the gradient a passive party unmasks is
    X_Bᵀϑ̃ = X_Bᵀϑ + X_Bᵀν, whose noise has covariance σ²X_BᵀX_B. At ε = 0.2 and a tiny step, ϑ ≈ −y/2
    all along, and the residuals whitened by that covariance are independent N(0, 1) (a departure of ϑ
    from −y/2 by δ moves them by at most ‖δ‖/σ). Every block, the active party's included, then differs
    from the noiseless run by γ/B·Σ_t X_Bᵀν_t, of spread σγ/B·√(Σ_t Σ_i x_ij²) per coordinate; an
    active party stepping with the true ϑ would differ by orders of magnitude less. The batches of a pass
    hold each row at most once. The RMS ratio over a block's 10 correlated columns is wide: drawn from
    this very model, 0.4–2.0 failed 6.7 % of correct jobs, 0.15–3.0 fails 0.015 %."""
    batch = EPSILON_BATCH
    out = jobs.trained("epsilon")
    config = json.loads((out / "config.json").read_text())
    sigma = config["noise_multiplier"]
    assert sigma > 20
    y = load_party_file(find_party_file(out / "parties", 0)).y_train
    for passive in (1, 2):
        t = Transcript.load(out / f"audit-{passive}.npz")
        X = sp.csr_matrix(load_party_file(find_party_file(out / "parties", passive),
                                          expect_labels=False).X_train)
        rows = [label_he.unpack_batch(0, w, n_rows=455, batch=batch)[1] for w in t.of_tag(TAG_HE_BATCH)]
        gradients = [g.view(np.float64) for g in t.of_tag(AUDIT_HE_GRADIENT)]
        assert len(rows) == len(gradients) == 24  # 3 epochs of ⌈455/64⌉ = 8 batches
        z = np.concatenate([np.linalg.solve(np.linalg.cholesky(sigma**2 * (X[r].T @ X[r]).toarray()),
                                            g - X[r].T @ (-y[r] / 2))
                            for r, g in zip(rows, gradients, strict=True)])
        # 240 whitened draws: |std − 1| ≥ 0.18 in 0.008 % of correct jobs (χ²; 0.15 failed 0.10 %)
        assert z.size == 24 * 10 and abs(z.std() - 1) < 0.18 and abs(z.mean()) < 4 / math.sqrt(z.size)
        for start in range(0, len(rows) - 6, 7):  # a pass: 7 batches of 64 of the 455 rows
            chunk = np.concatenate(rows[start:start + 7])
            assert np.unique(chunk).size == chunk.size
    passes = PassBatches(455, batch, 1, 0, seed=0).take(24)
    for rank, plain in enumerate(noiseless_replay(out, batch, 1e-4)):
        X = sp.csr_matrix(load_party_file(find_party_file(out / "parties", rank)).X_train)
        spread = sigma * 1e-4 / batch * np.sqrt(sum(np.asarray(X[r].multiply(X[r]).sum(axis=0)).ravel()
                                                    for r in passes))
        ratio = np.sqrt(np.mean(((np.load(out / f"party-{rank}.ckpt.npz")["w"] - plain) / spread) ** 2))
        assert 0.15 < ratio < 3.0, (rank, ratio)


def _hostile(tmp_path, *args: str):
    proc = hostile_job(tmp_path, *args)()
    return proc, proc.stdout + proc.stderr


def _hostile_of(jobs, name: str) -> tuple[Path, subprocess.CompletedProcess, str]:
    """Job ``name`` of :data:`HOSTILE`: its folder, its process, its output."""
    proc = jobs[name]
    folder = Path(proc.args[proc.args.index("tests/mpi_scripts/hostile_he.py") + 2])
    return folder, proc, proc.stdout + proc.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("epsilon", ["none", "1"])
def test_a_malicious_passive_party_reads_theta_under_plain_he_and_only_noise_under_epsilon(jobs, epsilon):
    """Passive party 1 has the dominator decrypt the batch's own ciphertexts (re-randomised, B − 1 a
    batch; or packed two a ciphertext, all B). Plain he: it reads every ϑ, hence every label (the case
    docs/label-privacy.md states is not covered). he --epsilon 1: it reads ϑ̃ = ϑ + N(0, σ²) exactly, and
    its guess −sign(ϑ̃) stays within the label-DP bound max(p, e^ε/(1 + e^ε)) + δ, up to sampling error."""
    from tests.mpi_scripts.hostile_he import ATTACK_ROWS

    out, proc, output = _hostile_of(jobs, f"passive-{epsilon}")
    assert proc.returncode == 0, output
    y = np.load(out / "labels.npy")
    attack = np.load(out / "attack.npz")
    rows, values = attack["rows"], attack["values"]
    assert rows.size > 0.9 * ATTACK_ROWS  # 15 of 16 rows, or all 16, of every batch
    accuracy = np.mean(-np.sign(values) == y[rows])
    if epsilon == "none":
        assert accuracy == 1.0
        return
    sigma = gaussian_noise_multiplier(1.0, 1e-5, 1)
    # it did read the ciphertexts' contents: ϑ̃, whose spread is √(σ² + Var ϑ), Var ϑ ≈ 1/4 here (ϑ ≈ ∓1/2);
    # ~465 values estimate it to ±3 %
    assert abs(values.std() / math.sqrt(sigma**2 + 0.25) - 1) < 0.15
    _, first = np.unique(rows, return_index=True)  # one release per row (the job is one pass)
    hits = (-np.sign(values) == y[rows])[first]
    p = max(np.mean(y == 1), np.mean(y == -1))
    bound = max(p, math.e / (1 + math.e)) + 1e-5
    assert np.mean(hits) <= bound + 3 * math.sqrt(bound * (1 - bound) / hits.size), np.mean(hits)


@pytest.mark.mpi
def test_a_malicious_dominator_reads_no_features_under_paillier(jobs):
    """The dominator encrypts 2^(212+48i) instead of ϑ_i and decrypts the replies in full: with each
    mask uniform mod n the 48-bit fields it reads are unrelated to the passive parties' features."""
    from tests.mpi_scripts.hostile_he import SPY_ROWS, party, read_features

    out, proc, output = _hostile_of(jobs, "dominator-paillier")
    assert proc.returncode == 0, output
    spy = np.load(out / "spy.npz")
    for passive in (1, 2):
        X = party(passive, SPY_ROWS).block.to_csr().toarray()
        truth = np.rint(X * 2.0**label_he.FEATURE_BITS).astype(np.int64)
        values = [int(v, 16) for v in spy[f"from_{passive}"]]
        assert len(values) == len(spy["rows"]) * X.shape[1] > 0
        guessed = np.concatenate([read_features(values[3 * k + j], rows.size)
                                  for k, rows in enumerate(spy["rows"]) for j in range(3)])
        actual = np.concatenate([truth[rows, j] for rows in spy["rows"] for j in range(3)])
        assert np.mean(guessed == actual) < 0.01
        assert abs(np.corrcoef(guessed, actual)[0, 1]) < 0.2


@pytest.mark.mpi
@pytest.mark.parametrize("scenario, message", [
    ("dominator-ou", "party 0 sent an invalid decrypted gradient: column"),
    ("jacobi", "party 0 sent an invalid encrypted batch: holds a ciphertext whose Jacobi symbol"),
    ("sign", "party 0 sent an invalid encrypted batch: holds a negative ciphertext"),
])
def test_a_passive_party_ends_the_job_naming_a_malicious_dominator(jobs, scenario, message):
    """OU: the same scaled plaintexts run past p and the decryption wraps; the unmasked value is then no
    sum honest ϑ's can make. Paillier: a ciphertext of Jacobi symbol −1, or a negative one, is refused
    before any reply."""
    _, proc, output = _hostile_of(jobs, scenario)
    assert proc.returncode not in (0, 139, -11), output
    assert message in output, output


def test_the_encryption_library_does_not_write_into_a_runs_output():
    """HEU logs "Create a fixed thread pool" on standard output when its pool starts; a run's output
    (each rank's, echoed by the launcher) must not carry it, while our own prints still get through."""
    code = ("import numpy as np; from protocols import label_he; "
            "key = label_he.LabelKey('ou', 2048); key.encrypt(np.array([0.5, -0.25, 1.0])); print('ours')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.stdout == "ours\n" and "thread pool" not in proc.stderr


def test_the_jobs_benchmark_alternates_the_trees_and_tables_every_job(tmp_path):
    """``python -m experiments label_he_jobs``: each (scheme, ε, seed) runs in both trees, in alternating
    order, HE without noise in this tree only; the table has one row per (scheme, ε, noise)."""
    import argparse

    from experiments.bench_label_he_jobs import plan, write

    args = argparse.Namespace(seeds=[0, 1], schemes=["ou"], epsilons=["4", "none"], noise=["new", "old"])
    jobs = plan(args)
    assert [j[0] for j in jobs] == ["new", "old", "none", "old", "new", "none"]
    runs = [{"noise": noise, "scheme": scheme, "epsilon": eps, "seed": seed, "seconds_per_epoch": 10.0 + k,
             "wall_s": 30.0, "test_accuracy": 0.8 + k / 100, "epochs": 1.0, "updates": 128,
             "noise_multiplier": None if eps == "none" else 1.2, "command": "vfl train ...",
             "load_before": 1.0, "load_after": 2.0} for k, (noise, scheme, eps, seed) in enumerate(jobs)]
    meta = {"cpu": "test CPU", "base": "abc", "command": "python -m experiments label_he_jobs"}
    write(tmp_path, meta, runs)
    table = (tmp_path / "table.md").read_text()
    assert "| ou | 4 | new | 82.00 % (80.00, 84.00) | 12.0 (10.0, 14.0) | 1.2 |" in table
    assert table.count("| ou |") == 3 and "test CPU; load average 1.0–2.0" in table
    assert (tmp_path / "label_he_jobs.png").stat().st_size > 0


def test_the_noise_simulation_compares_every_mechanism_at_each_epsilon(tmp_path):
    """``python -m experiments label_dp_sim``: one row per (ε, mechanism), each with its seeds' accuracies,
    the Gaussian ones with the σ the accountant gives for the run's passes."""
    from experiments.label_dp_sim import MECHANISMS, main

    main(["--dataset", "breast-cancer", "--epsilons", "2", "--seeds", "2", "--epochs", "1", "--batch", "64",
          "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["mechanism"] for r in rows] == list(MECHANISMS) and all(len(r["accuracies"]) == 2 for r in rows)
    # 1 epoch = ⌈455/64⌉ = 8 steps, 7 batches a pass: two releases per row
    assert rows[1]["sigma"] == pytest.approx(gaussian_noise_multiplier(2.0, 1e-5, 2))
    assert all(0.5 < r["mean"] <= 1 for r in rows) and "| 2 | rr |" in (tmp_path / "table.md").read_text()
