"""FedAvg / Fed-SGD with two-sided learning rates (Yang et al. 2021), the SCAFCOM paper's reference.

Each sampled client runs K plain local SGD steps from x^t and sends y_i^{t,K} − x^t in full precision;
the server moves x^{t+1} = x^t + (η_g/S)·Σ_{i∈S^t}(y_i^{t,K} − x^t). Fed-SGD is the case K = 1.
Clients are stateless. Under heterogeneity with K > 1 this converges to a biased point (client drift),
which the SCAFFOLD family removes. :class:`LayeredFedAvg` is the same rule on the layered backbone
(FedBAT's CNN, local epochs, sample-weighted aggregation), the reference of the FedBAT paper's tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from horizontal.base import (
    Algorithm,
    Downlink,
    FLConfig,
    InitContext,
    Message,
    NoClientState,
    RoundContext,
    ServerModel,
    Uplink,
)
from horizontal.layered import PostTraining


@dataclass(eq=False)
class FedAvg(Algorithm[ServerModel, NoClientState]):
    name = "fedavg"

    def init(self, ctx: InitContext) -> tuple[ServerModel, NoClientState]:
        return ServerModel(ctx.x0), NoClientState()

    def client_update(self, down: Downlink, clients: NoClientState, ctx: RoundContext
                      ) -> tuple[Uplink, NoClientState]:
        x = down["x"]
        local = ctx.solver.run(x)
        return {"model_delta": Message.full_precision(local.y - x)}, clients

    def server_update(self, server: ServerModel, up: Uplink, config: FLConfig
                      ) -> tuple[ServerModel, Downlink]:
        step = up["model_delta"].values.mean(dim=0)
        return ServerModel(server.x + config.lr_global * step), {}


@dataclass(eq=False)
class LayeredFedAvg(PostTraining):
    """FedAvg on the layered backbone (FedBAT's CNN, ``--model cnn``): the same rule, the update of the
    binarized tensors in float32 (32 bits a weight), aggregated with sample weights as FedBAT's Eq. 11."""

    name = "fedavg"

    def encode(self, update: list[torch.Tensor], shapes: Sequence[torch.Size], client: int,
               generator: torch.Generator) -> bytes:
        return self.codec.encode_floats(update)

    def decode(self, payload: bytes, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        return self.codec.decode_floats(payload, shapes)
