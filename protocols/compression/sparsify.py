"""Sparsifiers: Top-r (biased, contractive) and Rand-k (scaled, unbiased): the SCAFCOM paper's Examples 3
and 1.

Wire format (both): header, then the k kept positions in increasing order, each packed at
ceil(log2 d) bits (18 bits for d = 235,146), padded to a byte, then the k values in the input's float
type. k is not sent: the receiver derives it from d and its own configuration (r or k). For Top-0.01
at d = 235,146 that is 48 + 2351·(18 + 32) bits ≈ 14.7 kB instead of 940.6 kB.

Decisions:
- Top-r keeps k = max(1, ⌊r·d⌋) entries of the whole flattened vector (the paper defines it over R^d
  and never mentions per-layer top-k), where r·d is evaluated exactly on the decimal value of r (so
  r = 0.29, d = 100 keeps 29, not 28). Ties at the threshold go to the lowest index, so the kept set is a
  deterministic function of x. The kept values are sent unscaled. q²(d) = 1 − k/d, which is 1 − r when
  r·d is an integer.
- Top-r is computed exactly but fast: a strided sample of |x| gives a threshold below the k-th largest
  magnitude with high probability; only the entries above it (picked by a numba loop, see ``kernels``)
  go through an exact partial sort. If the sample was unlucky (fewer than k candidates) the row falls
  back to an exact partial sort of all of it.
- Rand-k draws a uniformly random k-subset: for k ≤ d/2 by drawing uniform indices and keeping the
  first k distinct ones (cheap for k ≪ d), else from a random permutation. The raw values are sent and
  the receiver multiplies by d/k, so ω = d/k − 1. (Sending a seed instead of the positions would be
  smaller; positions are sent so the message is self-contained.)
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from protocols.compression.base import Compressor, Payload, expect_nbytes, is_integer, is_real, write_header
from protocols.compression.kernels import keep_largest, magnitudes_at_least
from protocols.compression.packing import (
    field_nbytes,
    float_wire_dtype,
    index_width,
    pack_uint_rows,
    unpack_uint_rows,
)

_THRESHOLD_SAMPLE = 4096  # about this many magnitudes per row estimate the Top-r threshold


class _IndexedValues(Compressor):
    """Shared wire format of the sparsifiers: k packed positions + k values, scaled on decoding."""

    @abstractmethod
    def num_kept(self, d: int) -> int:
        """How many entries of a d-vector a message carries."""

    @abstractmethod
    def _select(self, X: torch.Tensor, k: int, generators: list[torch.Generator | None]) -> torch.Tensor:
        """The kept positions of every row, ``int64 [S, k]``, increasing along each row."""

    def _decode_scale(self, d: int) -> float:
        return 1.0

    def _compress_rows(self, X: torch.Tensor, generators: list[torch.Generator | None]) -> list[Payload]:
        S, d = X.shape
        positions = self._select(X, self.num_kept(d), generators)
        packed_positions = pack_uint_rows(positions.numpy(), index_width(d))
        values = np.take_along_axis(X.numpy(), positions.numpy(), axis=1)  # numpy: no torch thread barriers
        values = values.astype(float_wire_dtype(X.element_size()), copy=False)
        header = write_header(self.codec_id, X.dtype, d)
        return [Payload(header + packed_positions[s].tobytes() + values[s].tobytes()) for s in range(S)]

    def _decompress_rows(self, variants: list[int], bodies: list[memoryview], d: int,
                         dtype: torch.dtype) -> torch.Tensor:
        k, width = self.num_kept(d), index_width(d)
        wire = float_wire_dtype(torch.empty((), dtype=dtype).element_size())
        positions_nbytes = field_nbytes(k, width)
        for body in bodies:
            expect_nbytes(body, positions_nbytes + k * wire.itemsize, repr(self))
        raw = np.frombuffer(b"".join(bodies), dtype=np.uint8).reshape(len(bodies), -1)
        positions = unpack_uint_rows(raw[:, :positions_nbytes], k, width)
        if positions.size and positions.max() >= d:
            raise ValueError(f"corrupt payload: a position is >= d = {d}")
        values = np.ascontiguousarray(raw[:, positions_nbytes:]).view(wire).astype(wire.newbyteorder("="))
        scale = self._decode_scale(d)
        if scale != 1.0:
            values *= scale
        out = np.zeros((len(bodies), d), dtype=values.dtype)  # numpy: ~2x faster than torch's scatter_
        flat_positions = positions + np.arange(len(bodies))[:, None] * d
        out.reshape(-1)[flat_positions.ravel()] = values.ravel()
        return torch.from_numpy(out)


@dataclass(frozen=True)
class TopR(_IndexedValues):
    """Top-r: keep the ⌊r·d⌋ largest-magnitude entries, zero the rest (biased, q² = 1 − k/d)."""

    r: float

    codec_id = 2
    unbiased = False
    contractive = True
    randomized = False

    def __post_init__(self) -> None:
        if not is_real(self.r) or not 0.0 < self.r <= 1.0:
            raise ValueError(f"top-r needs r in (0, 1], got {self.r!r}")

    def num_kept(self, d: int) -> int:
        return max(1, math.floor(Fraction(str(float(self.r))) * d))

    def q2(self, d: int) -> float:
        return 1.0 - self.num_kept(d) / d

    def _select(self, X: torch.Tensor, k: int, generators: list[torch.Generator | None]) -> torch.Tensor:
        rows = X.numpy()
        kept = np.empty((rows.shape[0], k), dtype=np.int64)
        candidates = np.empty(rows.shape[1] + 1, dtype=np.int64)  # scratch, reused row after row
        for row, x in enumerate(rows):
            kept[row] = _top_k_lowest_index_ties(x, k, candidates)
        return torch.from_numpy(kept)


@dataclass(frozen=True)
class RandK(_IndexedValues):
    """Rand-k: keep k uniformly random entries scaled by d/k (unbiased, ω = d/k − 1).

    Give either ``k`` (entries per message) or ``fraction`` (k = max(1, ⌊fraction·d⌋)).
    """

    k: int | None = None
    fraction: float | None = None

    codec_id = 3
    unbiased = True
    contractive = False
    randomized = True

    def __post_init__(self) -> None:
        if (self.k is None) == (self.fraction is None):
            raise ValueError("rand-k needs exactly one of k= (entries kept) or fraction= (share kept)")
        if self.k is not None and (not is_integer(self.k) or self.k < 1):
            raise ValueError(f"rand-k needs an integer k >= 1, got {self.k!r}")
        if self.fraction is not None and (not is_real(self.fraction)
                                          or not 0.0 < self.fraction <= 1.0):
            raise ValueError(f"rand-k needs fraction in (0, 1], got {self.fraction!r}")

    def num_kept(self, d: int) -> int:
        if self.k is not None:
            if self.k > d:
                raise ValueError(f"rand-k cannot keep k = {self.k} entries of a {d}-vector")
            return self.k
        return max(1, math.floor(Fraction(str(float(self.fraction))) * d))

    def omega(self, d: int) -> float:
        return d / self.num_kept(d) - 1.0

    def _decode_scale(self, d: int) -> float:
        return d / self.num_kept(d)

    def _select(self, X: torch.Tensor, k: int, generators: list[torch.Generator | None]) -> torch.Tensor:
        d = X.shape[1]
        return torch.stack([_uniform_subset(d, k, g) for g in generators])


def _top_k_lowest_index_ties(x: np.ndarray, k: int, scratch: np.ndarray) -> np.ndarray:
    """The increasing positions of the k largest |x_i|, ties at the k-th magnitude to the lowest index.

    The threshold is the c-th largest magnitude of a strided sample, with c about twice the share k/d
    of the sample, so typically about 2k entries pass it; when fewer than k pass (an unlucky sample),
    all d entries are the candidates. The k-th largest candidate magnitude is then found by a partial
    sort. ``scratch`` holds ``d + 1`` positions.
    """
    d = x.size
    count = 0
    if 8 * k <= d:
        sample = np.abs(x[:: max(1, d // _THRESHOLD_SAMPLE)])
        in_sample = min(sample.size, 2 * math.ceil(k * sample.size / d) + 8)
        threshold = np.partition(sample, sample.size - in_sample)[sample.size - in_sample]
        count = magnitudes_at_least(x, threshold, scratch)
    if count >= k:
        positions = scratch[:count]
        magnitudes = np.abs(x[positions])
    else:
        positions, magnitudes = np.arange(d), np.abs(x)
    kth = np.partition(magnitudes, magnitudes.size - k)[magnitudes.size - k]
    return keep_largest(positions, magnitudes, kth, k)


def _uniform_subset(d: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """A uniformly random k-subset of range(d), increasing, drawn from ``generator`` only."""
    if 2 * k > d:
        return torch.randperm(d, generator=generator)[:k].sort().values
    draws = np.empty(0, dtype=np.int64)
    distinct = 0
    while distinct < k:  # the first k distinct values of an i.i.d. uniform sequence form a uniform subset
        more = torch.randint(d, (k - distinct + k // 16 + 16,), generator=generator).numpy()
        draws = np.concatenate([draws, more])
        values, first_seen = np.unique(draws, return_index=True)
        distinct = values.size
    chosen = values[np.argsort(first_seen, kind="stable")[:k]]
    return torch.from_numpy(np.sort(chosen))
