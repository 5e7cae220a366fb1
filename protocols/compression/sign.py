"""Sign compressors: plain sign (SignSGD), scaled sign and grouped sign (the SCAFCOM paper's Example 4).

    sign:          C(x) = sign(x)                                      (biased, not contractive)
    grouped sign:  C(x)_k = sign(x_k) · ‖x_{I_m}‖₁ / |I_m|  for k ∈ I_m   (q² = 1 − 1/max_m |I_m|)
    scaled sign:   grouped sign with one group, (‖x‖₁/d)·sign(x)        (q² = 1 − 1/d)

Grouped sign with the layers as groups is EF-SignSGD's per-tensor scale (the FedBAT paper sets its step
size to ‖m‖₁/d).

Decision (the papers do not say): one bit per entry cannot carry sign(0) = 0, so a zero entry is sent
as +; its reconstruction is +scale. The contraction identity is unchanged, because sign(x_k)·x_k = |x_k| for
either choice at x_k = 0:  ‖C(x) − x‖² = ‖x‖² − Σ_m ‖x_{I_m}‖₁² / |I_m|. A zero vector gives scale 0,
so the scaled codecs return 0; plain sign returns all +1.

Wire format: header, the per-group scales in the input's float type (none for plain sign), then d sign
bits (1 = negative), least significant bit first, padded to a byte: d + 32·M bits plus the header
for float32 input.
"""

from __future__ import annotations

from collections.abc import Sequence
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
from protocols.compression.packing import field_nbytes, float_wire_dtype, pack_bits_rows, unpack_bits_rows


@dataclass(frozen=True)
class Sign(Compressor):
    """C(x) = sign(x) ∈ {−1, +1}^d, one bit per entry. Neither unbiased nor contractive."""

    codec_id = 5
    unbiased = False
    contractive = False
    randomized = False

    def _compress_rows(self, X: torch.Tensor, generators: list[torch.Generator | None]) -> list[Payload]:
        header = write_header(self.codec_id, X.dtype, X.shape[1])
        bits = pack_bits_rows((X < 0).numpy())
        return [Payload(header + row.tobytes()) for row in bits]

    def _decompress_rows(self, variants: list[int], bodies: list[memoryview], d: int,
                         dtype: torch.dtype) -> torch.Tensor:
        for body in bodies:
            expect_nbytes(body, field_nbytes(d, 1), "sign")
        return _unit_signs(_stack(bodies), d, dtype)


@dataclass(frozen=True)
class GroupedSign(Compressor):
    """Per-group scaled sign; ``groups`` are the group sizes in order (None: one group, scaled sign)."""

    groups: tuple[int, ...] | None = None

    codec_id = 6
    unbiased = False
    contractive = True
    randomized = False

    def __post_init__(self) -> None:
        if self.groups is None:
            return
        if isinstance(self.groups, str | bytes) or not isinstance(self.groups, Sequence):
            raise ValueError(f"grouped sign needs groups as a sequence of sizes, got {self.groups!r}")
        if not self.groups or not all(is_integer(n) and n >= 1 for n in self.groups):
            raise ValueError(f"grouped sign needs a non-empty list of positive sizes, got {self.groups!r}")
        object.__setattr__(self, "groups", tuple(int(n) for n in self.groups))

    def q2(self, d: int) -> float:
        return 1.0 - 1.0 / max(self._sizes(d))

    def _sizes(self, d: int) -> tuple[int, ...]:
        if self.groups is None:
            return (d,)
        if sum(self.groups) != d:
            raise ValueError(f"grouped sign groups cover {sum(self.groups)} entries, the vector has {d}")
        return self.groups

    def _compress_rows(self, X: torch.Tensor, generators: list[torch.Generator | None]) -> list[Payload]:
        d = X.shape[1]
        sizes = self._sizes(d)
        scales = torch.stack([row_norms(block, ord=1) / block.shape[1]
                              for block in torch.split(X, sizes, dim=1)], dim=1)
        scale_bytes = scales.numpy().astype(float_wire_dtype(X.element_size()), copy=False)
        bits = pack_bits_rows((X < 0).numpy())
        header = write_header(self.codec_id, X.dtype, d)
        return [Payload(header + scale_bytes[row].tobytes() + bits[row].tobytes()) for row in range(len(X))]

    def _decompress_rows(self, variants: list[int], bodies: list[memoryview], d: int,
                         dtype: torch.dtype) -> torch.Tensor:
        sizes = self._sizes(d)
        wire = float_wire_dtype(torch.empty((), dtype=dtype).element_size())
        scales_nbytes = len(sizes) * wire.itemsize
        for body in bodies:
            expect_nbytes(body, scales_nbytes + field_nbytes(d, 1), repr(self))
        raw = _stack(bodies)
        scales = torch.from_numpy(np.ascontiguousarray(raw[:, :scales_nbytes]).view(wire)
                                  .astype(wire.newbyteorder("="))).to(dtype)
        signs = _unit_signs(raw[:, scales_nbytes:], d, dtype)
        if len(sizes) == 1:
            return signs.mul_(scales)
        return signs.mul_(torch.repeat_interleave(scales, torch.tensor(sizes), dim=1))


def _stack(bodies: list[memoryview]) -> np.ndarray:
    """Bodies of equal length as one ``uint8 [S, n]`` array."""
    return np.frombuffer(b"".join(bodies), dtype=np.uint8).reshape(len(bodies), -1)


def _unit_signs(packed: np.ndarray, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Sign bits (1 = negative) → ±1 of the given float type, ``[S, d]``."""
    negative = torch.from_numpy(unpack_bits_rows(np.ascontiguousarray(packed), d))
    return negative.to(dtype).mul_(-2.0).add_(1.0)
