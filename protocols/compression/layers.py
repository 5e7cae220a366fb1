"""Headerless messages of a layered model update: FedBAT's 1-bit uplink and its baselines' (SignSGD family,
full-precision FedAvg on the same CNN).

Both ends know the model's layer shapes, so no header is sent; a message whose length does not match the
shapes is rejected (it was written for another model or codec).

- Signs: the layers' step sizes as float32 little-endian (none where the scale is agreed in advance, as
  SignSGD's fixed α), then every layer's bits concatenated in layer order (1 ↔ +), least significant bit
  first and padded once to a whole byte: 32·L + 8·⌈Σ_l d_l / 8⌉ bits, e.g. 390,080 bits for the FedBAT
  paper's FMNIST CNN.
- Floats: every layer's entries as float32 little-endian, in layer order: 32·Σ_l d_l bits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_FLOAT = np.dtype("<f4")


@dataclass(frozen=True)
class LayerCodec:
    """Encoder and decoder of the two formats above (stateless: one object serves every client)."""

    def encode_signs(self, bits: Sequence[torch.Tensor], scales: Sequence[float] = ()) -> bytes:
        """One client's signs (``True`` ↔ +) and optional per-layer float32 scales, as bytes."""
        flat = np.concatenate([b.detach().reshape(-1).cpu().numpy().astype(bool) for b in bits])
        return np.asarray(scales, dtype=_FLOAT).tobytes() + np.packbits(flat, bitorder="little").tobytes()

    def decode_signs(self, data: bytes, shapes: Sequence[torch.Size], n_scales: int
                     ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Inverse of :meth:`encode_signs`: per-layer ±1 tensors (float32) and the float32 scales."""
        sizes = _sizes(shapes)
        head = n_scales * _FLOAT.itemsize
        _expect(data, head + (sum(sizes) + 7) // 8, f"signs of layers {[tuple(s) for s in shapes]} with "
                f"{n_scales} scales")
        scales = torch.from_numpy(np.frombuffer(data, dtype=_FLOAT, count=n_scales).astype(np.float32))
        bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8, offset=head), count=sum(sizes),
                             bitorder="little")
        signs = torch.from_numpy(bits.astype(np.float32) * 2 - 1)
        return _layers(signs, shapes), scales

    def encode_floats(self, update: Sequence[torch.Tensor]) -> bytes:
        """Every layer's entries as float32, in layer order."""
        return np.concatenate([u.detach().reshape(-1).cpu().numpy().astype(_FLOAT) for u in update]).tobytes()

    def decode_floats(self, data: bytes, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        """Inverse of :meth:`encode_floats` (float32 tensors of the given shapes)."""
        _expect(data, sum(_sizes(shapes)) * _FLOAT.itemsize, f"float32 layers {[tuple(s) for s in shapes]}")
        return _layers(torch.from_numpy(np.frombuffer(data, dtype=_FLOAT).astype(np.float32)), shapes)


def _sizes(shapes: Sequence[torch.Size]) -> list[int]:
    return [math.prod(s) for s in shapes]


def _layers(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    return [part.reshape(shape) for part, shape in zip(flat.split(_sizes(shapes)), shapes, strict=True)]


def _expect(data: bytes, nbytes: int, what: str) -> None:
    if len(data) != nbytes:
        raise ValueError(f"layered update of {len(data)} bytes; {what} need {nbytes} bytes")
