"""FedBAT's baselines: post-training compression of the local update on the FedAvg backbone.

Every client runs the same local SGD as FedAvg (:class:`vfl.hfl.fedbat.LocalTrainer` without a
binarization phase), then compresses its update m_k = w^k_{t+1} − w_t of the binarized tensors (conv and
linear weights); the server adds Σ p'_k·decode(message_k), p'_k ∝ n_k (the paper's Eq. 2-3). The BN tensors go
up in float32 exactly as for FedBAT.

    fedavg         m_k in float32 (32 bits per weight)
    signsgd        α·sign(m_k), α fixed (0.001, the paper's tuned value); Eq. 3, weighted mean, not a vote
    ef-signsgd     p = m_k + e_k; send C(p) = (‖p_l‖₁/d_l)·sign(p_l) per tensor; e_k ← p − C(p)
                   (Karimireddy et al. 2019; the error of a client persists across rounds, stale between
                   its participations)
    noisy-signsgd  α·sign(m_k + ξ), ξ ~ N(0, σ²), α = σ = 0.01 (Chen et al. 2020)
    stoc-signsgd   α·b, P(b_i = +1) = ½ + m_i/(2‖m_l‖_∞) per tensor, α = 0.01 (Safaryan & Richtárik
                   2021 with the ℓ∞ norm the paper used)
    fedpaq         an injected unbiased quantizer (:class:`vfl.hfl.fedpaq.FedPAQ`'s) on the flattened update

Decisions (the paper is silent): norms and scales are per tensor (mirroring FedBAT's per-layer α);
sign(0) is sent as + (one bit cannot carry 0); the messages are in the injected codec's format
(``protocols.compression.layers.LayerCodec``: bits, plus one float32 per tensor where the scale is not
fixed; float32 for FedAvg), so the uplink is counted from the packed bytes.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence

import torch

from vfl.hfl.fedbat import LayerCodec, LocalTrainer, Method, State, Upload, check_codec
from vfl.hfl.fedpaq import FedPAQ


class PostTraining(Method):
    """Local SGD as in FedAvg, then :meth:`compress` the update of the binarized tensors into the
    injected codec's format."""

    def __init__(self, codec: LayerCodec) -> None:
        self.codec = check_codec(codec, self.name)

    def client(self, trainer: LocalTrainer, global_state: State, client: int, data_stream: torch.Generator,
               client_stream: torch.Generator) -> Upload:
        local = trainer.train(global_state, client, data_stream)
        update, bits = self.compress(local.update, trainer.shapes, client, client_stream)
        return Upload(update, bits, local.extras, int(trainer.data.sizes[client]), local.mean_loss)

    @abstractmethod
    def compress(self, update: list[torch.Tensor], shapes: Sequence[torch.Size], client: int,
                 generator: torch.Generator) -> tuple[list[torch.Tensor], int]:
        """The update as the server decodes it from the packed message, and the message's bits."""


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not 0 < value < math.inf:
            raise ValueError(f"{name} must be a positive finite number, got {value}")


def _signed(codec: LayerCodec, bits: list[torch.Tensor], shapes: Sequence[torch.Size],
            scales: Sequence[float] | None, fixed_alpha: float = 1.0) -> tuple[list[torch.Tensor], int]:
    """Pack, unpack, rescale: the decoded update and the message size."""
    payload = codec.encode_signs(bits, scales or ())
    signs, sent = codec.decode_signs(payload, shapes, len(scales or ()))
    if scales:
        return [a * s for a, s in zip(sent, signs, strict=True)], 8 * len(payload)
    return [fixed_alpha * s for s in signs], 8 * len(payload)


class FullPrecisionUpdate(PostTraining):
    """FedAvg: the update in float32, 32 bits per weight."""

    name = "fedavg"

    def compress(self, update: list[torch.Tensor], shapes: Sequence[torch.Size], client: int,
                 generator: torch.Generator) -> tuple[list[torch.Tensor], int]:
        payload = self.codec.encode_floats(update)
        return self.codec.decode_floats(payload, shapes), 8 * len(payload)


class SignSGD(PostTraining):
    """α·sign(m), one bit per weight; α is agreed in advance, so no float is sent."""

    name = "signsgd"

    def __init__(self, codec: LayerCodec, alpha: float = 0.001) -> None:
        super().__init__(codec)
        _check_positive(alpha=alpha)
        self.alpha = float(alpha)

    def compress(self, update: list[torch.Tensor], shapes: Sequence[torch.Size], client: int,
                 generator: torch.Generator) -> tuple[list[torch.Tensor], int]:
        return _signed(self.codec, [u >= 0 for u in update], shapes, None, self.alpha)

    def describe(self) -> dict[str, object]:
        return {"method": self.name, "alpha": self.alpha}


class EFSignSGD(PostTraining):
    """Error-feedback scaled sign; ``errors[k]`` is client k's memory (zeros until it first trains)."""

    name = "ef-signsgd"

    def __init__(self, codec: LayerCodec) -> None:
        super().__init__(codec)
        self.errors: dict[int, list[torch.Tensor]] = {}

    def compress(self, update: list[torch.Tensor], shapes: Sequence[torch.Size], client: int,
                 generator: torch.Generator) -> tuple[list[torch.Tensor], int]:
        error = self.errors.get(client, [torch.zeros_like(u) for u in update])
        corrected = [u + e for u, e in zip(update, error, strict=True)]
        scales = [float(p.abs().mean()) for p in corrected]
        sent, bits = _signed(self.codec, [p >= 0 for p in corrected], shapes, scales)
        self.errors[client] = [p - s for p, s in zip(corrected, sent, strict=True)]
        return sent, bits


class NoisySignSGD(PostTraining):
    """α·sign(m + ξ) with Gaussian noise ξ ~ N(0, σ²) from the client's own stream."""

    name = "noisy-signsgd"

    def __init__(self, codec: LayerCodec, alpha: float = 0.01, sigma: float = 0.01) -> None:
        super().__init__(codec)
        _check_positive(alpha=alpha, sigma=sigma)
        self.alpha, self.sigma = float(alpha), float(sigma)

    def compress(self, update: list[torch.Tensor], shapes: Sequence[torch.Size], client: int,
                 generator: torch.Generator) -> tuple[list[torch.Tensor], int]:
        noisy = [u + self.sigma * torch.randn(u.shape, generator=generator, dtype=u.dtype) for u in update]
        return _signed(self.codec, [n >= 0 for n in noisy], shapes, None, self.alpha)

    def describe(self) -> dict[str, object]:
        return {"method": self.name, "alpha": self.alpha, "sigma": self.sigma}


class StocSignSGD(PostTraining):
    """α·b with P(b_i = +1) = ½ + m_i/(2‖m_l‖_∞) per tensor (½ for an all-zero tensor)."""

    name = "stoc-signsgd"

    def __init__(self, codec: LayerCodec, alpha: float = 0.01) -> None:
        super().__init__(codec)
        _check_positive(alpha=alpha)
        self.alpha = float(alpha)

    def compress(self, update: list[torch.Tensor], shapes: Sequence[torch.Size], client: int,
                 generator: torch.Generator) -> tuple[list[torch.Tensor], int]:
        bits = []
        for u in update:
            top = u.abs().max()
            ratio = u / top if top > 0 else torch.zeros_like(u)
            bits.append(torch.rand(u.shape, generator=generator, dtype=u.dtype) < (1 + ratio) / 2)
        return _signed(self.codec, bits, shapes, None, self.alpha)

    def describe(self) -> dict[str, object]:
        return {"method": self.name, "alpha": self.alpha, "norm": "per-tensor l_inf"}


class FedPAQUpdate(PostTraining):
    """FedPAQ on this backbone: :class:`~vfl.hfl.fedpaq.FedPAQ`'s unbiased quantizer (e.g. QSGD dithering
    from ``protocols.compression``) on the flattened update; bits from its packed payload."""

    name = "fedpaq"

    def __init__(self, codec: LayerCodec, fedpaq: FedPAQ) -> None:
        super().__init__(codec)
        if not isinstance(fedpaq, FedPAQ):
            raise TypeError(f"expected a vfl.hfl.fedpaq.FedPAQ (it validates the quantizer), got "
                            f"{type(fedpaq).__name__}")
        self.fedpaq = fedpaq

    def compress(self, update: list[torch.Tensor], shapes: Sequence[torch.Size], client: int,
                 generator: torch.Generator) -> tuple[list[torch.Tensor], int]:
        flat = torch.cat([u.reshape(-1) for u in update]).unsqueeze(0)
        decoded, bits = self.fedpaq.compressor.roundtrip_batch(flat, [generator])
        sizes = [math.prod(s) for s in shapes]
        return [p.reshape(s) for p, s in zip(decoded[0].split(sizes), shapes, strict=True)], int(bits[0])

    def describe(self) -> dict[str, object]:
        return {"method": self.name} | {k: v for k, v in self.fedpaq.describe().items() if k != "algorithm"}

