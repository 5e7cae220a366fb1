"""``--label-privacy he``: a passive party's block gradient from ϑ's it only ever sees encrypted.

The protocol (the one FATE runs for hetero logistic regression, on our dispatcher), per mini-batch of
B rows dominated by active party a:

1. a encrypts the B values ϑ_i under its own additively homomorphic key and sends them with the rows.
2. Passive party l computes [[g_j]] = Σ_i [[ϑ_i]]·x_ij for *every* column j of its block (also the
   columns that are zero in this batch: sending only the non-zero ones would show a which features of
   the batch rows are non-zero), adds a freshly *encrypted* mask r_j (fresh randomness: a plaintext
   mask would leave Π ρ_i^{x_ij} of a's own encryption randomness in the result, from which a could
   test guesses of x), and sends the d_l ciphertexts back.
3. a decrypts g_j + r_j and returns (g_j + r_j) mod 2^128; l subtracts r_j and applies the step.

Threat model: semi-honest parties (they follow the protocol, and look at everything they receive).

* The passive party sees ciphertexts under a's key, the rows of the batch and its own batch gradient
  g = X_Bᵀ ϑ_B: d_l linear equations in the B unknowns ϑ_B. When X_B has rank B (only possible with
  B ≤ d_l) they determine ϑ_B (B = 1 gives ϑ = g_j / x_ij outright), so B must exceed d_l: the
  launcher refuses a smaller B and the active party itself refuses to decrypt a gradient of B or more
  values. With B > d_l the
  party still learns the d_l-dimensional projection X_Bᵀ ϑ_B of each batch, and its own model block
  w_l (as in every VFL mode): both are label information by design; docs/label-privacy.md says more.
* The active party sees g_j + r_j with r_j uniform on [0, 2^MASK_BITS): its statistical distance
  from r_j alone is |g_j| / 2^MASK_BITS < 2^(GRADIENT_BITS − MASK_BITS) = 2^-100. It learns d_l
  (public anyway).

Fixed point: ϑ is encoded with THETA_BITS fractional bits (resolution 2^-32 ≈ 2.3e-10); a party's
features exactly when they are all integers (one-hot, counts: multiplying a ciphertext by 1 is
free), else with FEATURE_BITS fractional bits (resolution 2^-24 ≈ 6e-8);
the sum is exact in the integers, so the only error is the two roundings. |ϑ| and |x| must stay
below 2^20 (a diverging run stops with a clear message instead of wrapping around).

Library: SecretFlow HEU (``sf-heu``, C++). Okamoto–Uchiyama with a 2048-bit modulus n = p²q is the
default: HEU draws its primes and randomness for 112-bit security, NIST SP 800-57's level for a
2048-bit RSA modulus; ``--he-key-bits 3072`` gives 128 bits. Measurements: docs/label-privacy.md.
Paillier (``--he-scheme paillier``) is there for those whose policy names it (25-30x slower a batch).

Every buffer another party sends is checked here before the library parses it: exact header, lengths
within the bounds the key size allows, a ciphertext count equal to what the protocol produces; a
failure raises :class:`~protocols.errors.ProtocolViolation` naming the sender.
"""

from __future__ import annotations

import functools
import os
import sys

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
#: The active party returns g + r modulo 2^RETURN_BITS; |g| < 2^(RETURN_BITS − 1) keeps g exact.
RETURN_BITS = 128
#: Masks are uniform on [0, 2^MASK_BITS): 80 bits of statistical hiding above the return width.
MASK_BITS = RETURN_BITS + 80
#: Smallest B anyone may ask for; the real floor is d_l + 1 of the widest passive block (module doc).
MIN_BATCH = 16
SCHEMES = ("ou", "paillier")
KEY_BITS = (2048, 3072, 4096)
#: Largest public key / ciphertext serialisation accepted, per key bit (measured for 2048 bits: an OU
#: key 0.39 B/bit, an OU ciphertext 0.13, a Paillier one 0.26; they only bound what is parsed).
MAX_KEY_BYTES = max(KEY_BITS)
_CT_BYTES_PER_BIT = 0.3
assert GRADIENT_BITS < RETURN_BITS - 1

_WHAT_CT = "encrypted batch"
_WHAT_KEY = "public key"


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


def min_batch(widest_passive_block: int) -> int:
    """The smallest B with which no passive party can solve its batch gradient for ϑ."""
    return max(MIN_BATCH, widest_passive_block + 1)


def ciphertext_limit(key_bits: int, count: int) -> int:
    """Most bytes ``count`` serialised ciphertexts of a ``key_bits`` key may take."""
    return int(count * key_bits * _CT_BYTES_PER_BIT) + 64


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

    def public_bytes(self) -> bytes:
        return self._kit.public_key().serialize()

    def encrypt(self, thetas: np.ndarray) -> bytes:
        """The serialised ciphertexts of ϑ in fixed point; ϑ outside ±2^VALUE_BITS is refused."""
        thetas = np.asarray(thetas, dtype=np.float64)
        if not np.all(np.abs(thetas) < 2.0**VALUE_BITS):  # NaN fails too
            raise OverflowError(f"ϑ left ±2^{VALUE_BITS}: the model diverged")
        encoded = np.rint(thetas * 2.0**THETA_BITS).astype(np.int64)
        return self._encryptor.encrypt(self._kit.array(encoded, self._encoder)).serialize()

    def decrypt_masked(self, source: int, payload: bytes, batch: int) -> np.ndarray:
        """(g_j + r_j) mod 2^RETURN_BITS of a passive party's reply, as two uint64 words per value.

        Refuses a reply of ``batch`` or more values: decrypting it would let its sender solve the
        batch's ϑ from its gradient (module doc).
        """
        hnp, _ = _heu()
        if not 0 < len(payload) <= ciphertext_limit(self.key_bits, batch):
            raise ProtocolViolation(source, "masked gradient", f"{len(payload)} bytes is not a serialised "
                                    f"gradient of fewer than {batch} ciphertexts")
        try:
            cts = hnp.CiphertextArray.load_from(payload)
        except Exception as err:
            raise ProtocolViolation(source, "masked gradient",
                                    f"not a ciphertext array ({_first_line(err)})") from None
        if cts.ndim != 1 or not 0 < cts.size < batch:
            raise ProtocolViolation(source, "masked gradient", f"{cts.size} values for a batch of {batch}: "
                                    f"B must exceed the block's columns, or ϑ could be solved for")
        try:
            values = self._decryptor.decrypt(cts).to_numpy(self._big).ravel()
        except Exception as err:
            raise ProtocolViolation(source, "masked gradient",
                                    f"does not decrypt ({_first_line(err)})") from None
        return _to_words([int(v) % (1 << RETURN_BITS) for v in values])


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
        bound = self._kit.public_key().plaintext_bound()
        if int(str(bound)) < 1 << (MASK_BITS + 2):
            raise ProtocolViolation(source, _WHAT_KEY, "has a plaintext space too small for the masks")
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
        self._encode(data)
        self._masks: list[int] | None = None

    def _encode(self, data: np.ndarray) -> None:
        """The features in fixed point: integers as they are, anything else with FEATURE_BITS."""
        self.feature_bits = 0 if np.all(data == np.rint(data)) else FEATURE_BITS
        self._encoded = np.rint(data * 2.0**self.feature_bits).astype(np.int64)

    def clip_rows(self, scale: np.ndarray) -> None:
        """Compute the gradients from rows scaled by ``scale`` (one factor ≤ 1 per row: the row
        clipping of ``--clip-quantile``); the block itself, and so the forward pass, is unchanged."""
        blk = self.block
        if scale.shape != (blk.n_rows,) or not np.all((scale > 0) & (scale <= 1)):
            raise ValueError("row scales must be one factor in (0, 1] per row")
        self._encode(np.asarray(blk.data, dtype=np.float64) * np.repeat(scale, np.diff(blk.indptr)))

    def masked(self, payload: bytes, rows: np.ndarray) -> bytes:
        """[[X_Bᵀϑ + r]] for the batch ``rows`` from the encrypted ϑ's in ``payload``; keeps r."""
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
        columns = blk.indices[nnz]
        d = blk.n_cols
        ev = self._evaluator
        # one fresh encryption per column: an encrypted zero where the batch has no non-zero
        self._masks = [int.from_bytes(os.urandom(MASK_BITS // 8), "little") for _ in range(d)]
        masks = self._encryptor.encrypt(self._kit.array(np.array(self._masks, dtype=object), self._big))
        if nnz.size == 0:
            return masks.serialize()
        terms = cts[position.tolist()]
        if self.feature_bits or np.any(self._encoded[nnz] != 1):
            terms = ev.mul(terms, self._kit.array(self._encoded[nnz], self._encoder))
        order = np.argsort(columns, kind="stable")
        bounds = np.searchsorted(columns[order], np.arange(d + 1))
        groups = [order[bounds[j]:bounds[j + 1]].tolist() for j in range(d)]
        present = [j for j in range(d) if groups[j]]
        sums = ev.batch_select_sum(terms, [groups[j] for j in present])
        if len(present) < d:  # scatter the column sums into a d-vector of encrypted zeros
            zero = self._encryptor.encrypt(self._kit.array(np.zeros(d, np.int64), self._encoder))
            for k, j in enumerate(present):
                zero[j] = sums[k]
            sums = zero
        return ev.add(sums, masks).serialize()

    def unmask(self, words: np.ndarray) -> np.ndarray:
        """The batch gradient Σ_i ϑ_i x_i (float64, d_l values) from the active party's reply."""
        assert self._masks is not None, "masked() first"
        values = _from_words(self.source, words, len(self._masks))
        full = 1 << RETURN_BITS
        out = np.empty(len(values))
        for j, (v, r) in enumerate(zip(values, self._masks, strict=True)):
            g = (v - r) % full
            out[j] = (g - full if g >= full >> 1 else g) / 2.0**(THETA_BITS + self.feature_bits)
        self._masks = None
        return out


def add_noise(words: np.ndarray, noise: np.ndarray, fraction_bits: int) -> np.ndarray:
    """The active party's side of ``--epsilon``: add ``noise`` (one float per value) to decrypted
    values (g_j + r_j) mod 2^RETURN_BITS in the passive party's fixed point (``fraction_bits`` =
    THETA_BITS + its feature bits), so that the party unmasks g_j + noise_j and never g_j."""
    if words.dtype != np.uint64 or words.shape != (2 * noise.size,):
        raise ValueError(f"{words.size} words for {noise.size} noise values")
    if not np.all(np.abs(noise) < 2.0**VALUE_BITS):  # NaN too: the fixed point must not wrap
        raise OverflowError(f"label-DP noise left ±2^{VALUE_BITS}")
    full = 1 << RETURN_BITS
    values = _from_words(-1, words, noise.size)  # our own decryption: the shape is checked above
    # a float64 times 2^k is an exact integer: the noise keeps its 53 bits, the sum is exact mod 2^128
    offsets = np.rint(noise * 2.0**fraction_bits).tolist()
    return _to_words([(v + int(o)) % full for v, o in zip(values, offsets, strict=True)])


def _first_line(err: Exception) -> str:
    """The library's message without the C++ stack trace it appends."""
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _to_words(values: list[int]) -> np.ndarray:
    """Values below 2^128 as two little-endian uint64 words each."""
    mask = (1 << 64) - 1
    return np.array([w for v in values for w in (v & mask, v >> 64)], dtype=np.uint64)


def _from_words(source: int, words: np.ndarray, count: int) -> list[int]:
    if words.dtype != np.uint64 or words.shape != (2 * count,):
        raise ProtocolViolation(source, "decrypted gradient", f"{words.size} words, expected {2 * count}")
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
