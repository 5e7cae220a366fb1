"""Run under ``mpiexec -n 3``: a ``--label-privacy he`` job (party 0 dominates, 1 and 2 are passive) in
which one party is malicious: it sends well-formed messages of its own choosing to learn what the
protocol hides. ``argv``: the scenario, then a folder for what the parties record.

* ``passive none|EPS``: passive party 1 has the dominator decrypt the batch's own ciphertexts instead of
  its masked gradient: on even batches B − 1 of them re-randomised (plus an encryption of 0), on odd
  batches packed two a ciphertext, [[ϑ_a]] + 2^64·[[ϑ_b]] (all B rows in B/2 values). It keeps what it
  reads in ``attack.npz`` (rows, values); the dominator keeps its labels in ``labels.npy``. ``none``:
  plain ``he``; a number: ``he --epsilon`` at that ε over the job's one pass.
* ``dominator ou|paillier``: the dominator encrypts 2^(212+48i) for row i of each batch instead of ϑ_i,
  so that in the decrypted sum Σ_i 2^(212+48i)·x_ij each feature would have its own 48 bits above the
  first version's 208-bit mask. It keeps each full decryption in ``spy.npz`` (:func:`read_features`
  decodes them). Under OU the passive parties must end the job naming party 0; under Paillier the job
  runs and the decryptions say nothing of the features. ``dominator ou pack``: the same under
  ``--he-pack``, the dominator returning each packed plaintext whole; the passive parties' slot check
  must end the job naming party 0.
* ``jacobi``: Paillier; the dominator multiplies one ciphertext of its second batch by t^n with Jacobi
  symbol (t | n) = −1 (:func:`flip_jacobi`): same plaintext, but the replies would show the parity of
  the features of that row. The passive parties must end the job naming party 0.
* ``sign``: Paillier; the dominator negates one ciphertext of its second batch (:func:`negate`): it
  decrypts the same, but each reply's sign would show the parity of the features of that row. The
  passive parties must end the job naming party 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mpi4py import MPI

from protocols.label_he_key_spawn import start_early

# rank 0's key is made while the imports below run, as in parties/rank.py; not when a test imports this file
# for its constants (its argv is then pytest's)
if __name__ == "__main__" and MPI.COMM_WORLD.Get_rank() == 0:
    start_early("ou" if sys.argv[1] == "passive" or sys.argv[3:4] == ["ou"] else "paillier", 2048)

import gmpy2
import numpy as np

from parties import label_plane
from parties.runtime import PartyRuntime, PartyState, RuntimeOptions
from protocols import label_he
from vertical.algorithms.vfb2 import Block, get_rule
from vertical.label_privacy import gaussian_noise_multiplier
from vertical.problems import get_problem

BATCH, WIDTH = 16, 3
#: the passive attack: one pass of 30 batches; the dominator's: 4 batches of the first rows
ATTACK_ROWS, SPY_ROWS, SPY_STEPS = 30 * BATCH, 40, 4
#: the first version's mask width, and the shifts the dominator's plaintexts use
OLD_MASK_BITS, SHIFT, STRIDE = 208, 212, 48


def party(rank: int, n_rows: int) -> PartyState:
    """Rank ``rank``'s state: ``n_rows`` normal features (seeded by the rank), random labels at rank 0."""
    rng = np.random.default_rng(rank)
    block = Block.from_matrix(rng.normal(size=(n_rows, WIDTH)))
    problem = get_problem("logistic", lam=0.1)
    rule = get_rule("sgd")(block, problem.regularizer, problem.lam, 0.05, writers=2, lazy=False,
                           batch_size=BATCH)
    active = rank == 0
    return PartyState(rank=rank, block=block, w=np.zeros(WIDTH), rule=rule,
                      problem=problem if active else None,
                      y=rng.choice([-1.0, 1.0], n_rows) if active else None)


def scaled_plaintexts(count: int) -> list[int]:
    return [1 << (SHIFT + STRIDE * i) for i in range(count)]


def read_features(value: int, count: int) -> np.ndarray:
    """The x_ij (fixed point, signed) that Σ_i 2^(212+48i)·x_ij holds, read back 48 bits at a time."""
    out = np.empty(count, dtype=np.int64)
    rest = value >> SHIFT
    for i in range(count):
        chunk = rest & ((1 << STRIDE) - 1)
        chunk -= (1 << STRIDE) if chunk >> (STRIDE - 1) else 0
        out[i] = chunk
        rest = (rest - chunk) >> STRIDE
    return out


def flip_jacobi(payload: bytes, n: int, index: int) -> bytes:
    """``payload`` with ciphertext ``index`` multiplied by t^n mod n², (t | n) = −1: it decrypts to the same
    plaintext and has Jacobi symbol −1. HEU keeps c·R mod n² (Montgomery form) little-endian after a
    two-byte length; multiplying that by t^n gives the form of c·t^n. The top bit of those bytes is
    HEU's sign: a forgery that sets it reads back negative and decrypts to another plaintext (2 keys of 50
    drew such a t first), so t is drawn until the forgery leaves it clear."""
    value, at, width = _bytes_of(payload, index)
    t = 2
    while True:
        t += 1
        forged = value * pow(t, n, n * n) % (n * n)
        if gmpy2.jacobi(t, n) == -1 and forged < 1 << (8 * width - 1):
            return payload[:at] + forged.to_bytes(width, "little") + payload[at + width:]


def _bytes_of(payload: bytes, index: int) -> tuple[int, int, int]:
    """Ciphertext ``index`` of ``payload``: HEU's text form of it, where its bytes start, and how many
    there are (the layout :func:`flip_jacobi` describes)."""
    from heu import numpy as hnp

    value = int(str(hnp.CiphertextArray.load_from(payload)[index]))
    plain = value.to_bytes((value.bit_length() + 7) // 8, "little")
    at = payload.find(plain)
    width = int.from_bytes(payload[at - 2:at], "big")
    assert at > 2 and width >= len(plain) and value < 1 << (8 * width - 1), "HEU's ciphertext layout changed"
    return value, at, width


def negate(payload: bytes, index: int) -> bytes:
    """``payload`` with ciphertext ``index`` negated: HEU's sign is the top bit of its bytes, which an
    honest ciphertext leaves clear."""
    _, at, width = _bytes_of(payload, index)
    flipped = bytearray(payload[at:at + width])
    flipped[-1] |= 0x80
    return payload[:at] + bytes(flipped) + payload[at + width:]


def replace(payload: bytes, index: int, text_form: int) -> bytes:
    """``payload`` with ciphertext ``index``'s text form replaced by ``text_form`` (non-negative)."""
    _, at, width = _bytes_of(payload, index)
    return payload[:at] + text_form.to_bytes(width, "little") + payload[at + width:]


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if scenario == "passive":
        epsilon = None if sys.argv[3] == "none" else float(sys.argv[3])
        sigma = None if epsilon is None else gaussian_noise_multiplier(epsilon, 1e-5, 1)
        me, scheme, steps = party(rank, ATTACK_ROWS), "ou", ATTACK_ROWS // BATCH
    else:
        sigma, scheme = None, "ou" if sys.argv[3:4] == ["ou"] else "paillier"
        me, steps = party(rank, SPY_ROWS), SPY_STEPS
    runtime = PartyRuntime(comm, me, RuntimeOptions(active_ranks=(0,), threads=1, seed=0, batch_size=BATCH,
                                                    label_privacy="he", he_scheme=scheme,
                                                    he_pack=sys.argv[4:] == ["pack"], noise_multiplier=sigma))
    if scenario == "passive" and rank == 1:
        read = _passive_attack(runtime)
    if scenario != "passive" and rank == 0:
        read = _dominator_attack(runtime, scenario)
    if rank == 0:
        runtime.dominate(steps)
        runtime.finish_segment()
    runtime.drain()
    runtime.close()
    if scenario == "passive" and rank == 1:
        np.savez(out / "attack.npz", rows=np.array(read["rows"]), values=np.array(read["values"]))
    if scenario == "passive" and rank == 0:
        np.save(out / "labels.npy", me.y)
    if scenario != "passive" and rank == 0:
        np.savez(out / "spy.npz", rows=np.array(read["rows"]),
                 **{f"from_{p}": np.array([format(v, "x") for v in read[p]]) for p in (1, 2)})
    print(f"DONE {rank}", flush=True)


def _passive_attack(runtime: PartyRuntime) -> dict[str, list]:
    """Party 1 returns the batch's own ciphertexts for decryption; returns what it reads (filled in as
    the job runs)."""
    from heu import numpy as hnp
    from heu import phe

    gradients = runtime.label.gradients[0]
    kit, ev = gradients._kit, gradients._evaluator
    big = phe.BigintEncoder(phe.SchemaType.OU)
    read: dict[str, list] = {"rows": [], "values": []}
    pending: list = []  # per batch masked and not yet unmasked, oldest first (the label plane masks ahead)
    count = [0]

    def masked(payload: bytes, rows: np.ndarray) -> bytes:
        cts = hnp.CiphertextArray.load_from(payload)
        b = rows.size
        count[0] += 1
        if count[0] % 2 == 1:  # alternate: re-randomise, then pack
            pick = list(range(b - 1))
            zeros = gradients._encryptor.encrypt(kit.array(np.zeros(b - 1, dtype=np.int64),
                                                           phe.IntegerEncoder(phe.SchemaType.OU, 1)))
            pending.append(("single", rows[:b - 1]))
            return ev.add(cts[pick], zeros).serialize()
        shift = kit.array(np.array([1 << 64] * (b // 2), dtype=object), big)
        pending.append(("pack", rows))
        return ev.add(cts[list(range(0, b, 2))], ev.mul(cts[list(range(1, b, 2))], shift)).serialize()

    def unmask(words: np.ndarray) -> np.ndarray:
        kind, rows = pending.pop(0)
        values = label_he._from_words(0, words, words.size // 2)
        scale = 2.0**label_he.THETA_BITS
        for k, v in enumerate(values):
            low = v & ((1 << 64) - 1)
            low -= (1 << 64) if low >> 63 else 0
            if kind == "single":
                read["rows"].append(int(rows[k]))
                read["values"].append(low / scale)
            else:
                high = ((v - low) % (1 << 128)) >> 64
                high -= (1 << 64) if high >> 63 else 0
                read["rows"] += [int(rows[2 * k]), int(rows[2 * k + 1])]
                read["values"] += [low / scale, high / scale]
        return np.zeros(WIDTH)  # its own block takes no step: nothing to learn from there

    gradients.masked, gradients.unmask = masked, unmask
    gradients.masked_batch = lambda payload, rows, progress=None: (masked(payload, rows), None)
    gradients.unmask_batch = lambda words, _pending: unmask(words)
    return read


def _dominator_attack(runtime: PartyRuntime, scenario: str) -> dict:
    """The dominator encrypts the scaled plaintexts (or, ``jacobi``, flips one ciphertext's symbol; ``sign``,
    its sign) and
    keeps every batch's rows and every full decryption, per passive party (filled in as the job runs)."""
    key = runtime.label.key
    honest_encrypt, honest_decrypt = key.encrypt, key.decrypt_masked
    n = label_he.paillier_modulus(key._kit.public_key())
    read: dict = {1: [], 2: [], "rows": []}
    batches: list[int] = []
    honest_batch = runtime.label.encrypt_batch

    def encrypt_batch(seq: int, rows: np.ndarray, thetas: np.ndarray) -> np.ndarray:
        read["rows"].append(rows.copy())
        return honest_batch(seq, rows, thetas)

    def encrypt(thetas: np.ndarray) -> bytes:
        batches.append(1)
        if scenario in ("jacobi", "sign"):
            payload = honest_encrypt(thetas)
            if len(batches) != 2:
                return payload
            return flip_jacobi(payload, n, 3) if scenario == "jacobi" else negate(payload, 3)
        ones = key._encryptor.encrypt(key._kit.array(np.ones(thetas.size, dtype=np.int64), key._encoder))
        scaled = key._kit.array(np.array(scaled_plaintexts(thetas.size), dtype=object), key._big)
        return key._kit.evaluator().mul(ones, scaled).serialize()

    def decrypt_masked(source: int, payload: bytes, batch: int) -> np.ndarray:
        values = key.decrypt(source, payload, 1 << 20, "", "")  # every value, no count check
        read[source] += [int(v) for v in values]  # signed, as HEU decrypts: what read_features takes
        return honest_decrypt(source, payload, batch)

    def decrypt_packed(key, source: int, payload: bytes, batch: int, lay) -> np.ndarray:
        """--he-pack: every packed plaintext returned whole, in range or not (no honest check)."""
        values = key.decrypt(source, payload, 1 << 20, "", "")  # every value, no count check
        read[source] += [int(v) for v in values]
        return np.array([(int(v) >> (64 * w)) & ((1 << 64) - 1) for v in values for w in range(lay.words)],
                        dtype=np.uint64)

    key.encrypt, key.decrypt_masked = encrypt, decrypt_masked
    label_plane.label_he_pack.decrypt_packed = decrypt_packed
    runtime.label.encrypt_batch = encrypt_batch
    return read


if __name__ == "__main__":
    main()
