"""FedBAT's sign baselines: post-training compression of the local update on the FedAvg backbone
(:class:`horizontal.layered.PostTraining`; FedAvg and FedPAQ on this backbone are in ``fedavg.py`` and
``fedpaq.py``, beside their flat-vector versions).

Every client runs the same local SGD as FedAvg (:class:`horizontal.layered.LocalTrainer` without a
binarization phase), then compresses its update m_k = w^k_{t+1} − w_t of the binarized tensors (conv and
linear weights); the server adds Σ p'_k·decode(message_k), p'_k ∝ n_k (the paper's Eq. 2-3). The BN tensors go
up in float32 exactly as for FedBAT.

    signsgd        α·sign(m_k), α fixed (0.001, the paper's tuned value); Eq. 3, weighted mean, not a vote
    ef-signsgd     p = m_k + e_k; send C(p) = (‖p_l‖₁/d_l)·sign(p_l) per tensor; e_k ← p − C(p)
                   (Karimireddy et al. 2019; the error of a client persists across rounds, stale between
                   its participations)
    noisy-signsgd  α·sign(m_k + ξ), ξ ~ N(0, σ²), α = σ = 0.01 (Chen et al. 2020)
    stoc-signsgd   α·b, P(b_i = +1) = ½ + m_i/(2‖m_l‖_∞) per tensor, α = 0.01 (Safaryan & Richtárik
                   2021 with the ℓ∞ norm the paper used)

Decisions (the paper is silent): norms and scales are per tensor (mirroring FedBAT's per-layer α);
sign(0) is sent as + (one bit cannot carry 0); the messages are in the injected codec's format
(``protocols.compression.layers.LayerCodec``: bits, plus one float32 per tensor where the scale is not
fixed; float32 for FedAvg), so the uplink is counted from the packed bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from horizontal.layered import PostTraining


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not 0 < value < math.inf:
            raise ValueError(f"{name} must be a positive finite number, got {value}")


@dataclass(eq=False)
class FixedScaleSign(PostTraining):
    """α·sign(·) with α agreed in advance, so the message is the bits alone."""

    alpha: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(alpha=self.alpha)
        self.alpha = float(self.alpha)

    def decode(self, payload: bytes, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        signs, _ = self.codec.decode_signs(payload, shapes, 0)
        return [self.alpha * s for s in signs]

    def describe(self) -> dict[str, object]:
        return {"method": self.name, "alpha": self.alpha}


@dataclass(eq=False)
class SignSGD(FixedScaleSign):
    """α·sign(m), one bit per weight."""

    name = "signsgd"
    alpha: float = 0.001

    def encode(self, update: list[torch.Tensor], shapes: Sequence[torch.Size], client: int,
               generator: torch.Generator) -> bytes:
        return self.codec.encode_signs([u >= 0 for u in update])


@dataclass(eq=False)
class EFSignSGD(PostTraining):
    """Error-feedback scaled sign; ``errors[k]`` is client k's memory (zeros until it first trains)."""

    name = "ef-signsgd"
    errors: dict[int, list[torch.Tensor]] = field(default_factory=dict, init=False, repr=False)

    def encode(self, update: list[torch.Tensor], shapes: Sequence[torch.Size], client: int,
               generator: torch.Generator) -> bytes:
        error = self.errors.get(client, [torch.zeros_like(u) for u in update])
        corrected = [u + e for u, e in zip(update, error, strict=True)]
        scales = [float(p.abs().mean()) for p in corrected]
        payload = self.codec.encode_signs([p >= 0 for p in corrected], scales)
        sent = self.decode(payload, shapes)
        self.errors[client] = [p - s for p, s in zip(corrected, sent, strict=True)]
        return payload

    def decode(self, payload: bytes, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        signs, scales = self.codec.decode_signs(payload, shapes, len(shapes))
        return [a * s for a, s in zip(scales, signs, strict=True)]


@dataclass(eq=False)
class NoisySignSGD(FixedScaleSign):
    """α·sign(m + ξ) with Gaussian noise ξ ~ N(0, σ²) from the client's own stream."""

    name = "noisy-signsgd"
    sigma: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(sigma=self.sigma)
        self.sigma = float(self.sigma)

    def encode(self, update: list[torch.Tensor], shapes: Sequence[torch.Size], client: int,
               generator: torch.Generator) -> bytes:
        noisy = [u + self.sigma * torch.randn(u.shape, generator=generator, dtype=u.dtype) for u in update]
        return self.codec.encode_signs([n >= 0 for n in noisy])

    def describe(self) -> dict[str, object]:
        return super().describe() | {"sigma": self.sigma}


@dataclass(eq=False)
class StocSignSGD(FixedScaleSign):
    """α·b with P(b_i = +1) = ½ + m_i/(2‖m_l‖_∞) per tensor (½ for an all-zero tensor)."""

    name = "stoc-signsgd"

    def encode(self, update: list[torch.Tensor], shapes: Sequence[torch.Size], client: int,
               generator: torch.Generator) -> bytes:
        bits = []
        for u in update:
            top = u.abs().max()
            ratio = u / top if top > 0 else torch.zeros_like(u)
            bits.append(torch.rand(u.shape, generator=generator, dtype=u.dtype) < (1 + ratio) / 2)
        return self.codec.encode_signs(bits)

    def describe(self) -> dict[str, object]:
        return super().describe() | {"norm": "per-tensor l_inf"}
