"""``--label-privacy he``: a passive party's block gradient from ϑ's it only ever sees encrypted.

The protocol (the one FATE runs for hetero logistic regression, on our dispatcher), per mini-batch of
B rows dominated by active party a:

1. a encrypts the B values ϑ_i under its own additively homomorphic key and sends them with the rows
   (under ``--epsilon`` it encrypts ϑ̃_i = ϑ_i + N(0, σ²) instead: :func:`noisy_thetas`).
2. Passive party l computes [[g_j]] = Σ_i [[ϑ_i]]·x_ij for *every* column j of its block (also the
   columns that are zero in this batch: sending only the non-zero ones would show a which features of
   the batch rows are non-zero), adds a freshly *encrypted* mask r_j (fresh randomness: a plaintext
   mask would leave Π ρ_i^{x_ij} of a's own encryption randomness in the result, from which a could
   test guesses of x), and sends the d_l ciphertexts back.
3. a decrypts g_j + r_j and returns it modulo 2^128; l subtracts r_j, checks that g_j is a value B
   honest ϑ's could sum to, and applies the step.

What each side learns, per threat (docs/label-privacy.md has the table and the reasoning):

* **Passive party, semi-honest**: its batch gradient g = X_Bᵀϑ_B, d_l equations in the B unknowns ϑ_B.
  With B ≤ d_l they can determine ϑ_B (B = 1: ϑ = g_j / x_ij), so the launcher refuses such a B and a
  refuses to decrypt B or more values. **Malicious**: nothing here stops it from learning ϑ. A party
  that learns its own exact X_Bᵀϑ_B chooses X_B (one-hot or 2^k-scaled columns, or simply returning
  the batch's own ciphertexts re-randomised, or two packed into one as [[ϑ_a]] + 2^64·[[ϑ_b]]), so
  plain ``he`` is for semi-honest passive parties only. Under ``--epsilon`` the noise is inside the
  ciphertexts: every value any passive party can ever get decrypted is post-processing of ϑ̃, so the
  (ε, δ) label-DP bound holds whatever it sends.
* **Dominator, semi-honest**: g_j + r_j, with r_j hiding g_j (below). **Malicious** (it may encrypt
  anything instead of ϑ, e.g. 2^(212+48i) so that each x_ij lands in its own bits): with
  ``--he-scheme paillier`` the plaintext space is Z_n, n public, and r_j is uniform modulo n, so
  g_j + r_j mod n is uniform whatever was encrypted (perfect hiding, for a well-formed key). With
  Okamoto–Uchiyama the plaintext space is Z_p, p secret and unverifiable, so no mask width hides every
  plaintext: r_j is as wide as exact unmasking allows for an honest key (:func:`ou_mask_bits`), and OU
  is for a semi-honest dominator only.

Unmasking. Paillier: a returns v = ((g + r) mod n) mod 2^128 and l computes (v − r) mod 2^128, read
as a signed 128-bit number. For honest |g| < 2^GRADIENT_BITS this is g unless g + r left [0, n): for
g ≥ 0 when r ≥ n − g, for g < 0 when r < |g|; each has probability |g|/n < 2^-1900, and then l ends
the job blaming a (the check below). OU: HEU decrypts into (−p/2, p/2] and an honest p exceeds
2^⌊(k+2)/3⌋ for a k-bit key, so g + r with r < 2^ou_mask_bits stays inside and a returns it mod 2^128.
The check: after unmasking, |g_j| must not exceed Σ_i |x_ij| · 2^(VALUE_BITS + THETA_BITS) in the
fixed point (what B values |ϑ| < 2^VALUE_BITS can give); a larger value means the decryption wrapped,
which an honest dominator cannot cause, and ends the job naming it.

Paillier ciphertexts carry two public bits besides the plaintext. One is the Jacobi symbol of c mod n.
HEU's honest ciphertexts all have symbol +1 (its randomness base is −x² mod n, and n = pq with p ≡ q ≡ 3
mod 4), and so do sums of them; a dominator that sent some with symbol −1 would read, in the symbol of
each reply, the parity of Σ x_ij over those rows. The other is HEU's sign: its serialisation carries one,
its arithmetic keeps it (a product is negative when an odd number of its factors are), and −c has c's
symbol, since (−1 | n) = +1. A dominator that sent some ciphertexts negated would read the same parity
in the sign of each reply. A passive party therefore checks the symbol and the sign of JACOBI_PROBES
random subset sums of every batch it receives: a batch with any symbol −1, or any negative ciphertext,
gives an odd count in a random subset with probability 1/2, so it passes with probability
2^-JACOBI_PROBES.

Fixed point: ϑ is encoded with THETA_BITS fractional bits (resolution 2^-32 ≈ 2.3e-10); a party's
features exactly when they are all integers (one-hot, counts: multiplying a ciphertext by 1 is
free), else with FEATURE_BITS fractional bits (resolution 2^-24 ≈ 6e-8);
the sum is exact in the integers, so the only error is the two roundings. |ϑ| and |x| must stay
below 2^20 (a diverging run stops with a clear message instead of wrapping around).

Library: SecretFlow HEU (``sf-heu``, C++). Okamoto–Uchiyama with a 2048-bit modulus n = p²q is the
default: HEU draws its primes and randomness for 112-bit security, NIST SP 800-57's level for a
2048-bit RSA modulus; ``--he-key-bits 3072`` gives 128 bits. Measurements: docs/label-privacy.md.
Paillier (``--he-scheme paillier``) is the mode for a dominator that may not follow the protocol
(25-30x slower a batch).

``--he-pack`` (OU only) sends the block gradient k masked values to a plaintext instead of one:
protocols/label_he_pack.py, built on :meth:`BlockGradient.column_sums` and :meth:`LabelKey.decrypt`.

Every buffer another party sends is checked here before the library parses it: exact header, lengths
within the bounds the key size allows, a ciphertext count equal to what the protocol produces; a
failure raises :class:`~protocols.errors.ProtocolViolation` naming the sender.
"""

from __future__ import annotations

import collections
import functools
import itertools
import os
import re
import secrets
import sys
from collections.abc import Callable
from typing import NamedTuple

import gmpy2
import numpy as np

from protocols.errors import ProtocolViolation

#: Fractional bits of ϑ's fixed-point encoding.
THETA_BITS = 32
#: Fractional bits of non-integral features.
FEATURE_BITS = 24
#: |ϑ| and |x| must stay below 2^VALUE_BITS.
VALUE_BITS = 20
#: Largest batch (``parties.config.MAX_BATCH``) is below 2^12: |g| < 2^GRADIENT_BITS.
GRADIENT_BITS = 12 + 2 * VALUE_BITS + THETA_BITS + FEATURE_BITS
#: The active party returns g + r modulo 2^RETURN_BITS; |g| < 2^(RETURN_BITS − 1) keeps g exact. It also
#: caps what one decryption gives whoever asked for it.
RETURN_BITS = 128
#: Smallest B anyone may ask for; the real floor is d_l + 1 of the widest passive block (module doc).
MIN_BATCH = 16
SCHEMES = ("ou", "paillier")
KEY_BITS = (2048, 3072, 4096)
#: Subset sums of each encrypted Paillier batch whose Jacobi symbol and sign a passive party checks
#: (module doc).
JACOBI_PROBES = 40
#: Largest public key / ciphertext serialisation accepted, per key bit (measured for 2048 bits: an OU
#: key 0.39 B/bit, an OU ciphertext 0.13, a Paillier one 0.26; they only bound what is parsed).
MAX_KEY_BYTES = max(KEY_BITS)
_CT_BYTES_PER_BIT = 0.3
assert GRADIENT_BITS < RETURN_BITS - 1

#: Most values one HEU call works on. HEU holds the GIL for a whole call (measured: a 3.2 s encryption
#: of 20,000 values let no other thread of the process run meanwhile), so a party encrypting a full
#: pass's ϑ_0 in one call sent no heartbeat for as long and its peers named it. Between chunks the
#: party's heartbeat and communication threads run.
HE_CHUNK = 2048
#: Rows of one piece of the masked pass (multiplications, then sums, per piece): the GIL is free between
#: pieces, and each sends a progress word in a full pass (:func:`progress_words`).
MASK_ROWS = 128
#: Masked passes whose masks a passive party may hold encrypted ahead of need (:meth:`BlockGradient.
#: prepare_masks`): one is the next batch's; a second would only wait longer in memory.
PREPARED_PASSES = 1
_WHAT_CT = "encrypted batch"
_WHAT_KEY = "public key"
_WHAT_REPLY = "decrypted gradient"


def ou_mask_bits(key_bits: int) -> int:
    """Width of an OU mask: the widest that unmasks exactly under every honest ``key_bits`` key.

    HEU's OU key generator draws p = t·u + 1 with t a prime of at least 224 bits and u of exactly
    s − t_bits + 2 bits, s = ⌊(key_bits + 2)/3⌋, so p > 2^s, and decrypts into (−p/2, p/2]. With
    r < 2^(s−2) and |g| < 2^GRADIENT_BITS, g + r lies in (−2^(s−1), 2^(s−1)): exact. (2048 bits: 681.)
    """
    return (key_bits + 2) // 3 - 2


@functools.cache
def _heu():
    from heu import numpy as hnp
    from heu import phe

    _start_thread_pool_quietly(hnp, phe)
    return hnp, phe


def _start_thread_pool_quietly(hnp, phe) -> None:
    """HEU's C++ core logs "[info] ... Create a fixed thread pool" to standard output when its first
    parallel operation starts the pool, once per process: that line would land in every HE run's output
    (the launcher echoes each rank's). So the pool is started here, by encoding two integers (no key
    needed), with file descriptor 1 pointed at /dev/null for that one call. Called once, when the
    library is first used, before the rank's threads exchange anything."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
            hnp.array([0, 0], phe.IntegerEncoder(phe.SchemaType.OU, 1))
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _schema(name: str):
    _, phe = _heu()
    return {"ou": phe.SchemaType.OU, "paillier": phe.SchemaType.ZPaillier}[name]


def paillier_modulus(public_key) -> int | None:
    """n of a HEU Paillier public key, or None when its description does not give one consistent with
    its plaintext bound ⌊n/2⌋ (HEU exposes n only in the key's text form)."""
    match = re.search(r"\bn=([0-9A-F]+)\[", str(public_key))
    if match is None:
        return None
    n = int(match.group(1), 16)
    return n if n // 2 == int(str(public_key.plaintext_bound())) else None


def min_batch(widest_passive_block: int) -> int:
    """The smallest B with which no passive party can solve its batch gradient for ϑ."""
    return max(MIN_BATCH, widest_passive_block + 1)


def progress_words(values: int, piece: int) -> int:
    """Most progress words a step of ``values`` in pieces of ``piece`` sends (one after each piece but
    the last): ϑ_0's encryption (n values, :data:`HE_CHUNK`), a passive party's masked pass (n rows,
    :data:`MASK_ROWS`). Each restarts the waiting party's deadline, so an honest party is not named for
    a long full pass, and a hostile one stalls it by at most that many ``--peer-timeout``."""
    return max(0, -(-values // piece) - 1)


def ciphertext_limit(key_bits: int, count: int) -> int:
    """Most bytes ``count`` serialised ciphertexts of a ``key_bits`` key may take."""
    return int(count * key_bits * _CT_BYTES_PER_BIT) + 64


def noisy_thetas(thetas: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """``--epsilon``: ϑ̃ = ϑ + N(0, σ²) per value, on ϑ's fixed-point grid (what is encrypted, and what
    every party steps with).

    Both terms are rounded to the grid on their own and added as integers, so ϑ̃·2^THETA_BITS is
    rint(ϑ·2^THETA_BITS) plus a noise drawn without looking at ϑ: shifting the integer input is
    post-processing of the continuous Gaussian mechanism, whose sensitivity is then 1 + 2^-THETA_BITS
    (one label moves the logistic ϑ by exactly 1, its rounding by at most one more grid step).
    """
    grid = 2.0**THETA_BITS
    noise = rng.normal(0.0, sigma, thetas.shape)
    if not np.all(np.abs(noise) < 2.0**VALUE_BITS):
        raise OverflowError(f"label-DP noise left ±2^{VALUE_BITS}")
    return (np.rint(np.asarray(thetas, dtype=np.float64) * grid) + np.rint(noise * grid)) / grid


class LabelKey:
    """The active party's key pair: encrypts its ϑ's, decrypts the passive parties' masked sums."""

    def __init__(self, scheme: str = "ou", key_bits: int = 2048) -> None:
        if scheme not in SCHEMES or key_bits not in KEY_BITS:
            raise ValueError(f"HE scheme must be one of {SCHEMES} with {KEY_BITS} bits, "
                             f"got {scheme!r} with {key_bits}")
        hnp, phe = _heu()
        self.scheme, self.key_bits = scheme, key_bits
        self._kit = hnp.setup(_schema(scheme), key_bits)
        self._encoder = phe.IntegerEncoder(_schema(scheme), 1)
        self._big = phe.BigintEncoder(_schema(scheme))
        self._encryptor = self._kit.encryptor()
        self._decryptor = self._kit.decryptor()
        #: Paillier: the replies are reduced into [0, n) before the 128 bits go back (module doc)
        self._modulus = paillier_modulus(self._kit.public_key()) if scheme == "paillier" else None
        if scheme == "paillier" and self._modulus is None:
            raise RuntimeError("HEU's Paillier key does not describe its modulus as expected")

    def public_bytes(self) -> bytes:
        return self._kit.public_key().serialize()

    def encrypt(self, thetas: np.ndarray, progress: Callable[[], None] | None = None) -> bytes:
        """The serialised ciphertexts of ϑ in fixed point; ϑ outside ±2^VALUE_BITS is refused.
        ``progress`` is called after each :data:`HE_CHUNK` values but the last (:func:`progress_words`)."""
        thetas = np.asarray(thetas, dtype=np.float64)
        if not np.all(np.abs(thetas) < 2.0**VALUE_BITS):  # NaN fails too
            raise OverflowError(f"ϑ left ±2^{VALUE_BITS}: the model diverged")
        encoded = np.rint(thetas * 2.0**THETA_BITS).astype(np.int64)
        chunks = []
        for i in range(0, max(encoded.size, 1), HE_CHUNK):  # the GIL is free between chunks
            if chunks and progress is not None:
                progress()
            chunks.append(self._encryptor.encrypt(self._kit.array(encoded[i:i + HE_CHUNK], self._encoder)))
        if len(chunks) == 1:
            return chunks[0].serialize()
        whole = chunks[0][[0] * encoded.size]  # a placeholder of the right size, filled chunk by chunk
        for k, chunk in enumerate(chunks):
            whole[k * HE_CHUNK:k * HE_CHUNK + chunk.size] = chunk
        return whole.serialize()

    def decrypt_masked(self, source: int, payload: bytes, batch: int) -> np.ndarray:
        """(g_j + r_j) mod 2^RETURN_BITS of a passive party's reply, as two uint64 words per value
        (Paillier: of the decryption in [0, n)).

        Refuses a reply of ``batch`` or more values: decrypting it would let its sender solve the
        batch's ϑ from its gradient (module doc).
        """
        values = self.decrypt(source, payload, batch - 1, f"a batch of {batch}",
                              "B must exceed the block's columns, or ϑ could be solved for")
        canonical = [int(v) % self._modulus for v in values] if self._modulus else [int(v) for v in values]
        return _to_words([v % (1 << RETURN_BITS) for v in canonical])


    def decrypt(self, source: int, payload: bytes, most: int, what: str, why: str) -> list:
        """The plaintexts of a passive party's serialised ciphertexts (OU: in (−p/2, p/2]), at most
        ``most`` of them, for ``what`` (``why`` says why no more)."""
        hnp, _ = _heu()
        if not 0 < len(payload) <= ciphertext_limit(self.key_bits, most):
            raise ProtocolViolation(source, "masked gradient", f"{len(payload)} bytes is not a serialised "
                                    f"gradient of at most {most} ciphertexts")
        try:
            cts = hnp.CiphertextArray.load_from(payload)
        except Exception as err:
            raise ProtocolViolation(source, "masked gradient",
                                    f"not a ciphertext array ({_first_line(err)})") from None
        if cts.ndim != 1 or not 0 < cts.size <= most:
            raise ProtocolViolation(source, "masked gradient", f"{cts.size} values for {what}: {why}")
        try:
            return self._decryptor.decrypt(cts).to_numpy(self._big).ravel()
        except Exception as err:
            raise ProtocolViolation(source, "masked gradient",
                                    f"does not decrypt ({_first_line(err)})") from None


class Pending(NamedTuple):
    """What a passive party keeps of one masked batch until its decryption comes back: the masks it
    added (per column, or per slot under ``--he-pack``) and what honest ϑ's can sum to per column."""
    masks: list[int]
    bounds: np.ndarray


class BlockGradient:
    """A passive party's side: its block's masked encrypted gradients, and the unmasked result."""

    def __init__(self, source: int, public_key: bytes, *, block, scheme: str = "ou", key_bits: int = 2048
                 ) -> None:
        hnp, phe = _heu()
        if not 0 < len(public_key) <= MAX_KEY_BYTES:
            raise ProtocolViolation(source, _WHAT_KEY, f"{len(public_key)} bytes is no public key")
        try:
            key = phe.PublicKey.load_from(public_key)
            self._kit = hnp.setup(key)
        except Exception as err:
            raise ProtocolViolation(source, _WHAT_KEY, f"does not parse ({_first_line(err)})") from None
        if self._kit.get_schema() != _schema(scheme):
            raise ProtocolViolation(source, _WHAT_KEY, f"is not a {scheme} key")
        self.scheme = scheme
        bound = int(str(self._kit.public_key().plaintext_bound()))
        #: Paillier: n, the masks are uniform below it; OU: None, masks of ou_mask_bits(key_bits) bits
        self._modulus: int | None = None
        if scheme == "paillier":
            self._modulus = paillier_modulus(self._kit.public_key())
            if self._modulus is None or self._modulus % 2 == 0 or self._modulus.bit_length() != key_bits:
                raise ProtocolViolation(source, _WHAT_KEY, f"is not an odd {key_bits}-bit Paillier modulus")
        elif bound < 1 << (ou_mask_bits(key_bits) + 1):
            raise ProtocolViolation(source, _WHAT_KEY,
                                    f"has a plaintext space too small for a {key_bits}-bit key's masks")
        self.source = source
        self.key_bits = key_bits  # the job's, public: bounds what is parsed
        self._encoder = phe.IntegerEncoder(_schema(scheme), 1)
        self._big = phe.BigintEncoder(_schema(scheme))
        self._encryptor = self._kit.encryptor()
        self._evaluator = self._kit.evaluator()
        self.block = block
        data = np.asarray(block.data, dtype=np.float64)
        if data.size and not np.all(np.abs(data) < 2.0**VALUE_BITS):
            raise ValueError(f"--label-privacy he needs features within ±2^{VALUE_BITS} (fixed point); "
                             f"scale the data")
        self.feature_bits = 0 if np.all(data == np.rint(data)) else FEATURE_BITS
        self._encoded = np.rint(data * 2.0**self.feature_bits).astype(np.int64)
        self._masks: list[int] | None = None
        self._bounds: np.ndarray | None = None
        #: masks encrypted ahead of need (:meth:`prepare_masks`), oldest first; each taken once
        self._prepared: collections.deque = collections.deque()

    def draw_masks(self, count: int) -> tuple[list[int], list[int]]:
        """``count`` fresh masks r (Paillier: uniform on [0, n); OU: on [0, 2^ou_mask_bits)) and their
        encodings for the library (Paillier: the representative in (−n/2, n/2], HEU's plaintext range)."""
        if self._modulus is None:
            masks = [secrets.randbits(ou_mask_bits(self.key_bits)) for _ in range(count)]
            return masks, masks
        n = self._modulus
        masks = [secrets.randbelow(n) for _ in range(count)]
        return masks, [r if r <= n // 2 else r - n for r in masks]

    def masked(self, payload: bytes, rows: np.ndarray, progress: Callable[[], None] | None = None) -> bytes:
        """[[X_Bᵀϑ + r]] for the batch ``rows`` from the encrypted ϑ's in ``payload``; keeps r for
        :meth:`unmask`. ``progress`` is called after each piece of the work but the last
        (:func:`progress_words`)."""
        masked, pending = self.masked_batch(payload, rows, progress)
        self._masks, self._bounds = pending
        return masked

    def masked_batch(self, payload: bytes, rows: np.ndarray, progress: Callable[[], None] | None = None
                     ) -> tuple[bytes, Pending]:
        """:meth:`masked` that returns its masks and bounds instead of keeping them, so that several
        batches can wait for their decryptions at once (the label plane masks a batch as soon as it
        arrives); :meth:`unmask_batch` takes them back, once."""
        sums, bounds = self.sums_and_bounds(payload, rows, progress)
        # one fresh encryption per column, used once: it also re-randomises each column's sum
        masks, encrypted = self.take_masks()
        masked = encrypted.serialize() if sums is None else self._evaluator.add(sums, encrypted).serialize()
        return masked, Pending(masks, bounds)

    def encrypt_masks(self) -> tuple[list[int], object]:
        """One masked pass's masks (:meth:`draw_masks`, one per column) and their fresh encryptions."""
        masks, encoded = self.draw_masks(self.block.n_cols)
        return masks, self._encryptor.encrypt(self._kit.array(np.array(encoded, dtype=object), self._big))

    def prepare_masks(self) -> None:
        """Encrypt the next masked pass's masks now, ahead of need: they depend on no data, and their
        encryption is most of a passive party's own work for a batch (a 681-bit OU exponent per column).
        The label plane calls this while the party waits for the dominator's decryption, when its core
        is otherwise idle. At most :data:`PREPARED_PASSES` sets wait; each is taken, once, by the next
        :meth:`take_masks` (the masks stay as fresh and as wide as those drawn on demand)."""
        if len(self._prepared) < PREPARED_PASSES:
            self._prepared.append(self.encrypt_masks())

    def take_masks(self) -> tuple[list[int], object]:
        """A prepared set of masks, removed from the pool, or a fresh one when none waits."""
        try:
            return self._prepared.popleft()
        except IndexError:
            return self.encrypt_masks()

    def column_sums(self, payload: bytes, rows: np.ndarray, progress: Callable[[], None] | None = None):
        """[[X_Bᵀϑ]] (d_l ciphertexts, None when the batch's rows are all zero in this block) from the
        encrypted ϑ's in ``payload``, every field checked; sets the bounds :meth:`unmask` checks.
        ``progress`` is called after each piece of the work but the last (:func:`progress_words`)."""
        sums, self._bounds = self.sums_and_bounds(payload, rows, progress)
        return sums

    def sums_and_bounds(self, payload: bytes, rows: np.ndarray, progress: Callable[[], None] | None = None):
        """:meth:`column_sums` and the bounds of the check after unmasking, returned, not kept."""
        hnp, _ = _heu()
        b = rows.size
        if not 0 < len(payload) <= ciphertext_limit(self.key_bits, b):
            raise ProtocolViolation(self.source, _WHAT_CT, f"{len(payload)} bytes for {b} ciphertexts")
        try:
            cts = hnp.CiphertextArray.load_from(payload)
        except Exception as err:
            raise ProtocolViolation(self.source, _WHAT_CT,
                                    f"not a ciphertext array ({_first_line(err)})") from None
        if cts.ndim != 1 or cts.size != b:
            raise ProtocolViolation(self.source, _WHAT_CT, f"{cts.size} ciphertexts for {b} rows")
        blk = self.block
        starts, ends = blk.indptr[rows], blk.indptr[rows + 1]
        nnz = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)]) \
            if b else np.zeros(0, np.int64)
        position = np.repeat(np.arange(b), ends - starts)  # which ciphertext each non-zero multiplies
        pieces = [*np.concatenate([[0], np.cumsum(ends - starts)])[:-1][::MASK_ROWS].tolist(), nnz.size]
        columns = blk.indices[nnz]
        d = blk.n_cols
        # what honest ϑ's (|ϑ| < 2^VALUE_BITS) can make of each column: the check after unmasking
        bounds = np.bincount(columns, weights=np.abs(self._encoded[nnz]).astype(np.float64),
                             minlength=d) * 2.0**(VALUE_BITS + THETA_BITS)
        if np.any(bounds >= 2.0**(RETURN_BITS - 2)):
            raise ValueError(f"a column's gradient over {b} rows could leave the {RETURN_BITS}-bit return "
                             f"width: scale the features")
        try:  # the library computes on the peer's ciphertexts: what it cannot do is the peer's fault
            if self._modulus is not None:
                self._check_probes(cts)
            return self._column_sums(cts, nnz, position, columns, pieces, progress), bounds
        except ProtocolViolation:
            raise
        except Exception as err:  # e.g. a ciphertext of another scheme: "std::get: wrong index for variant"
            raise ProtocolViolation(self.source, _WHAT_CT,
                                    f"does not compute under its key ({_first_line(err)})") from None

    def _column_sums(self, cts, nnz: np.ndarray, position: np.ndarray, columns: np.ndarray, pieces: list[int],
                     progress: Callable[[], None] | None):
        """[[Σ_i x_ij ϑ_i]] per column j (:meth:`column_sums`'s arithmetic), None without a non-zero, in
        pieces of :data:`MASK_ROWS` rows (``pieces``: where each starts in the non-zeros, then the end),
        so that the GIL is free between pieces. A column the first piece lacks starts from the library's
        zero (an empty sum): the fresh encryption of its mask re-randomises it, as every column's."""
        ev, d = self._evaluator, self.block.n_cols
        if nnz.size == 0:
            return None
        total = None
        for k, (lo, hi) in enumerate(itertools.pairwise(pieces)):
            if k and progress is not None:
                progress()
            if lo == hi:
                continue
            chunk = slice(lo, hi)
            terms = cts[position[chunk].tolist()]
            factors = self._encoded[nnz[chunk]]
            if self.feature_bits or np.any(factors != 1):
                terms = ev.mul(terms, self._kit.array(factors, self._encoder))
            order = np.argsort(columns[chunk], kind="stable")
            if total is None:  # all d columns, a column without a non-zero an empty group: zero
                bounds = np.searchsorted(columns[chunk][order], np.arange(d + 1))
                groups = [order[a:b].tolist() for a, b in itertools.pairwise(bounds)]
                total = ev.batch_select_sum(terms, groups)
                continue
            present, starts = np.unique(columns[chunk][order], return_index=True)
            sums = ev.batch_select_sum(terms, [g.tolist() for g in np.split(order, starts[1:])])
            present = present.tolist()
            total[present] = ev.add(total[present], sums)  # one call each, no per-column loop
        return total

    def _check_probes(self, cts) -> None:
        """Paillier: every ciphertext of the batch is non-negative and has Jacobi symbol +1 mod n, checked
        on JACOBI_PROBES random subset sums (module doc). HEU's text form of a ciphertext is c·2^(60k)
        mod n² for its Montgomery arithmetic, with HEU's sign; 2^(60k) is a square, so the symbol is c's
        own."""
        n, size = self._modulus, cts.size
        rng = np.random.default_rng()  # OS entropy: the dominator must not know the subsets
        picks = [p.tolist() for p in (np.flatnonzero(rng.random(size) < 0.5) for _ in range(JACOBI_PROBES))
                 if p.size]
        sums = self._evaluator.batch_select_sum(cts, picks)
        for k in range(len(picks)):
            value = int(str(sums[k]))
            if value < 0:
                raise ProtocolViolation(self.source, _WHAT_CT,
                                        "holds a negative ciphertext: no honest encryption is one, and the "
                                        "reply's sign would show a parity of the features")
            if gmpy2.jacobi(value % n, n) != 1:
                raise ProtocolViolation(self.source, _WHAT_CT,
                                        "holds a ciphertext whose Jacobi symbol is not +1: no honest "
                                        "encryption has one, and the reply would show a parity of the "
                                        "features")

    def unmask(self, words: np.ndarray) -> np.ndarray:
        """The batch gradient Σ_i ϑ_i x_i (float64, d_l values) from the active party's reply; a value no
        honest batch can sum to ends the job naming the active party (module doc)."""
        assert self._masks is not None and self._bounds is not None, "masked() first"
        pending, self._masks, self._bounds = Pending(self._masks, self._bounds), None, None
        return self.unmask_batch(words, pending)

    def unmask_batch(self, words: np.ndarray, pending: Pending) -> np.ndarray:
        """:meth:`unmask` with the masks and bounds :meth:`masked_batch` returned for this batch."""
        masks, bounds = pending
        values = _from_words(self.source, words, len(masks))
        full = 1 << RETURN_BITS
        out = np.empty(len(values))
        for j, (v, r) in enumerate(zip(values, masks, strict=True)):
            g = (v - r) % full
            g = g - full if g >= full >> 1 else g
            if abs(g) > bounds[j]:
                raise ProtocolViolation(self.source, _WHAT_REPLY, f"column {j} unmasks to {abs(g):.3g}·2^-"
                                        f"{THETA_BITS + self.feature_bits}, more than the batch's ϑ's can "
                                        f"sum to: the decryption wrapped, which no honest key and reply do")
            out[j] = g / 2.0**(THETA_BITS + self.feature_bits)
        return out


def _first_line(err: Exception) -> str:
    """The library's message without the C++ stack trace it appends."""
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _to_words(values: list[int]) -> np.ndarray:
    """Values below 2^128 as two little-endian uint64 words each."""
    mask = (1 << 64) - 1
    return np.array([w for v in values for w in (v & mask, v >> 64)], dtype=np.uint64)


def _from_words(source: int, words: np.ndarray, count: int) -> list[int]:
    if words.dtype != np.uint64 or words.shape != (2 * count,):
        raise ProtocolViolation(source, _WHAT_REPLY, f"{words.size} words, expected {2 * count}")
    pairs = words.reshape(count, 2).tolist()
    return [lo | (hi << 64) for lo, hi in pairs]


# ------------------------------------------------------------------------------------- wire format
# Data-plane messages are uint64 words; byte payloads are padded to whole words after a length word.


def pack_batch(seq: int, rows: np.ndarray, payload: bytes) -> np.ndarray:
    """Dominator → passive party: ``[seq, B, nbytes, rows..., payload...]``."""
    return np.concatenate([np.array([seq, rows.size, len(payload)], dtype=np.uint64),
                           rows.astype(np.uint64), bytes_to_words(payload)])


def unpack_batch(source: int, words: np.ndarray, *, n_rows: int, batch: int
                 ) -> tuple[int, np.ndarray, bytes]:
    """Sequence number, rows and ciphertext bytes of an encrypted batch, every field checked."""
    if words.size < 3 or int(words[1]) != batch:
        raise ProtocolViolation(source, _WHAT_CT, f"batch size {int(words[1]) if words.size > 1 else '?'}, "
                                f"the job's is {batch}")
    seq, nbytes = int(words[0]), int(words[2])
    if words.size != 3 + batch + -(-nbytes // 8):
        raise ProtocolViolation(source, _WHAT_CT, f"{words.size} words for B = {batch} and {nbytes} bytes")
    rows = words[3:3 + batch]
    if np.any(rows >= n_rows):
        raise ProtocolViolation(source, _WHAT_CT, f"row {int(rows.max())} is not in 0..{n_rows - 1}")
    return seq, rows.astype(np.int64), words[3 + batch:].tobytes()[:nbytes]


def pack_bytes(seq: int, payload: bytes) -> np.ndarray:
    """Passive party → dominator: ``[seq, nbytes, payload...]``."""
    return np.concatenate([np.array([seq, len(payload)], dtype=np.uint64), bytes_to_words(payload)])


def unpack_bytes(source: int, words: np.ndarray, what: str) -> tuple[int, bytes]:
    if words.size < 2 or words.size != 2 + -(-int(words[1]) // 8):
        raise ProtocolViolation(source, what, f"{words.size} words do not frame their byte count")
    return int(words[0]), words[2:].tobytes()[:int(words[1])]


def bytes_to_words(payload: bytes) -> np.ndarray:
    padded = payload + bytes(-len(payload) % 8)
    return np.frombuffer(padded, dtype=np.uint64)
