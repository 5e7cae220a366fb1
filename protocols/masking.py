"""Encodings and masks for secure aggregation: fixed point in the ring Z_2^64 (default) or the paper's reals.

Every value that travels is a 64-bit word, so both schemes share one wire format (``uint64`` arrays):

* :class:`FixedPointRing` (default; ours, not the paper's): a real ``x`` becomes
  ``round(x * 2**fraction_bits)`` in two's complement modulo 2**64 and masks are uniform 64-bit words.
  Sums wrap around (numpy ``uint64`` arithmetic), so ``Σ(o + δ) - Σδ`` cancels *exactly* and every masked
  word the other parties see is uniformly distributed, whatever ``o`` is. The result is exact up to the
  encoding and the final conversion: each party rounds once to the grid (``resolution / 2`` each), and
  the root turns the exact integer sum into a float64 (relative ``2**-53``), so
  ``|z - Σo| <= q * resolution / 2 + 2**-53 * (|Σo| + q * resolution / 2)``
  (:meth:`FixedPointRing.error_bound`; the second term is what a plain float64 sum of large values pays
  too).
  A nonzero value below ``resolution / 2`` encodes as 0: its absolute error stays within the bound, but
  its relative error is 1. The encoder then issues a :class:`PrecisionWarning` saying how many values
  vanished; choose the scale from the range you expect with :meth:`FixedPointRing.for_range` (the finest
  grid that still holds it) rather than the default.
  The encoded *sum* must stay inside the signed range; we cannot see a wrapped sum, so we bound each
  addend instead: a party whose ``|x|`` exceeds ``max_abs(q) = 2**62 / (q * 2**fraction_bits)`` (one
  bit of headroom, so float rounding at the boundary cannot wrap) or is NaN/inf contributes 0 for that
  entry and raises a count that travels up ``T1`` in the message header; the root then refuses the
  result (:class:`AggregationOverflowError`). The count travels masked (see
  :mod:`protocols.aggregation`): only the root learns it, and only the total over all parties, never
  which party's entries nor their values.
* Complex input is refused (:class:`TypeError`): casting would silently drop the imaginary part.
  The default ``fraction_bits = 32`` gives a resolution of 2.3e-10 and, for q = 8, ``|x| <= 1.3e8``;
  raise it for more precision, lower it for larger values.
* :class:`RealValued` (PAPER, Algorithm 1 as printed): ``float64`` values plus Gaussian masks
  ``δ ~ N(0, scale²)``. Cancellation is only approximate (float rounding grows with ``scale``) and masked
  values are not uniform: a large ``|o|`` shows through a small ``scale``. Kept for faithfulness and
  comparison.

Masks come from a stream cipher's keystream (the ``cryptography`` package: AES-128-CTR on CPUs with AES
instructions, else ChaCha20; see :data:`DEFAULT_CIPHER`) keyed from ``os.urandom``; each
:class:`Keystream` is private to one party and hands out every word once: fresh masks for every request.
Small draws come from a 64 KiB buffer of keystream generated at once, so that B = 1 does not pay a cipher
call per request.

Speed (the VFB² runtime masks at every party for every dominated update, B = 1): :meth:`~MaskingScheme.share`
produces both of a party's contributions in one call; :class:`FixedPointRing` does up to 8 values with
Python ints (a dozen numpy calls cost more than the arithmetic) and larger batches in place, 8192 values at
a time, with no whole-batch temporaries.
"""

from __future__ import annotations

import math
import os
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from numpy.typing import NDArray

__all__ = [
    "AggregationOverflowError",
    "FixedPointRing",
    "Keystream",
    "MaskingScheme",
    "PrecisionWarning",
    "RealValued",
    "as_real_vector",
]

Words = NDArray[np.uint64]

_WORD = (1 << 64) - 1
_SIGN = 1 << 63
#: Up to this many values, :class:`FixedPointRing` works on Python ints instead of numpy arrays.
_SCALAR_BATCH = 8
#: Larger batches are encoded and decoded this many values at a time through a small scratch array: it
#: stays in cache and malloc recycles it, whereas a fresh whole-batch temporary of 512 KiB (B = 65536)
#: costs a page fault per 4 KiB (measured: ~150 µs per temporary on this machine, more than the math).
_CHUNK = 8192


class AggregationOverflowError(OverflowError):
    """A party's value was non-finite or too large for the fixed-point encoding; the sum is unusable."""


class PrecisionWarning(UserWarning):
    """Nonzero values were smaller than half the fixed-point resolution and were encoded as 0."""


_FLOAT64 = np.dtype(np.float64)


def as_real_vector(values: object, what: str = "values") -> NDArray[np.float64]:
    """``values`` as a non-empty 1-D float64 array; complex input is refused, not silently truncated."""
    if type(values) is np.ndarray and values.dtype == _FLOAT64 and values.ndim == 1 and values.size:
        return values  # what every party's contribution already is: no dozen checks per request
    array = np.asarray(values)
    if np.iscomplexobj(array):
        raise TypeError(f"{what} are complex ({array.dtype}); secure aggregation sums real numbers and "
                        f"would drop the imaginary part. Aggregate .real and .imag separately.")
    if array.dtype.kind not in "biuf":
        raise TypeError(f"{what} must be real numbers, got dtype {array.dtype}")
    array = np.asarray(array, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{what} must be a non-empty 1-D array, got shape {array.shape}")
    return array


def _warn_underflow(count: int, fraction_bits: int) -> None:
    warnings.warn(f"{count} nonzero value(s) are smaller than half the fixed-point resolution "
                  f"2**-{fraction_bits} and were encoded as 0 (relative error 1). Use more fraction bits, "
                  f"e.g. FixedPointRing.for_range(largest |value|, parties).", PrecisionWarning, stacklevel=4)


def _has_aes_instructions() -> bool:
    """Whether this CPU has AES-NI (x86) or the ARMv8 AES extension."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.split(":", 1)[0].strip() in ("flags", "Features") and " aes" in line
               for line in flags.splitlines())


#: The keystream cipher: AES-128-CTR where the CPU has AES instructions (measured 9.5 GB/s here against
#: ChaCha20's 5.3 GB/s on the same core), else ChaCha20, which is faster in software.
DEFAULT_CIPHER = "aes-128-ctr" if _has_aes_instructions() else "chacha20"


class Keystream:
    """Cryptographically random 64-bit words: a stream cipher's keystream under a key from ``os.urandom``
    (``cipher``: ``"aes-128-ctr"`` or ``"chacha20"``; by default the faster one on this CPU).

    Small draws (the B = 1 hot path takes one word per request) are served from a buffer of
    ``BUFFER_WORDS`` words generated in one cipher call, because one ChaCha20 call costs microseconds of
    fixed overhead; the read position only moves forward, so no word is ever handed out twice. Draws of
    ``BUFFER_WORDS`` or more are written straight into the caller's array. Not thread-safe: give every
    party (every :class:`~protocols.aggregation.AggregationNode`) its own. The key is replaced after
    ``REKEY_BYTES`` so the 32-bit block counter never wraps.
    """

    REKEY_BYTES = 1 << 36
    BUFFER_WORDS = 1 << 13  # 64 KiB

    def __init__(self, cipher: str = DEFAULT_CIPHER) -> None:
        if cipher not in ("aes-128-ctr", "chacha20"):
            raise ValueError(f"unknown keystream cipher {cipher!r}: aes-128-ctr or chacha20")
        self.cipher = cipher
        self._zeros = bytearray(8 * self.BUFFER_WORDS)
        self._buffer = np.empty(self.BUFFER_WORDS, dtype=np.uint64)
        self._position = self.BUFFER_WORDS  # empty: filled on the first small draw
        self._rekey()

    def fill(self, out: Words) -> None:
        """Overwrite ``out`` (a contiguous ``uint64`` array) with fresh random words."""
        if out.size < self.BUFFER_WORDS:
            out[...] = self._take(out.size)
        else:
            self._generate_into(out)

    def word(self) -> int:
        """One fresh random 64-bit word as a Python int (the masked overflow flag of each request)."""
        return int(self._take(1)[0])

    def words(self, n: int) -> Words:
        out = np.empty(n, dtype=np.uint64)
        self.fill(out)
        return out

    def _take(self, n: int) -> Words:
        """A view of the next ``n < BUFFER_WORDS`` unused buffered words; copy it before the next draw."""
        start = self._position
        if start + n > self.BUFFER_WORDS:  # the rest of the buffer is skipped, never reused
            self._generate_into(self._buffer)
            start = 0
        self._position = start + n
        return self._buffer[start:start + n]

    def _generate_into(self, out: Words) -> None:
        nbytes = out.nbytes
        if nbytes > len(self._zeros):
            self._zeros = bytearray(nbytes)
        if self._used + nbytes > self.REKEY_BYTES:
            self._rekey()
        self._encryptor.update_into(memoryview(self._zeros)[:nbytes], memoryview(out).cast("B"))
        self._used += nbytes

    def _rekey(self) -> None:
        if self.cipher == "chacha20":
            nonce = bytes(4) + os.urandom(12)  # 32-bit block counter from 0, then a random 96-bit nonce
            self._encryptor = Cipher(algorithms.ChaCha20(os.urandom(32), nonce), mode=None).encryptor()
        else:  # a random 64-bit nonce, then a 64-bit block counter from 0: it never wraps before a rekey
            counter_block = os.urandom(8) + bytes(8)
            self._encryptor = Cipher(algorithms.AES(os.urandom(16)), modes.CTR(counter_block)).encryptor()
        self._used = 0


class MaskingScheme(ABC):
    """How reals become 64-bit words, how masks are drawn, how words add up and how the root decodes.

    Schemes are immutable, hashable configurations (every party must use the same one); the randomness
    lives in the :class:`Keystream` passed in.
    """

    @abstractmethod
    def encode(self, values: NDArray[np.float64], num_parties: int) -> tuple[Words, int]:
        """Words for ``values`` and the number of entries that could not be encoded (sent as zeros)."""

    @abstractmethod
    def draw_masks(self, keystream: Keystream, out: Words) -> None:
        """Fill ``out`` with fresh masks δ."""

    @abstractmethod
    def accumulate(self, total: Words, addend: Words) -> None:
        """``total += addend`` in the scheme's arithmetic, in place."""

    @abstractmethod
    def unmask(self, masked_sum: Words, mask_sum: Words) -> NDArray[np.float64]:
        """``ξ1 - ξ2`` decoded to reals."""

    def share(self, values: NDArray[np.float64], num_parties: int, keystream: Keystream,
              masked_out: Words, masks_out: Words) -> int:
        """A party's two contributions: fresh masks δ into ``masks_out``, ``encode(values) + δ`` into
        ``masked_out``. Returns how many entries could not be encoded (they contribute ``0 + δ``)."""
        self.draw_masks(keystream, masks_out)
        encoded, out_of_range = self.encode(values, num_parties)
        masked_out[...] = encoded
        self.accumulate(masked_out, masks_out)
        return out_of_range


@dataclass(frozen=True)
class FixedPointRing(MaskingScheme):
    """Fixed point with ``fraction_bits`` binary digits after the point, in Z_2^64, uniform masks."""

    fraction_bits: int = 32

    def __post_init__(self) -> None:
        if not 0 <= self.fraction_bits <= 60:
            raise ValueError(f"fraction_bits must be in 0..60, got {self.fraction_bits}")

    @property
    def resolution(self) -> float:
        """The step between representable values, 2**-fraction_bits."""
        return math.ldexp(1.0, -self.fraction_bits)

    def max_abs(self, num_parties: int) -> float:
        """The largest |value| a party may contribute so that the sum of all parties cannot overflow."""
        return math.ldexp(1.0, 62 - self.fraction_bits) / num_parties

    def error_bound(self, num_parties: int, magnitude: float) -> float:
        """Bound on ``|z - Σo|`` for a sum of ``num_parties`` in-range values with ``|Σo| <= magnitude``.

        Each party's rounding to the grid (``resolution / 2``) plus the root's conversion of the exact
        integer sum to float64 (relative ``2**-53`` of the fixed-point sum, itself within the first term
        of ``Σo``); both are attained, so neither can be left out.
        """
        grid = num_parties * self.resolution / 2
        return grid + math.ldexp(magnitude + grid, -53)

    @classmethod
    def for_range(cls, max_abs: float, num_parties: int) -> FixedPointRing:
        """The finest encoding (most fraction bits) in which every party may contribute ``|x| <= max_abs``."""
        if not (math.isfinite(max_abs) and max_abs > 0) or num_parties < 1:
            raise ValueError(f"need a positive finite max_abs and num_parties >= 1, got {max_abs}, "
                             f"{num_parties}")
        # largest f with max_abs <= 2**(62 - f) / q, i.e. f <= 62 - log2(max_abs * q)
        bits = 62 - math.ceil(math.log2(max_abs * num_parties))
        if bits < 0:
            raise ValueError(f"|values| up to {max_abs} from {num_parties} parties do not fit in 64 bits")
        return cls(min(bits, 60))

    def encode(self, values: NDArray[np.float64], num_parties: int) -> tuple[Words, int]:
        out = np.empty(values.size, dtype=np.uint64)
        return out, self._encode_into(values, num_parties, out)

    def draw_masks(self, keystream: Keystream, out: Words) -> None:
        keystream.fill(out)

    def share(self, values: NDArray[np.float64], num_parties: int, keystream: Keystream,
              masked_out: Words, masks_out: Words) -> int:
        keystream.fill(masks_out)
        if values.size > _SCALAR_BATCH:
            return self._encode_into(values, num_parties, masked_out, plus=masks_out)
        # The runtime's B = 1 hot path: for a few values, Python ints beat a dozen numpy calls of ~1 µs
        # fixed cost each. Same words as the vectorised path: the same float product, rounding half to
        # even (Python's round() and np.rint), two's complement modulo 2**64, and range rule.
        scale = math.ldexp(1.0, self.fraction_bits)
        bound = math.ldexp(1.0, 62) / num_parties
        out_of_range = underflow = 0
        for i, (value, mask) in enumerate(zip(values.tolist(), masks_out.tolist(), strict=True)):
            scaled = value * scale
            if -bound <= scaled <= bound:  # also false for NaN
                code = round(scaled)
                if not code and value:
                    underflow += 1
                masked_out[i] = (code + mask) & _WORD
            else:
                out_of_range += 1
                masked_out[i] = mask
        if underflow:
            _warn_underflow(underflow, self.fraction_bits)
        return out_of_range

    def accumulate(self, total: Words, addend: Words) -> None:
        np.add(total, addend, out=total)  # wraps modulo 2**64

    def unmask(self, masked_sum: Words, mask_sum: Words) -> NDArray[np.float64]:
        step = math.ldexp(1.0, -self.fraction_bits)
        n = masked_sum.size
        if n <= _SCALAR_BATCH:  # Python ints convert to float with the same rounding as numpy's int64
            pairs = zip(masked_sum.tolist(), mask_sum.tolist(), strict=True)
            return np.array([float(((m - k + _SIGN) & _WORD) - _SIGN) * step for m, k in pairs])
        out = np.empty(n)
        difference = np.empty(min(n, _CHUNK), dtype=np.uint64)
        for start in range(0, n, _CHUNK):
            end = min(start + _CHUNK, n)
            part = difference[:end - start]
            np.subtract(masked_sum[start:end], mask_sum[start:end], out=part)  # modulo 2**64
            np.multiply(part.view(np.int64), step, out=out[start:end])
        return out

    def _encode_into(self, values: NDArray[np.float64], num_parties: int, out: Words,
                     plus: Words | None = None) -> int:
        """Encode ``values`` into ``out`` (then add ``plus`` modulo 2**64); the count out of range."""
        scale = math.ldexp(1.0, self.fraction_bits)
        bound = math.ldexp(1.0, 62) / num_parties
        n = values.size
        scratch = np.empty(min(n, _CHUNK))
        as_signed = out.view(np.int64)
        out_of_range = underflow = 0
        for start in range(0, n, _CHUNK):
            end = min(start + _CHUNK, n)
            scaled = scratch[:end - start]
            np.multiply(values[start:end], scale, out=scaled)
            if not (-bound <= scaled.min() and scaled.max() <= bound):  # also false for NaN
                in_range = np.abs(scaled) <= bound
                out_of_range += int(in_range.size - np.count_nonzero(in_range))
                scaled[~in_range] = 0.0
            # nonzero values that round to 0 (out-of-range entries were zeroed above, so not counted)
            zeros_before = scaled.size - np.count_nonzero(scaled)
            np.rint(scaled, out=scaled)
            underflow += scaled.size - np.count_nonzero(scaled) - zeros_before
            np.copyto(as_signed[start:end], scaled, casting="unsafe")  # exact: integral, |x| <= 2**62
            if plus is not None:
                np.add(out[start:end], plus[start:end], out=out[start:end])  # wraps modulo 2**64
        if underflow:
            _warn_underflow(underflow, self.fraction_bits)
        return out_of_range


@dataclass(frozen=True)
class RealValued(MaskingScheme):
    """The paper's masking: float64 values plus δ ~ N(0, scale²). Approximate; see the module docstring."""

    scale: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"mask scale must be a positive finite number, got {self.scale}")

    def encode(self, values: NDArray[np.float64], num_parties: int) -> tuple[Words, int]:
        floats = np.array(values, dtype=np.float64)
        finite = np.isfinite(floats)
        bad = int(floats.size - np.count_nonzero(finite))
        if bad:
            floats[~finite] = 0.0
        return floats.view(np.uint64), bad

    def draw_masks(self, keystream: Keystream, out: Words) -> None:
        # Box-Muller on two uniforms in (0, 1] built from the top 53 bits of keystream words.
        n = out.size
        half = (n + 1) // 2
        raw = keystream.words(2 * half)
        uniform = ((raw >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53
        radius = self.scale * np.sqrt(-2.0 * np.log(uniform[:half]))
        angle = 2.0 * np.pi * uniform[half:]
        gaussian = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:n]
        out.view(np.float64)[:] = gaussian

    def accumulate(self, total: Words, addend: Words) -> None:
        floats = total.view(np.float64)
        np.add(floats, addend.view(np.float64), out=floats)

    def unmask(self, masked_sum: Words, mask_sum: Words) -> NDArray[np.float64]:
        return masked_sum.view(np.float64) - mask_sum.view(np.float64)
