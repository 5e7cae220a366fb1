"""``--label-privacy he``: exact within the fixed point, refused where a batch gradient would give ϑ
away, the same training as plain mini-batch SGD, and a passive party's transcript holds no ϑ.

One key pair for the unit tests (OU key generation takes 1-10 s on a loaded machine); the MPI tests
share one HE job in sync mode, compared with plain mini-batch SGD on the same rows in one process.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
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
from vertical.label_privacy import clip_scales, row_norm_bound
from vertical.problems import get_problem

# --------------------------------------------------------------------------------- the HE protocol


@pytest.fixture(scope="module")
def key():
    return label_he.LabelKey("ou", 2048)


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


def test_clipped_rows_change_the_gradient_only_by_their_scale(key):
    """--clip-quantile: the passive party's gradient is Σ ϑ_i s_i x_i, from rows scaled by s_i ≤ 1."""
    rng = np.random.default_rng(5)
    block = _block(rng, True)
    party = label_he.BlockGradient(0, key.public_bytes(), block=block)
    scale = np.where(rng.random(block.n_rows) < 0.5, 1.0, rng.uniform(0.1, 1.0, block.n_rows))
    party.clip_rows(scale)
    rows = rng.integers(0, block.n_rows, 20)
    thetas = rng.uniform(-1, 1, 20)
    gradient = party.unmask(key.decrypt_masked(1, party.masked(key.encrypt(thetas), rows), batch=20))
    X = block.to_csr()[rows]
    assert party.feature_bits == label_he.FEATURE_BITS  # scaled integers are fixed point now
    assert np.max(np.abs(gradient - X.T @ (thetas * scale[rows]))) < 1e-4
    with pytest.raises(ValueError, match="one factor in"):
        party.clip_rows(np.full(block.n_rows, 1.5))


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


def test_noise_is_added_exactly_in_the_passive_partys_fixed_point():
    """add_noise: (g + r + rint(noise·2^k)) mod 2^128, so the party unmasks g + noise to its resolution."""
    rng = np.random.default_rng(3)
    full = 1 << label_he.RETURN_BITS
    values = [int(v) % full for v in rng.integers(-2**62, 2**62, 6).tolist()] + [full - 1, 0]
    noise = rng.normal(0.0, 50.0, len(values))
    for bits in (label_he.THETA_BITS, label_he.THETA_BITS + label_he.FEATURE_BITS):
        noisy = label_he.add_noise(label_he._to_words(values), noise, bits)
        out = label_he._from_words(0, noisy, len(values))
        offsets = np.rint(noise * 2.0**bits)
        assert out == [(v + int(o)) % full for v, o in zip(values, offsets, strict=True)]
    with pytest.raises(OverflowError, match="noise"):
        label_he.add_noise(label_he._to_words([1]), np.array([np.nan]), label_he.THETA_BITS)


# ------------------------------------------------------------------------------------- real jobs


B, EPOCHS = 16, 1
#: The SVRG job: two outer loops (a snapshot at the start of each half epoch).
SVRG_EVAL_EVERY = 0.5


@pytest.fixture(scope="module")
def he_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("he")
    train(out, "-n", "3", "-m", "1", "--algorithm", "sgd", "--mode", "sync", "-B", str(B), "--epochs",
          str(EPOCHS), "--label-privacy", "he", "--audit", *CANCER)
    return out


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
def he_svrg_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("he-svrg")
    train(out, "-n", "3", "-m", "1", "--algorithm", "svrg", "--mode", "sync", "-B", str(B), "--epochs",
          str(EPOCHS), "--eval-every", str(SVRG_EVAL_EVERY), "--snapshot-every", str(SVRG_EVAL_EVERY),
          "--label-privacy", "he", "--audit", *CANCER)
    return out


def plain_mini_batch_svrg(out) -> list[np.ndarray]:
    """Plain mini-batch VFB²-SVRG in one process: at the start of each outer loop ϑ_0 and μ = X_lᵀϑ_0/n
    at the current w, then steps w −= γ (X_Bᵀ(ϑ − ϑ_0,B)/B + μ + λw), drawn in the runtime's chunks."""
    parties = [load_party_file(find_party_file(out / "parties", r)) for r in range(3)]
    y, n = parties[0].y_train, parties[0].y_train.size
    problem = get_problem("logistic", lam=LAM)
    gamma = float(CANCER[CANCER.index("--gamma") + 1])
    ws = [np.zeros(p.X_train.shape[1]) for p in parties]
    rng = np.random.default_rng([0, 0])
    for _ in range(round(EPOCHS / SVRG_EVAL_EVERY)):
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
        assert len(t.of_tag(AUDIT_HE_FULL_GRADIENT)) == round(EPOCHS / SVRG_EVAL_EVERY)
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
def test_the_dominator_ends_the_job_rather_than_decrypt_a_gradient_that_reveals_theta():
    """Passive party 1 answers an encrypted batch of B rows with B ciphertexts (from which it could
    solve for ϑ once decrypted): the dominator refuses in a real job and names party 1. The same
    script's ``garbage`` forgery is refused the same way (not run here: one job is enough for CI)."""
    proc = run_mpi(3, ["tests/mpi_scripts/tamper_he.py", "wide"], timeout=180, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 139, -11) and "NOT REJECTED" not in output, output
    assert "party 1 sent an invalid masked gradient: 16 values for a batch of 16" in output, output


@pytest.mark.mpi
@pytest.mark.parametrize("scenario, message", [
    ("full-wide", "party 1 sent an invalid masked gradient: 40 values for a batch of 40"),
    ("full-huge", "party 1 sent an invalid masked full gradient: announced 1099511627776 words"),
])
def test_the_leader_refuses_a_forged_answer_to_the_snapshots_encrypted_full_pass(scenario, message):
    """SVRG under HE: passive party 1 answers the snapshot's encrypted ϑ_0 with the n ciphertexts
    themselves (decrypted, they would be ϑ_0), or announces an answer too large to allocate."""
    proc = run_mpi(3, ["tests/mpi_scripts/tamper_he.py", scenario], timeout=180, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 139, -11) and "NOT REJECTED" not in output, output
    assert message in output, output


@pytest.mark.mpi
def test_with_clipping_every_party_steps_from_its_clipped_rows_and_the_model_reads_the_rows_as_they_are(
        tmp_path):
    """--clip-quantile 0.5 at a huge ε (little noise): the active and the passive parties' models
    are plain mini-batch SGD whose gradients use each block's rows clipped to its median norm, while ϑ
    is computed from the rows as they are; the unclipped run is far from it."""
    batch, epochs = 64, 2
    train(tmp_path, "-n", "3", "-m", "1", "--algorithm", "sgd", "--mode", "sync", "-B", str(batch),
          "--epochs", str(epochs), "--label-privacy", "he", "--epsilon", "1e4", "--clip-quantile", "0.5",
          *CANCER)
    parties = [load_party_file(find_party_file(tmp_path / "parties", r)) for r in range(3)]
    y, n = parties[0].y_train, parties[0].y_train.size
    problem = get_problem("logistic", lam=LAM)
    gamma = float(CANCER[CANCER.index("--gamma") + 1])
    steps = metrics(tmp_path)[-1]["updates"]
    batches = PassBatches(n, batch, 1, 0, seed=0).take(steps)

    def plain(clip: bool) -> list[np.ndarray]:
        scales = []
        for p in parties:
            norms = sp.linalg.norm(sp.csr_matrix(p.X_train), axis=1)
            scales.append(clip_scales(norms, row_norm_bound(norms, 0.5)) if clip else np.ones(n))
        ws = [np.zeros(p.X_train.shape[1]) for p in parties]
        for rows in batches:
            theta = problem.theta(sum(p.X_train[rows] @ w for p, w in zip(parties, ws, strict=True)), y[rows])
            for p, w, s in zip(parties, ws, scales, strict=True):
                w -= gamma * LAM * w
                w -= gamma / batch * (p.X_train[rows].T @ (theta * s[rows]))
        return ws

    clipped, unclipped = plain(True), plain(False)
    for rank in range(3):
        he = np.load(tmp_path / f"party-{rank}.ckpt.npz")["w"]
        # the noise (σ = 0.013 at ε = 1e4) moves w by ~2e-4 here, the clipping by ~1e-2
        assert np.max(np.abs(clipped[rank] - unclipped[rank])) > 5e-3, rank
        assert np.max(np.abs(he - clipped[rank])) < 1e-3, rank


@pytest.mark.mpi
def test_with_epsilon_a_passive_party_gets_its_batch_gradient_only_under_calibrated_noise(tmp_path):
    """--epsilon: the gradient a passive party unmasks carries N(0, (σC)²) per coordinate, σ from the
    accountant and C = √(Σ_l c_l²), c_l each block's row-norm bound (here --clip-quantile 0.5: its
    median row norm; breast-cancer's largest rows are 3-7x their median); at ε = 0.2 the noise dwarfs
    the gradient, so the values' spread is σC. The batches of a pass hold each row at most once."""
    batch = 64
    train(tmp_path, "-n", "3", "-m", "1", "--algorithm", "sgd", "-B", str(batch), "--epochs", "3",
          "--label-privacy", "he", "--epsilon", "0.2", "--clip-quantile", "0.5", "--audit", *CANCER[:-2],
          "--gamma", "1e-4")
    config = json.loads((tmp_path / "config.json").read_text())
    parties = [load_party_file(find_party_file(tmp_path / "parties", r)) for r in range(3)]
    norms = [np.sqrt(np.asarray(p.X_train.multiply(p.X_train).sum(axis=1)).ravel()) if sp.issparse(p.X_train)
             else np.sqrt((p.X_train**2).sum(axis=1)) for p in parties]
    c = math.sqrt(sum(np.quantile(n, 0.5, method="higher")**2 for n in norms))
    assert c < 0.5 * math.sqrt(sum(n.max()**2 for n in norms))  # the clipping lowered the noise
    expected = config["noise_multiplier"] * c
    assert config["noise_multiplier"] > 20
    for passive in (1, 2):
        t = Transcript.load(tmp_path / f"audit-{passive}.npz")
        values = np.concatenate([g.view(np.float64) for g in t.of_tag(AUDIT_HE_GRADIENT)])
        assert values.size == 24 * 10  # 3 epochs of ⌈455/64⌉ = 8 batches of 10 columns each
        assert abs(values.std() / expected - 1) < 0.2
        assert abs(values.mean()) < 4 * expected / math.sqrt(values.size)
        rows = [label_he.unpack_batch(0, w, n_rows=455, batch=batch)[1] for w in t.of_tag(TAG_HE_BATCH)]
        for start in range(0, len(rows) - 6, 7):  # a pass: 7 batches of 64 of the 455 rows
            chunk = np.concatenate(rows[start:start + 7])
            assert np.unique(chunk).size == chunk.size


def test_the_encryption_library_does_not_write_into_a_runs_output():
    """HEU logs "Create a fixed thread pool" on standard output when its pool starts; a run's output
    (each rank's, echoed by the launcher) must not carry it, while our own prints still get through."""
    code = ("import numpy as np; from protocols import label_he; "
            "key = label_he.LabelKey('ou', 2048); key.encrypt(np.array([0.5, -0.25, 1.0])); print('ours')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.stdout == "ours\n" and "thread pool" not in proc.stderr
