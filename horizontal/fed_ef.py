"""Fed-EF-SGD (Li & Li 2023, Algorithm 1): FedAvg with a compressed uplink and per-client error feedback.
The SCAFCOM paper compares against this variant "since our proposed algorithms conduct SGD-type updates in
the server".

Client i ∈ S^t: plain local SGD, u_i = y_i^{t,K} − x^t, sends p_i = C_i(u_i + e_i), keeps the error
e_i ← e_i + u_i − p_i (non-sampled clients' errors go stale, unchanged). Server:
x ← x + η_g·(1/S)Σ p_i. With the identity compressor it is FedAvg (e stays 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from horizontal.base import (
    Algorithm,
    Compressor,
    Downlink,
    FLConfig,
    InitContext,
    RoundContext,
    ServerModel,
    Uplink,
    VectorState,
    WithCompressor,
    zeros_like_clients,
)


@dataclass(eq=False)
class ErrorMemory(VectorState):
    """Per-client accumulated compression errors e_i, ``[N, d]``."""

    e: torch.Tensor


@dataclass(eq=False)
class FedEF(WithCompressor, Algorithm[ServerModel, ErrorMemory]):
    name = "fed-ef"

    compressor: Compressor

    def init(self, ctx: InitContext) -> tuple[ServerModel, ErrorMemory]:
        return ServerModel(ctx.x0), ErrorMemory(zeros_like_clients(ctx.x0, ctx.n_clients))

    def client_update(self, down: Downlink, clients: ErrorMemory, ctx: RoundContext
                      ) -> tuple[Uplink, ErrorMemory]:
        x = down["x"]
        corrected = ctx.solver.run(x).y - x + clients.e              # u_i + e_i
        message = ctx.compress(self.compressor, corrected)
        return {"model_delta": message}, ErrorMemory(corrected - message.values)

    def server_update(self, server: ServerModel, up: Uplink, config: FLConfig
                      ) -> tuple[ServerModel, Downlink]:
        return ServerModel(server.x + config.lr_global * up["model_delta"].values.mean(dim=0)), {}
