"""FedBAT's learnable binarization operator (Li et al., ICML 2024, Eq. 6-10).

The operator maps a model update ``m`` to ``S(m, α) ∈ {−α, +α}`` element-wise, with one step size α per
layer:

    S(x, α) = α·(2·bit − 1),   bit = clamp(⌊(x/α + 1)/2 + ζ⌋, 0, 1),   ζ ~ U(0, 1)

which is Eq. 6-7 in one line: stochastic rounding to ±α inside [−α, α] (P(+α) = (α + x)/(2α), so
E[S] = x there) and deterministic clipping to ±α outside. ζ is an explicit input, so the function is
deterministic given ζ (tests need that) and the caller controls the random stream.

Backward uses the paper's *designed* straight-through derivatives, not the true ones (the forward is
piecewise constant):

    ∂S/∂x = 1[|x| ≤ α]                                                     (Eq. 8)
    ∂S/∂α = sign(x) for |x| > α,   2·bit − (x + α)/α = (S − x)/α inside     (Eq. 9)

The ``bit`` in Eq. 9 is the one realised in the forward pass (saved, never redrawn). The gradient for α
is *summed* over all entries that share it: α may be 0-dim (one layer) or broadcastable to ``m`` (e.g.
``[S, 1, 1, 1, 1]`` for a stack of clients), and the gradient is reduced to α's shape.

The step size is parameterised as α = α'·exp(ρ·α_e) (Eq. 10): α' is fixed per round (Eq. 13), α_e is the
trained variable, ρ the pace coefficient; ρ = 0 freezes α at α'.

Its 1-bit uplink format is ``protocols.compression.layers.LayerCodec`` (injected: ``vfl`` does not import
``protocols``).
"""

from __future__ import annotations

import torch


class BinarizeUpdate(torch.autograd.Function):
    """``S(m, α; ζ)`` with the designed derivatives of Eq. 8-9 (see the module docstring)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, m: torch.Tensor, alpha: torch.Tensor,
                zeta: torch.Tensor) -> torch.Tensor:
        ratio = m / alpha
        bit = torch.floor((ratio + 1) / 2 + zeta).clamp_(0, 1)
        ctx.save_for_backward(ratio, bit)
        ctx.alpha_shape = alpha.shape
        return alpha * (2 * bit - 1)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, None]:
        ratio, bit = ctx.saved_tensors
        above, below = ratio > 1, ratio < -1
        inside = ~(above | below)
        grad_m = grad * inside
        d_alpha = torch.where(above, 1.0, torch.where(below, -1.0, 2 * bit - (ratio + 1)))
        grad_alpha = (grad * d_alpha).sum_to_size(ctx.alpha_shape)
        return grad_m, grad_alpha, None


def binarize(m: torch.Tensor, alpha: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``S(m, α)`` with fresh noise ζ ~ U(0, 1) drawn from ``generator`` (one draw per entry)."""
    zeta = torch.rand(m.shape, generator=generator, dtype=m.dtype, device=m.device)
    return BinarizeUpdate.apply(m, alpha, zeta)


def step_size(alpha_prime: torch.Tensor, alpha_e: torch.Tensor, rho: float) -> torch.Tensor:
    """α = α'·exp(ρ·α_e) (Eq. 10): positive by construction; ∂α/∂α_e = ρ·α."""
    return alpha_prime * torch.exp(rho * alpha_e)
