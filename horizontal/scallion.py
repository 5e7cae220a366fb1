"""SCALLION (Huang, Li & Li 2024, Algorithm 1): SCAFFOLD with one compressed uplink vector, for
unbiased compressors.

Client i ∈ S^t: SCAFFOLD local steps, then δ_i = α·(ḡ_i − c_i), sends δ̃_i = C_i(δ_i) and sets
c_i ← c_i + δ̃_i (the *compressed* message, as the server does, so c = mean_i c_i holds). Server:
x ← x − γ·(mean δ̃_i + c), c ← c + (1/N)Σδ̃_i. α scales Δ before compression and is never undone (no 1/α
on the server: the paper's α "can be viewed as the learning rate of control variables"); α = 1 with the
identity compressor is SCAFFOLD (Algorithm 4). The paper's best setting is α = 0.1 with 2/4-bit dithering.

Decision: a biased compressor is accepted (the update is well defined) but SCALLION's theory needs an
unbiased one; pass ``allow_biased=False`` to refuse biased compressors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from horizontal.base import (
    Compressor,
    Downlink,
    FLConfig,
    RoundContext,
    ServerControl,
    Uplink,
    WithCompressor,
    compressor_label,
)
from horizontal.scaffold import (
    ControlVariates,
    _ScaffoldFamily,
    apply_control_messages,
    corrected_local_run,
)


@dataclass(eq=False)
class Scallion(WithCompressor, _ScaffoldFamily):
    name = "scallion"

    compressor: Compressor
    alpha: float = 0.1
    allow_biased: bool = field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"SCALLION alpha must be in (0, 1], got {self.alpha}")
        self._check_compressor(unbiased=not self.allow_biased)

    def client_update(self, down: Downlink, clients: ControlVariates, ctx: RoundContext
                      ) -> tuple[Uplink, ControlVariates]:
        local = corrected_local_run(down, clients.c, ctx)
        message = ctx.compress(self.compressor, self.alpha * (local.grad_mean - clients.c))
        return {"delta": message}, ControlVariates(clients.c + message.values)

    def server_update(self, server: ServerControl, up: Uplink, config: FLConfig
                      ) -> tuple[ServerControl, Downlink]:
        return apply_control_messages(server, up["delta"].values, config), {}

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "alpha": self.alpha, "compressor": compressor_label(self.compressor)}
