"""SCAFCOM (Huang, Li & Li 2024, Algorithm 2): SCAFFOLD with momentum-enhanced compression, for biased
(contractive) compressors such as Top-r.

Client i ∈ S^t: SCAFFOLD local steps, then its momentum v_i ← (1−β)·v_i + β·ḡ_i (per client, across
the rounds it takes part in, from the *uncompressed* mean local gradient), δ_i = v_i^{new} − c_i,
sends δ̃_i = C_i(δ_i), c_i ← c_i + δ̃_i. Server as SCALLION/Algorithm 4. β = 1 with the identity
compressor is SCAFFOLD. The paper's best setting is β = 0.2. Non-sampled clients keep c_i and v_i unchanged.

Initialisation: v_i^0 = c_i^0 (zeros by default; ∇f_i(x^0) with ``cv_init="full_grad"``), as in the
paper's theorems and remarks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from horizontal.base import (
    Algorithm,
    Compressor,
    Downlink,
    FLConfig,
    InitContext,
    RoundContext,
    ServerControl,
    Uplink,
    VectorState,
    WithCompressor,
    compressor_label,
)
from horizontal.scaffold import (
    ControlInit,
    apply_control_messages,
    check_cv_init,
    corrected_local_run,
    initial_controls,
)


@dataclass(eq=False)
class ControlMomentum(VectorState):
    """Per-client control variables c_i and local momenta v_i, both ``[N, d]``."""

    c: torch.Tensor
    v: torch.Tensor


@dataclass(eq=False)
class Scafcom(WithCompressor, Algorithm[ServerControl, ControlMomentum]):
    name = "scafcom"

    compressor: Compressor
    beta: float = 0.2
    cv_init: ControlInit = field(default="zeros", kw_only=True)

    def __post_init__(self) -> None:
        if not 0.0 < self.beta <= 1.0:
            raise ValueError(f"SCAFCOM beta must be in (0, 1], got {self.beta}")
        self._check_compressor()
        check_cv_init(self.cv_init)

    def init(self, ctx: InitContext) -> tuple[ServerControl, ControlMomentum]:
        server, c_clients = initial_controls(ctx, self.cv_init)
        return server, ControlMomentum(c_clients, c_clients.clone())

    def broadcast(self, server: ServerControl) -> Downlink:
        return {"x": server.x, "c": server.c}

    def client_update(self, down: Downlink, clients: ControlMomentum, ctx: RoundContext
                      ) -> tuple[Uplink, ControlMomentum]:
        local = corrected_local_run(down, clients.c, ctx)
        v = torch.lerp(clients.v, local.grad_mean, self.beta)        # (1−β)v + βḡ
        message = ctx.compress(self.compressor, v - clients.c)
        return {"delta": message}, ControlMomentum(clients.c + message.values, v)

    def server_update(self, server: ServerControl, up: Uplink, config: FLConfig
                      ) -> tuple[ServerControl, Downlink]:
        return apply_control_messages(server, up["delta"].values, config), {}

    def describe(self) -> dict[str, object]:
        return {"algorithm": self.name, "beta": self.beta, "compressor": compressor_label(self.compressor),
                "cv_init": self.cv_init}
