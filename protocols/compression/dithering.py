"""Unbiased random dithering (QSGD) with s levels: Example 2 of the SCAFCOM paper and of the ISCA paper's
Appendix A.

    C(x) = ‖x‖₂ · sign(x) ⊙ ζ(x) / s,   ζ_k = ⌊u_k⌋ + Bernoulli(u_k − ⌊u_k⌋),   u_k = s·|x_k| / ‖x‖₂

with s = 2^b for ``bits=b`` (the papers use b = 2 and 4), or any s ≥ 1 with ``levels=s`` (FedPAQ's
quantizer: s = 2^(b−1) − 1). The norm is that of the whole vector, and the division by s is there
(the ISCA paper's printed formula drops it and is biased by a factor 2^b). E[C(x)] = x and
ω = min(d/s², √d/s). x = 0 gives 0.

Randomness: each message draws two 63-bit integers from its ``torch.Generator`` (a fixed amount per
message, so each client's stream advances predictably) and seeds a numpy SFC64 stream with them through
``SeedSequence``; different clients' generators thus seed independent streams. This is simulation
randomness, not cryptography. Every entry gets a uniform U = m·2^-p of the input's float resolution
(p = 24 for float32, 53 for float64: the distribution of ``Tensor.uniform_``), and ζ = ⌊u + U⌋ is
evaluated as ⌊(u·2^p + m)·2^-p⌋, which is the same float arithmetic since scaling by 2^p is exact.
Why not draw d full uniforms: the random draws were most of the codec's time. m is drawn in two parts,
m = c·2^(p−8) + f: a random byte c for every entry (an eighth of a 64-bit word each), and the low p − 8
bits f only for the entries where the byte leaves the outcome open, u + (c + 1)/256 > 1 (about
d·(E[u] + 1/256) of them, found by one numba pass, see ``kernels``; the test has a margin against
rounding). Elsewhere ζ = 0 whatever f is. So each U is still exactly uniform on the grid m·2^-p and
the levels have the same distribution as with d full uniforms, from about 8 random bits per entry.
Because the levels depend on x only through |x_k|/‖x‖, C(βx) = β·C(x) under the same draws for β > 0;
it is bit-exact when β is a power of two, and otherwise up to rounding of |x_k|/‖x‖ (a level can flip
only when a uniform lands within an ulp of the threshold).

Wire format: header, ‖x‖ in the input's float type, then one of two bodies, the smaller one for this
message (header variant bits say which; ties go to dense):
- dense  (variant 0): d sign bits, then d levels ζ_k ∈ {0..s} at ⌈log2(s+1)⌉ bits (b+1 for s = 2^b);
  sign bits of zero levels are 0.
- sparse (variant 1): uint32 count n of non-zero levels, their n positions at ⌈log2 d⌉ bits, n sign
  bits, then n values ζ_k − 1 ∈ {0..s−1} at ⌈log2 s⌉ bits (b bits for s = 2^b).
Dithering sparsifies (E[n] ≤ s·‖x‖₁/‖x‖₂ ≤ s√d), so for the papers' d = 235,146 the sparse body wins by
far: about 1.9k non-zeros at b = 2 and 7.8k at b = 4 in the worst case.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import torch

from protocols.compression.base import (
    Compressor,
    Payload,
    expect_nbytes,
    is_integer,
    row_norms,
    write_header,
)
from protocols.compression.kernels import scores_at_least
from protocols.compression.packing import (
    field_nbytes,
    float_wire_dtype,
    index_width,
    pack_bits_rows,
    pack_uint_rows,
    unpack_bits_rows,
    unpack_uint_rows,
)

_DENSE, _SPARSE = 0, 1
_COUNT = struct.Struct("<I")
_COARSE_BITS = 8  # bits of each entry's uniform drawn up front (one byte)
_ROUNDING_MARGIN = 2.0**-6  # slack of the "outcome still open" test, far above its rounding (≤ 2^-16)
_MAX_BITS = 16  # 65,536 levels: far beyond any use, and keeps level fields small


@dataclass(frozen=True)
class RandomDithering(Compressor):
    """Random dithering with ``bits`` (s = 2^bits levels) or ``levels`` (s levels); give one."""

    bits: int | None = None
    levels: int | None = None

    codec_id = 4
    unbiased = True
    contractive = False
    randomized = True

    def __post_init__(self) -> None:
        if (self.bits is None) == (self.levels is None):
            raise ValueError("dithering needs exactly one of bits= (s = 2^bits levels) or levels= (s)")
        if self.bits is not None and (not is_integer(self.bits) or not 1 <= self.bits <= _MAX_BITS):
            raise ValueError(f"dithering needs an integer bits in [1, {_MAX_BITS}], got {self.bits!r}")
        if self.levels is not None and (not is_integer(self.levels)
                                        or not 1 <= self.levels <= 2**_MAX_BITS):
            raise ValueError(f"dithering needs an integer levels in [1, {2**_MAX_BITS}], got {self.levels!r}")

    @property
    def s(self) -> int:
        """The number of magnitude levels above zero."""
        return 2**self.bits if self.bits is not None else int(self.levels)

    def omega(self, d: int) -> float:
        return min(d / self.s**2, math.sqrt(d) / self.s)

    def _compress_rows(self, X: torch.Tensor, generators: list[torch.Generator | None]) -> list[Payload]:
        d = X.shape[1]
        norms, scaled_X, scaled_norms = _norms(X)
        norm_bytes = norms.numpy().astype(float_wire_dtype(X.element_size()), copy=False)
        sampler = _LevelSampler(d, scaled_X.numpy().dtype, self.s)
        payloads = []
        for row, generator in enumerate(generators):
            x = scaled_X[row].numpy()
            positions, levels = sampler.nonzero_levels(x, float(scaled_norms[row]), generator)
            negative = x[positions] < 0
            if self._sparse_nbytes(d, positions.size) < self._dense_nbytes(d):
                variant, body = _SPARSE, self._sparse_body(positions, negative, levels, d)
            else:
                variant, body = _DENSE, self._dense_body(positions, negative, levels, d)
            header = write_header(self.codec_id, X.dtype, d, variant)
            payloads.append(Payload(header + norm_bytes[row].tobytes() + body))
        return payloads

    def _decompress_rows(self, variants: list[int], bodies: list[memoryview], d: int,
                         dtype: torch.dtype) -> torch.Tensor:
        wire = float_wire_dtype(torch.empty((), dtype=dtype).element_size())
        rows = np.zeros((len(bodies), d), dtype=wire.newbyteorder("="))  # numpy: no torch thread barriers
        for row, (variant, body) in enumerate(zip(variants, bodies, strict=True)):
            if len(body) < wire.itemsize:
                raise ValueError("corrupt payload: dithering message too short for its norm")
            step = float(np.frombuffer(body, dtype=wire, count=1)[0]) / self.s
            rest = body[wire.itemsize:]
            if variant == _DENSE:
                expect_nbytes(rest, self._dense_nbytes(d), "dense dithering")
                negative, levels = self._read_dense(rest, d)
                rows[row] = _signed_values(negative, levels, step)
            elif variant == _SPARSE:
                positions, negative, levels = self._read_sparse(rest, d)
                rows[row, positions] = _signed_values(negative, levels, step)
            else:
                raise ValueError(f"corrupt payload: unknown dithering variant {variant}")
        return torch.from_numpy(rows)

    # Field widths and body sizes (the choice dense/sparse is made on these, the count on the bytes).
    def _level_width(self) -> int:
        return self.s.bit_length()  # levels 0..s

    def _nonzero_level_width(self) -> int:
        return (self.s - 1).bit_length()  # levels 1..s sent as 0..s-1

    def _dense_nbytes(self, d: int) -> int:
        return field_nbytes(d, 1) + field_nbytes(d, self._level_width())

    def _sparse_nbytes(self, d: int, count: int) -> int:
        return (_COUNT.size + field_nbytes(count, index_width(d)) + field_nbytes(count, 1)
                + field_nbytes(count, self._nonzero_level_width()))

    def _dense_body(self, positions: np.ndarray, negative: np.ndarray, levels: np.ndarray, d: int) -> bytes:
        all_negative = np.zeros((1, d), dtype=bool)
        all_negative[0, positions] = negative
        all_levels = np.zeros((1, d), dtype=np.int64)
        all_levels[0, positions] = levels
        return (pack_bits_rows(all_negative).tobytes()
                + pack_uint_rows(all_levels, self._level_width()).tobytes())

    def _sparse_body(self, positions: np.ndarray, negative: np.ndarray, levels: np.ndarray, d: int) -> bytes:
        return (_COUNT.pack(positions.size)
                + pack_uint_rows(positions[None], index_width(d)).tobytes()
                + pack_bits_rows(negative[None]).tobytes()
                + pack_uint_rows(levels[None] - 1, self._nonzero_level_width()).tobytes())

    def _read_dense(self, body: memoryview, d: int) -> tuple[np.ndarray, np.ndarray]:
        signs_nbytes = field_nbytes(d, 1)
        raw = np.frombuffer(body, dtype=np.uint8)
        negative = unpack_bits_rows(raw[None, :signs_nbytes], d)[0]
        levels = unpack_uint_rows(raw[None, signs_nbytes:], d, self._level_width())[0]
        if levels.size and levels.max() > self.s:
            raise ValueError(f"corrupt payload: a dithering level exceeds s = {self.s}")
        return negative, levels

    def _read_sparse(self, body: memoryview, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if len(body) < _COUNT.size:
            raise ValueError("corrupt payload: sparse dithering message too short for its count")
        (count,) = _COUNT.unpack_from(body)
        expect_nbytes(body, self._sparse_nbytes(d, count), "sparse dithering")
        raw = np.frombuffer(body, dtype=np.uint8)[None, _COUNT.size:]
        positions_end = field_nbytes(count, index_width(d))
        signs_end = positions_end + field_nbytes(count, 1)
        positions = unpack_uint_rows(raw[:, :positions_end], count, index_width(d))[0]
        if positions.size and positions.max() >= d:
            raise ValueError(f"corrupt payload: a position is >= d = {d}")
        negative = unpack_bits_rows(raw[:, positions_end:signs_end], count)[0]
        levels = unpack_uint_rows(raw[:, signs_end:], count, self._nonzero_level_width())[0] + 1
        return positions, negative, levels


def _norms(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """‖x‖ of every row, and rows scaled by powers of two whose norms are safe to compute with.

    A plain norm squares the entries: in float32 it underflows to 0 for a row of entries below about
    1e-23 (the row would be sent as 0, a bias) and overflows above about 1e19. Such rows are multiplied
    by the power of two that brings their largest entry to [1, 2): exact, and the levels depend on
    x/‖x‖ only. The norm sent is the true one; a norm beyond the float type's range is an error.
    Returns (norms, scaled rows, their norms); rows already in the safe range are not copied.
    """
    norms = row_norms(X)
    bound = 2.0**40 if X.dtype == torch.float32 else 2.0**400
    unsafe = (norms < 1 / bound) | (norms > bound)  # zero rows too: cheaper than a max over the batch
    if not bool(unsafe.any()):
        return norms, X, norms
    X, norms = X.clone(), norms.clone()
    scaled_norms = norms.clone()
    for row in unsafe.nonzero().flatten().tolist():
        largest = float(X[row].abs().max())
        if largest == 0.0:
            continue
        exponent = -math.frexp(largest)[1]
        X[row] = torch.ldexp(X[row], torch.tensor(exponent))
        scaled_norms[row] = torch.linalg.vector_norm(X[row])
        norm = math.ldexp(float(scaled_norms[row]), -exponent)
        if norm > torch.finfo(X.dtype).max:
            raise ValueError(f"‖x‖ = {norm:.3g} exceeds the range of {X.dtype}: it cannot be sent as one")
        norms[row] = norm
    return norms, X, scaled_norms


class _LevelSampler:
    """Draws the stochastic levels of rows of one length and float type, reusing one scratch buffer."""

    def __init__(self, d: int, dtype: np.dtype, s: int) -> None:
        self.s = s
        self.dtype = np.dtype(dtype)
        self.precision = 24 if self.dtype == np.float32 else 53  # bits of a uniform of this float type
        self.scratch = np.empty(d + 1, dtype=np.int64)

    def nonzero_levels(self, x: np.ndarray, norm: float, generator: torch.Generator
                       ) -> tuple[np.ndarray, np.ndarray]:
        """Positions (increasing) and levels ζ ∈ {1..s} of the entries of x whose level is not zero.

        ζ = ⌊u + U⌋ is ⌊u⌋ + 1 exactly when U ≥ 1 − (u − ⌊u⌋), which has probability u − ⌊u⌋: the
        stochastic rounding of the papers' definition. (In float32 the sum u + U rounds at ulp(s), a bias
        below 2^-19 in the probability of rounding up, far under the float32 output precision.) Rounding
        can give u = s(1 + ε), hence ζ = s + 1, when one entry carries the whole norm: clamped to s.
        """
        real, p = self.dtype.type, self.precision
        stream = _seeded_stream(generator)
        inverse_step = real(self.s) / real(norm) if norm > 0 else real(0)  # u = |x|·inverse_step
        coarse = stream.random_raw((x.size + 7) // 8).view(np.uint8)[: x.size]
        # ζ can be ≥ 1 only where 256·u + c + 1 > 256; the margin absorbs the rounding of 256·u + c.
        count = scores_at_least(x, inverse_step * real(2**_COARSE_BITS), coarse,
                                2**_COARSE_BITS - 1 - _ROUNDING_MARGIN, self.scratch)
        open_outcome = self.scratch[:count]
        fine = stream.random_raw(count) >> np.uint64(64 - (p - _COARSE_BITS))
        m = (coarse[open_outcome].astype(np.uint64) << np.uint64(p - _COARSE_BITS)) | fine
        one = real(2.0**p)
        shifted = np.abs(x[open_outcome]) * (inverse_step * one) + m.astype(self.dtype)  # (u + U)·2^p
        levels = (shifted / one).astype(np.int64)  # exact division by 2^p, truncation = ⌊·⌋ (all ≥ 0)
        nonzero = levels > 0
        return open_outcome[nonzero], np.minimum(levels[nonzero], self.s)


def _seeded_stream(generator: torch.Generator) -> np.random.SFC64:
    """A numpy SFC64 stream seeded by two 63-bit integers from ``generator`` (its only use of it)."""
    seed = torch.randint(2**63 - 1, (2,), generator=generator).tolist()
    return np.random.SFC64(np.random.SeedSequence(seed))


def _signed_values(negative: np.ndarray, levels: np.ndarray, step: float) -> np.ndarray:
    """±level·(‖x‖/s) in float64, to be rounded once into the message's float type by the caller.

    (In float32, ‖x‖/s itself may be subnormal and lose bits; in float64 it is exact for s = 2^b.)
    """
    return (1 - 2 * negative.astype(np.int64)) * levels * step
