"""FedPAQ (Reisizadeh et al. 2020): periodic averaging with a quantized uplink (cited by the
SCAFCOM and ISCA papers; run at 3 and 4 bits in the FedBAT paper's Table 5).

Each round the server samples S of the N clients uniformly; each runs K plain local SGD steps from x^t
(periodic averaging: τ = K in the paper's notation) and sends Q(y_i^{t,K} − x^t), an unbiased quantization
of its model move. Server: x ← x + (η_g/S)·Σ Q(y_i − x); the paper's rule is η_g = 1. Clients are stateless:
no error memory, no control variates, so under heterogeneity it inherits FedAvg's client drift (the
ISCA paper's Table 2 marks it as not supporting heterogeneity). With the identity codec it is FedAvg.

Decisions:
- The quantizer is injected. The paper's is QSGD with s levels, ``get_compressor("dithering", levels=s)``;
  for "b bits per parameter" use s = 2^(b−1) − 1 (one sign bit and b − 1 level bits: s = 3 at 3 bits,
  s = 7 at 4 bits; the FedBAT paper does not say how its bits map to levels), or ``bits=b`` for the
  SCALLION/ISCA papers' s = 2^b. The norm is that of the whole flattened update, not per layer (the
  codec's convention; the paper's analysis is over R^d).
- :class:`LayeredFedPAQ` is the same rule on the layered backbone (FedBAT's CNN; the FedBAT paper's
  Table 5 runs it at 3 and 4 bits).
- An unbiased quantizer is required (the paper's Assumption: E[Q(x)] = x with bounded variance); a biased
  compressor is a ValueError, since without error feedback its bias is never corrected (use Fed-EF).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from horizontal.base import (
    Algorithm,
    Compressor,
    Downlink,
    FLConfig,
    InitContext,
    NoClientState,
    RoundContext,
    ServerModel,
    Uplink,
    WithCompressor,
    compressor_label,
)
from horizontal.layered import PostTraining


@dataclass(eq=False)
class FedPAQ(WithCompressor, Algorithm[ServerModel, NoClientState]):
    name = "fedpaq"

    compressor: Compressor

    def __post_init__(self) -> None:
        self._check_compressor()
        if not self.compressor.unbiased:
            raise ValueError(f"FedPAQ needs an unbiased quantizer (e.g. dithering), got "
                             f"{compressor_label(self.compressor)}; for a biased compressor use fed-ef")

    def init(self, ctx: InitContext) -> tuple[ServerModel, NoClientState]:
        return ServerModel(ctx.x0), NoClientState()

    def client_update(self, down: Downlink, clients: NoClientState, ctx: RoundContext
                      ) -> tuple[Uplink, NoClientState]:
        x = down["x"]
        return {"model_delta": ctx.compress(self.compressor, ctx.solver.run(x).y - x)}, clients

    def server_update(self, server: ServerModel, up: Uplink, config: FLConfig
                      ) -> tuple[ServerModel, Downlink]:
        return ServerModel(server.x + config.lr_global * up["model_delta"].values.mean(dim=0)), {}


@dataclass(eq=False)
class LayeredFedPAQ(PostTraining):
    """FedPAQ on the layered backbone (FedBAT's CNN, ``--model cnn``): the quantizer, validated by
    :class:`FedPAQ`, on the flattened update of the binarized tensors; the message is its payload."""

    name = "fedpaq"
    compressor: Compressor | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.compressor is None:
            raise ValueError("fedpaq needs a compressor (an unbiased quantizer, e.g. dithering:levels=7)")
        self.fedpaq = FedPAQ(self.compressor)
        if not callable(getattr(self.compressor, "decompress_bytes", None)):
            raise TypeError("fedpaq: the compressor must decode raw message bytes (decompress_bytes), as "
                            "protocols.compression's do")

    def encode(self, update: list[torch.Tensor], shapes: Sequence[torch.Size], client: int,
               generator: torch.Generator) -> bytes:
        flat = torch.cat([u.reshape(-1) for u in update]).unsqueeze(0)
        return self.fedpaq.compressor.compress_batch(flat, [generator])[0].data

    def decode(self, payload: bytes, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        flat = self.fedpaq.compressor.decompress_bytes(payload)  # type: ignore[attr-defined]
        sizes = [math.prod(s) for s in shapes]
        if flat.shape != (sum(sizes),):
            raise ValueError(f"fedpaq message decodes to {tuple(flat.shape)} entries; the layers have "
                             f"{sum(sizes)}")
        return [p.reshape(s) for p, s in zip(flat.split(sizes), shapes, strict=True)]

    def describe(self) -> dict[str, object]:
        return {"method": self.name} | {k: v for k, v in self.fedpaq.describe().items() if k != "algorithm"}
