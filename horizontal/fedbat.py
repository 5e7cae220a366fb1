"""FedBAT (Li et al., ICML 2024, Algorithm 1): binarization-aware local training on the layered backbone
(:mod:`horizontal.layered`, which holds the local SGD, the Eq. 11 server and the round loop it shares with its
post-training baselines).

FedBAT client k in round t keeps the global model w_t frozen and trains an explicit update m (zeros at
round start) with plain SGD over τ_k = E·⌈n_k/B⌉ minibatch steps:

- steps s < ⌊φτ_k⌋ (warm-up, Eq. 12): forward with w_t + m, i.e. exactly FedAvg's local SGD;
- at s = ⌊φτ_k⌋: per layer α'_l = mean|m_l| (Eq. 13), α_e,l = 0;
- steps s ≥ ⌊φτ_k⌋ (binarization-aware, Eq. 14): forward with w_t + S(m, α'·exp(ρα_e)), fresh noise
  each step, SGD on m, α_e and the BatchNorm parameters through the designed derivatives
  (:mod:`horizontal.binarize`).

Uplink: 1 bit per binarized weight plus one float32 α per layer (real packed bytes, in the injected
codec's format), and the BN tensors in float32. Server (Eq. 11): w_{t+1} = w_t + Σ_k p'_k α_k m̄_k with
p'_k = n_k / Σ_{j∈S_t} n_j, no server learning rate; the BN tensors are averaged with the same weights.

The baselines (:mod:`horizontal.signsgd`) run the same local SGD (FedBAT with no binarization phase) and
compress the finished update instead; :class:`horizontal.layered.FederatedCNN` runs any of them.

Decisions where the paper is silent (several follow the authors' released code), all logged by
``describe()`` (those shared by every method on the backbone are in :mod:`horizontal.layered`):
- Upload: a *fresh* binarization of the final (m, α) (the authors' code), or ``upload="last_forward"``:
  the bits of the last training forward pass (Algorithm 1, line 23 read literally).
- α' = max(mean|m|, ε) with ε = 1e-8 (an all-zero layer would otherwise divide by zero); the number of
  guarded layers is reported. No clamp on α by default; ``alpha_clamp=(5e-4, 5e-2)`` reproduces the
  authors' code.
- Binarization noise comes from each client's own stream, so it is independent of which other clients
  are sampled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from horizontal.binarize import binarize, step_size
from horizontal.layered import BinarizationPhase, LayerCodec, LocalTrainer, Method, State, Upload, check_codec


class _StepSizes(BinarizationPhase):
    """One client's per-layer α = α'·exp(ρα_e) during one round (all state is fresh each round:
    FedBAT clients carry nothing across rounds)."""

    def __init__(self, method: FedBAT, generator: torch.Generator) -> None:
        self.method = method
        self.generator = generator
        self.alpha_prime: list[torch.Tensor] = []
        self.alpha_e: list[torch.Tensor] = []
        self.guarded = 0
        self.last_bits: list[torch.Tensor] = []

    def warmup_steps(self, tau: int) -> int:
        return math.floor(self.method.phi * tau)

    def begin(self, m: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        means = [t.detach().abs().mean() for t in m]
        self.guarded = sum(int(v < self.method.eps) for v in means)
        self.alpha_prime = [v.clamp_min(self.method.eps) for v in means]
        self.alpha_e = [torch.zeros((), dtype=t.dtype, requires_grad=True) for t in m]
        return self.alpha_e

    def alphas(self) -> list[torch.Tensor]:
        pairs = zip(self.alpha_prime, self.alpha_e, strict=True)
        alphas = [step_size(prime, exponent, self.method.rho) for prime, exponent in pairs]
        if self.method.alpha_clamp is not None:
            lo, hi = self.method.alpha_clamp
            alphas = [a.clamp(lo, hi) for a in alphas]
        return alphas

    def apply(self, m: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = [binarize(t, a, self.generator) for t, a in zip(m, self.alphas(), strict=True)]
        self.last_bits = [o.detach() > 0 for o in out]
        return out


@dataclass(eq=False)
class FedBAT(Method):
    """Federated binarization-aware training; defaults are the paper's (ρ = 6, φ = 0.5)."""

    name = "fedbat"
    UPLOADS: ClassVar[tuple[str, ...]] = ("final_fresh", "last_forward")

    codec: LayerCodec
    rho: float = 6.0
    phi: float = 0.5
    eps: float = 1e-8
    alpha_clamp: tuple[float, float] | None = None
    upload: Literal["final_fresh", "last_forward"] = "final_fresh"

    def __post_init__(self) -> None:
        if not 0 <= self.rho < math.inf:
            raise ValueError(f"rho must be a finite number >= 0, got {self.rho}")
        if not 0 <= self.phi < 1:
            raise ValueError(f"phi must lie in [0, 1) so that the binarization-aware phase is non-empty, "
                             f"got {self.phi}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.alpha_clamp is not None and not 0 < self.alpha_clamp[0] < self.alpha_clamp[1]:
            raise ValueError(f"alpha_clamp must be (low, high) with 0 < low < high, got {self.alpha_clamp}")
        if self.upload not in self.UPLOADS:
            raise ValueError(f"upload must be one of {self.UPLOADS}, got {self.upload!r}")
        self.codec = check_codec(self.codec, self.name)
        self.rho, self.phi, self.eps = float(self.rho), float(self.phi), float(self.eps)

    def client(self, trainer: LocalTrainer, global_state: State, client: int, data_stream: torch.Generator,
               client_stream: torch.Generator) -> Upload:
        phase = _StepSizes(self, client_stream)
        local = trainer.train(global_state, client, data_stream, phase)
        with torch.no_grad():
            alphas = [a.detach() for a in phase.alphas()]
            if self.upload == "final_fresh":
                bits = [binarize(m, a, client_stream) > 0 for m, a in zip(local.update, alphas, strict=True)]
            else:
                bits = phase.last_bits
        payload = self.codec.encode_signs(bits, [float(a) for a in alphas])
        _, sent_alphas = self.codec.decode_signs(payload, trainer.shapes, len(alphas))
        info = {"alpha_prime": [float(a) for a in phase.alpha_prime],
                "alpha": [float(a) for a in sent_alphas],
                "saturated": [float((m.abs() > a).float().mean()) for m, a in zip(local.update, alphas,
                                                                                   strict=True)],
                "eps_guard_layers": [float(phase.guarded)]}
        return Upload(payload, local.extras, int(trainer.data.sizes[client]), local.mean_loss, info)

    def decode(self, payload: bytes, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        signs, alphas = self.codec.decode_signs(payload, shapes, len(shapes))
        return [a * s for a, s in zip(alphas, signs, strict=True)]

    def describe(self) -> dict[str, object]:
        return {"method": self.name, "rho": self.rho, "phi": self.phi, "eps": self.eps,
                "alpha_clamp": self.alpha_clamp, "upload": self.upload, "weights": "n_k samples",
                "bn": "trained directly, sent float32"}
