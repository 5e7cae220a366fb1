"""``ScaledUnbiased(C, ω)``: x ↦ C(x)/(1+ω), turning an ω-unbiased compressor into a contractive one.

If E[C(x)] = x and E‖C(x) − x‖² ≤ ω‖x‖², then C(x)/(1+ω) satisfies
E‖C(x)/(1+ω) − x‖² ≤ (ω/(1+ω))·‖x‖², so q² = ω/(1+ω) (Safaryan et al. 2022, Lemma 1, cited by the SCAFCOM
paper). SCAFCOM runs unbiased compressors through this (its Corollary 1); its theory does not cover raw
unbiased dithering.

The message is the inner compressor's, unchanged: the receiver knows the wrapper and applies the
1/(1+ω) on decoding, so the wrapper costs no bits. ω is the inner compressor's ``omega(d)`` unless a
constant is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocols.compression.base import Compressor, Payload, is_real


@dataclass(frozen=True)
class ScaledUnbiased(Compressor):
    """C(x)/(1+ω) for an unbiased compressor C (biased, contractive with q² = ω/(1+ω))."""

    inner: Compressor
    omega_value: float | None = None

    unbiased = False
    contractive = True

    def __post_init__(self) -> None:
        if not isinstance(self.inner, Compressor) or not self.inner.unbiased:
            raise ValueError(f"scaled-unbiased wraps an unbiased Compressor, got {self.inner!r}")
        if self.omega_value is not None and (not is_real(self.omega_value) or not self.omega_value >= 0):
            raise ValueError(f"scaled-unbiased needs omega >= 0, got {self.omega_value!r}")

    @property
    def codec_id(self) -> int:  # type: ignore[override]
        return self.inner.codec_id

    @property
    def randomized(self) -> bool:  # type: ignore[override]
        return self.inner.randomized

    def q2(self, d: int) -> float:
        omega = self._omega(d)
        return omega / (1.0 + omega)

    def _omega(self, d: int) -> float:
        return self.inner.omega(d) if self.omega_value is None else float(self.omega_value)

    def _compress_rows(self, X: torch.Tensor, generators: list[torch.Generator | None]) -> list[Payload]:
        return self.inner._compress_rows(X, generators)

    def _decompress_rows(self, variants: list[int], bodies: list[memoryview], d: int,
                         dtype: torch.dtype) -> torch.Tensor:
        return self.inner._decompress_rows(variants, bodies, d, dtype).div_(1.0 + self._omega(d))
