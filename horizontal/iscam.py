"""ISCAM (Algorithm 2 of the ISCA paper): ISCA with two compressed uplink messages, for ω-unbiased
compressors.

Client i ∈ S^t runs ISCA's local pass (K corrected steps and the extra gradient g_i^{t,K} at y_i^{t,K}),
then (Lines 13-15)

    δ_i = β1·(y_i^{t,K} − x^t)/(α_in K),     Δ_i = β2·(v_i^{t,K+1} − v^t) = β2·(g_i^{t,K} − u_i),

and sends δ̃_i = C_i(δ_i) and Δ̃_i = C_i(Δ_i), two independent compressor draws from the client's own
stream. Server (Lines 17-18): x ← x + (α_out α_in K/S)·Σδ̃_i and v ← v + (1/N)·ΣΔ̃_i.

Decisions:
- The u-update (Line 14) uses the **compressed** increment, u_i ← u_i + Δ̃_i: Appendix D and Lemma 5
  need it, and it keeps v = mean_i u_i exactly. The printed Line 14 (u_i ← u_i + Δ_i, uncompressed) is
  kept behind ``u_update="uncompressed_literal"`` for ablations: the gap v − mean_i u_i then accumulates
  compression errors and the iterates converge to a biased point.
- δ_i is computed as −β1·(v^t + ḡ_i − u_i), its exact value for these local steps, not by the
  subtraction (y − x)/(α_in K), which loses precision in float32.
- β1 scales the whole model direction, so it acts as an extra global step (β1·α_out) and is never undone
  (no 1/β1 compensation); β2 is the control variables' learning rate. β1 ∈ (0, 1] (β1 = 0 would freeze
  the model), β2 ∈ [0, 1] (β2 = 0 with zero-initialised controls is FedAvg with a compressed uplink).
  The paper's experiments use β1 = β2 = 0.1 with 2- and 4-bit random dithering.
- ``cv_init`` defaults to "full_grad": Algorithm 2 has no initialisation line, so Algorithm 1's Line 1 is
  used. A biased compressor is accepted (the update is well defined) unless ``allow_biased=False``, as
  for SCALLION; the theory needs an unbiased one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from horizontal.base import (
    Compressor,
    Downlink,
    FLConfig,
    RoundContext,
    Uplink,
    WithCompressor,
    compressor_label,
)
from horizontal.isca import CachedControl, CachedGradientRounds, CachedGradients, extra_gradient_pass
from horizontal.scaffold import ControlInit, check_cv_init

UUpdate = Literal["compressed", "uncompressed_literal"]
U_UPDATES = ("compressed", "uncompressed_literal")


@dataclass(eq=False)
class Iscam(WithCompressor, CachedGradientRounds):
    name = "iscam"

    compressor: Compressor
    beta1: float = 0.1
    beta2: float = 0.1
    cv_init: ControlInit = field(default="full_grad", kw_only=True)
    u_update: UUpdate = field(default="compressed", kw_only=True)
    allow_biased: bool = field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        if not 0.0 < self.beta1 <= 1.0:
            raise ValueError(f"ISCAM beta1 must be in (0, 1], got {self.beta1}")
        if not 0.0 <= self.beta2 <= 1.0:
            raise ValueError(f"ISCAM beta2 must be in [0, 1], got {self.beta2}")
        if self.u_update not in U_UPDATES:
            raise ValueError(f"ISCAM u_update must be one of {U_UPDATES}, got {self.u_update!r}")
        check_cv_init(self.cv_init)
        self._check_compressor(unbiased=not self.allow_biased)

    def client_update(self, down: Downlink, clients: CachedGradients, ctx: RoundContext
                      ) -> tuple[Uplink, CachedGradients]:
        u = clients.u
        result = extra_gradient_pass(down, u, ctx)
        model_direction = -self.beta1 * (down["v"] + result.local.grad_mean - u)      # = δ_i, exactly
        control_delta = self.beta2 * (result.final_gradient - u)                       # Δ_i = β2·(v_i − v)
        model_message = ctx.compress(self.compressor, model_direction)
        control_message = ctx.compress(self.compressor, control_delta)
        applied = control_message.values if self.u_update == "compressed" else control_delta
        up = {"model_direction": model_message, "control_delta": control_message}
        return up, CachedGradients(u + applied)

    def server_update(self, server: CachedControl, up: Uplink, config: FLConfig
                      ) -> tuple[CachedControl, Downlink]:
        return self.advance(server, config.effective_step * up["model_direction"].values.mean(dim=0), up,
                            config)

    def describe(self) -> dict[str, object]:
        return {"algorithm": self.name, "beta1": self.beta1, "beta2": self.beta2,
                "compressor": compressor_label(self.compressor), "cv_init": self.cv_init,
                "u_update": self.u_update}
