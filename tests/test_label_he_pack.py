"""``--label-privacy he --he-pack``: a packed decryption gives exactly the unpacked values, a value that
would spill out of its slot is refused, each party refuses a pack no honest peer sends, and a real job
trains to the same model packed as unpacked (protocols/label_he_pack.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from parties.config import ConfigError, RunConfig
from parties.plan import resolve
from protocols import label_he
from protocols import label_he_pack as pack
from protocols.errors import ProtocolViolation
from tests.test_label_he import Jobs, hostile_job, noiseless_replay, train_job
from tests.test_runtime import CANCER, train
from vertical.algorithms.vfb2 import Block

B = 256


@pytest.fixture(scope="module")
def key(ou_key):
    return ou_key


def _block(rng, integral: bool, cols: int = 31) -> Block:
    X = sp.random(400, cols, density=0.3, random_state=int(integral), format="csr")
    X.data = rng.integers(1, 4, X.nnz).astype(float) if integral else rng.normal(0, 3, X.nnz)
    X.data[:3] = [2.0**20 - 1, -(2.0**20 - 1), 2.0**-24] if not integral else X.data[:3]
    X.data[X.indices == 3] = 0.0  # a column no row uses: it must still come back (as 0)
    X.eliminate_zeros()
    return Block.from_matrix(X)


def test_the_layout_fits_four_slots_with_the_stated_hiding_for_every_batch_size():
    for batch in (16, 256, 1024, 4095):
        lay = pack.layout(batch, 2048)
        assert lay.slots == 4 and lay.slots * lay.width <= label_he.ou_mask_bits(2048)
        assert lay.width - 2 - lay.gradient_bits == pack.STAT_BITS >= 40
        # every honest column sum lies below 2^G: B values |ϑ|, |x| < 2^20 in the finer fixed point
        assert batch * 2.0**(2 * label_he.VALUE_BITS + label_he.THETA_BITS + label_he.FEATURE_BITS) \
            <= 2.0**lay.gradient_bits


@pytest.mark.parametrize("integral", [True, False])
@pytest.mark.parametrize("cols", [31, 32, 5])
def test_a_packed_decryption_equals_the_unpacked_values_exactly(key, integral, cols):
    """Random ϑ on the fixed-point grid, the extremes ±(2^20 − 2^-32) among them, against blocks with
    both signs, the largest features and a column no row uses: packed and unpacked gradients agree bit for
    bit, with ⌈d/4⌉ decryptions instead of d."""
    rng = np.random.default_rng(cols + 10 * integral)
    block = _block(rng, integral, cols)
    thetas = np.rint(rng.uniform(-1, 1, B) * 2.0**32) / 2.0**32
    thetas[:2] = [2.0**20 - 2.0**-32, -(2.0**20 - 2.0**-32)]
    rows = rng.choice(block.n_rows, B, replace=False)
    rows[:2] = [0, 1]  # the rows holding the extreme features
    payload = key.encrypt(thetas)
    plain = label_he.BlockGradient(0, key.public_bytes(), block=block)
    expected = plain.unmask(key.decrypt_masked(1, plain.masked(payload, rows), B))
    packed = pack.PackedBlockGradient(0, key.public_bytes(), block=block, batch=B)
    masked = packed.masked_packed(payload, rows)
    words = pack.decrypt_packed(key, 1, masked, B, packed.layout)
    assert words.size == -(-cols // 4) * packed.layout.words
    got = packed.unmask_packed(words)
    assert np.array_equal(got, expected)
    assert np.max(np.abs(got)) > 2.0**20  # the extremes did reach the sums


def test_packed_masks_prepared_ahead_are_each_used_once(key):
    """The packed pool: a prepared set of slot masks goes to the next packed pass only, never twice, and
    the prepared and on-demand passes both decrypt to the unpacked values."""
    rng = np.random.default_rng(8)
    block = _block(rng, True, 9)
    party = pack.PackedBlockGradient(0, key.public_bytes(), block=block, batch=B)
    plain = label_he.BlockGradient(0, key.public_bytes(), block=block)
    seen: set[int] = set()
    for k in range(4):
        if k % 2:
            party.prepare_masks()
            party.prepare_masks()
            assert len(party._prepared_slots) == label_he.PREPARED_PASSES and not party._prepared
            prepared = party._prepared_slots[0][0]
        rows = rng.choice(block.n_rows, B, replace=False)
        payload = key.encrypt(np.rint(rng.uniform(-1, 1, B) * 2.0**32) / 2.0**32)
        masked = party.masked_packed(payload, rows)
        if k % 2:
            assert party._slot_masks == prepared and not party._prepared_slots
        assert seen.isdisjoint(party._slot_masks) and len(set(party._slot_masks)) == len(party._slot_masks)
        seen |= set(party._slot_masks)
        got = party.unmask_packed(pack.decrypt_packed(key, 1, masked, B, party.layout))
        assert np.array_equal(got, plain.unmask(key.decrypt_masked(1, plain.masked(payload, rows), B)))


def test_slot_contents_round_trip_through_a_decryption_at_their_extremes(key):
    lay = pack.layout(B, 2048)
    top = (1 << lay.gradient_bits) - 1
    values = [top, -top, 0, -1, 1, top - 5, -(top - 7)]
    plain = pack.pack_values(values, lay)
    cts = key._encryptor.encrypt(key._kit.array(np.array(plain, dtype=object), key._big))
    words = pack.decrypt_packed(key, 1, cts.serialize(), B, lay)
    packed = [sum(int(w) << (64 * i) for i, w in enumerate(row)) for row in words.reshape(-1, lay.words)]
    slots = pack.unpack_slots(packed, len(values), lay)
    assert [s - (1 << lay.gradient_bits) for s in slots] == values


def test_an_overflowing_pack_is_refused(key):
    lay = pack.layout(B, 2048)
    with pytest.raises(OverflowError, match=f"outside ±2\\^{lay.gradient_bits} does not fit"):
        pack.pack_values([0, 1 << lay.gradient_bits], lay)
    with pytest.raises(OverflowError):
        pack.pack_values([-(1 << lay.gradient_bits)], lay)
    # a plaintext past 2^(k·w) (a slot's carry, or a wrapped decryption): the dominator refuses it
    over = key._encryptor.encrypt(key._kit.array(np.array([1 << lay.slots * lay.width], dtype=object),
                                                 key._big))
    with pytest.raises(ProtocolViolation, match="party 1 sent an invalid masked gradient: packed value 0 "
                                                "decrypts outside"):
        pack.decrypt_packed(key, 1, over.serialize(), B, lay)
    negative = key._encryptor.encrypt(key._kit.array(np.array([-1], dtype=object), key._big))
    with pytest.raises(ProtocolViolation, match="decrypts outside"):
        pack.decrypt_packed(key, 1, negative.serialize(), B, lay)


def test_the_dominator_decrypts_no_more_packed_values_than_b_minus_one_columns_fill(key):
    lay = pack.layout(16, 2048)
    five = key._encryptor.encrypt(key._kit.array(np.zeros(5, np.int64), key._encoder))
    with pytest.raises(ProtocolViolation, match="5 values for a batch of 16 packed 4 a value: B − 1 columns "
                                                "need at most 4"):
        pack.decrypt_packed(key, 1, five.serialize(), 16, lay)
    four = key._encryptor.encrypt(key._kit.array(np.zeros(4, np.int64), key._encoder))
    assert pack.decrypt_packed(key, 1, four.serialize(), 16, lay).size == 4 * lay.words


def test_a_slot_out_of_range_names_the_dominator(key):
    rng = np.random.default_rng(3)
    block = _block(rng, True)
    packed = pack.PackedBlockGradient(0, key.public_bytes(), block=block, batch=B)
    rows = rng.choice(block.n_rows, B, replace=False)
    words = pack.decrypt_packed(key, 1, packed.masked_packed(key.encrypt(np.full(B, 0.5)), rows), B,
                                packed.layout)
    words[packed.layout.words + 1] ^= np.uint64(1 << 40)  # packed value 1, bits 104 and up: slot 0
    with pytest.raises(ProtocolViolation, match=r"party 0 sent an invalid decrypted gradient: slot 0 of "
                                                r"packed value 1 \(column 4\)"):
        packed.unmask_packed(words)
    packed.masked_packed(key.encrypt(np.full(B, 0.5)), rows)
    with pytest.raises(ProtocolViolation, match="party 0 sent an invalid decrypted gradient: 3 words"):
        packed.unmask_packed(np.zeros(3, np.uint64))


def test_he_pack_is_refused_where_it_would_void_a_guarantee_and_meets_the_other_options():
    base = dict(dataset="breast-cancer", parties=3, active=1, algorithm="sgd", label_privacy="he",
                batch_size=16, he_pack=True)
    resolve(RunConfig(**base))
    resolve(RunConfig(**{**base, "epsilon": 4.0}))
    resolve(RunConfig(**{**base, "algorithm": "svrg"}))  # the snapshot's full pass stays unpacked
    resolve(RunConfig(**{**base, "mode": "sync", "he_key_bits": 3072}))
    with pytest.raises(ConfigError, match="--he-pack is for --he-scheme ou: Paillier's masks"):
        resolve(RunConfig(**{**base, "he_scheme": "paillier"}))
    with pytest.raises(ConfigError, match=r"--he-pack .* needs --label-privacy he"):
        resolve(RunConfig(**{**base, "label_privacy": "none"}))
    with pytest.raises(ConfigError, match="needs --label-privacy he"):
        resolve(RunConfig(**{**base, "label_privacy": "dp", "epsilon": 1.0}))


HALF_EPOCH = ["-n", "3", "-m", "1", "--algorithm", "sgd", "--mode", "sync", "-B", "32", "--epochs", "0.5",
              "--label-privacy", "he", *CANCER]


EPSILON_BATCH = 64


def _packed_then_resumed(out: Path, kept: dict):
    """The packed half epoch (its process and its blocks as trained kept aside: the resume overwrites
    them), then ``--resume`` to one epoch in the same folder: one job after the other, in one worker."""
    def run() -> tuple[Path, subprocess.CompletedProcess]:
        _, kept["first"] = train_job(out, *HALF_EPOCH, "--he-pack")()
        if kept["first"].returncode != 0:
            return out, kept["first"]
        kept["weights"] = [np.load(out / f"party-{rank}.ckpt.npz")["w"] for rank in range(3)]
        return out, train(out, "--resume", "--epochs", "1", check=False)
    return run


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """This module's five MPI jobs, run three at a time (tests/test_label_he.py ``Jobs``): a packed half
    epoch and then its ``--resume`` (the weights it trained are kept aside for the comparison), the same
    half epoch unpacked, a packed run under a huge ε, and a dominator that encrypts what it likes."""
    root = tmp_path_factory.mktemp("pack-jobs")
    kept: dict = {}
    started = Jobs({
        "packed": _packed_then_resumed(root / "packed", kept),
        "plain": train_job(root / "plain", *HALF_EPOCH),
        "epsilon": train_job(root / "epsilon", "-n", "3", "-m", "1", "--algorithm", "sgd", "--mode", "sync",
                             "-B", str(EPSILON_BATCH), "--epochs", "1", "--label-privacy", "he", "--epsilon",
                             "1e4", "--he-pack", *CANCER),
        "hostile": hostile_job(root / "hostile", "dominator", "ou", "pack"),
    })
    started.kept = kept
    yield started
    started.close()


@pytest.mark.mpi
def test_a_packed_job_trains_the_same_model_as_an_unpacked_one(jobs):
    """breast-cancer, OU, sync mode, one seed: packing changes only how the masked sums travel, so every
    block is the same to the last bit the fixed point keeps."""
    jobs["packed"]  # the packed half epoch, then its resume
    first = jobs.kept["first"]
    assert first.returncode == 0, f"packed run failed ({first.returncode}):\n{first.stdout}\n{first.stderr}"
    plain = jobs.trained("plain")
    for rank, packed in enumerate(jobs.kept["weights"]):
        unpacked = np.load(plain / f"party-{rank}.ckpt.npz")["w"]
        assert np.max(np.abs(unpacked)) > 0.01
        assert np.max(np.abs(packed - unpacked)) < 1e-12, rank


@pytest.mark.mpi
def test_packing_keeps_the_noise_inside_the_ciphertexts_under_epsilon(jobs):
    """he --epsilon --he-pack at a huge ε: every block is the noiseless replay up to that noise, as
    unpacked (tests/test_label_he.py)."""
    out = jobs.trained("epsilon")
    ws = noiseless_replay(out, EPSILON_BATCH, float(CANCER[CANCER.index("--gamma") + 1]))
    for rank in range(3):
        he = np.load(out / f"party-{rank}.ckpt.npz")["w"]
        assert 1e-6 < np.max(np.abs(he - ws[rank])) < 1e-2, rank


@pytest.mark.mpi
def test_a_passive_party_ends_a_packed_job_naming_a_dominator_that_encrypts_what_it_likes(jobs):
    proc = jobs["hostile"]
    output = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 139, -11), output
    assert "party 0 sent an invalid decrypted gradient: slot" in output, output


def test_the_pack_benchmark_tables_every_job_with_its_load(tmp_path):
    from experiments.bench_label_he_pack import write

    runs = [{"batch": b, "decryption": kind, "seed": s, "seconds_per_epoch": 5.0 + s, "wall_s": 9.0,
             "test_accuracy": 0.84, "loss": 0.345, "updates": 102, "command": "vfl train",
             "load_before": 1.5, "load_after": 2.5}
            for s in range(3) for b in (256, 1024) for kind in ("unpacked", "packed")]
    write(tmp_path, {"cpu": "CPU x2", "command": "python -m experiments label_he_pack"}, runs)
    table = (tmp_path / "table.md").read_text()
    assert "| 256 | packed | 6.00 (5.00, 6.00, 7.00) | 84.00 % (84.00, 84.00, 84.00) |" in table
    assert "CPU x2; load average 1.5–2.5" in table
    assert (tmp_path / "results.csv").read_text().count("\n") == 13
    assert (tmp_path / "label_he_pack.png").stat().st_size > 0


@pytest.mark.mpi
def test_a_packed_run_resumes_packed(jobs):
    """--he-pack is part of the run's plan: --resume keeps it without being told."""
    out = jobs.trained("packed")
    result = json.loads((out / "result.json").read_text())
    assert result["epochs"] == 1.0 and result["outcome"] == "budget"
    assert json.loads((out / "config.json").read_text())["he_pack"] is True
