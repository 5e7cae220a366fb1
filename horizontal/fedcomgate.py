"""FedCOMGATE (Haddadpour et al. 2021): compressed uplink on the gradient-tracking method VRL-SGD
(the paper gives no pseudo-code; the rule below follows the authors' FedTorch code, ``fedgate.py``).

Each client keeps a tracking variable δ_j ≈ ∇f_j − ∇f (initially 0). Client j ∈ S^r: local steps
y ← y − η_l·(g − δ_j), sends Q_j = C_j((x^r − y_j^K)/η_l). Server: D = (1/S)ΣQ_j, x ← x − η_l η_g·D,
and replies D to the round's participants, which set δ_j ← δ_j + ((x^r − y_j^K)/η_l − D)/K, with their
*uncompressed* local difference (as in FedTorch).

Decisions: (x^r − y_j^K)/η_l is computed as K·(ḡ_j − δ_j), its exact value for these local steps,
instead of by subtraction, which loses precision in float32 when η_l is small. The paper proves FedCOMGATE
for full participation only; under partial participation the sampled clients track with the mean D over
the sampled set and the others keep δ_j unchanged. The δ update is split across the round:
``client_update`` adds the local part and ``client_finish`` subtracts D/K once the reply arrives; the
stored state is complete after the round.

Known behaviour, not a bug (tests/test_fedcomgate_reduction.py): because δ_j moves with the uncompressed
local difference but the server with the compressed mean, Σ_j δ_j accumulates the compression errors
Σ_j (m_j − C(m_j))/K. With an unbiased compressor whose error scales with ‖m‖ (random dithering), that
drift feeds itself and grows exponentially at any η. The theory assumes "uniformly bounded compression
errors", which the SCAFCOM paper calls "invalid for practical compressors such as ... random dithering".
In the FMNIST reproductions FedCOMGATE with 2- and 4-bit dithering therefore diverges, where SCALLION
(which keeps c = mean c_i exactly and damps each c_i's error by α) does not.
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
class TrackingVariates(VectorState):
    """Per-client gradient-tracking corrections δ_j, ``[N, d]``."""

    delta: torch.Tensor


@dataclass(eq=False)
class FedComGate(WithCompressor, Algorithm[ServerModel, TrackingVariates]):
    name = "fedcomgate"

    compressor: Compressor

    def init(self, ctx: InitContext) -> tuple[ServerModel, TrackingVariates]:
        return ServerModel(ctx.x0), TrackingVariates(zeros_like_clients(ctx.x0, ctx.n_clients))

    def client_update(self, down: Downlink, clients: TrackingVariates, ctx: RoundContext
                      ) -> tuple[Uplink, TrackingVariates]:
        local = ctx.solver.run(down["x"], correction=-clients.delta)
        steps = ctx.config.local_steps
        scaled_move = steps * (local.grad_mean - clients.delta)     # (x − y)/η_l
        message = ctx.compress(self.compressor, scaled_move)
        return {"scaled_move": message}, TrackingVariates(clients.delta + scaled_move / steps)

    def server_update(self, server: ServerModel, up: Uplink, config: FLConfig
                      ) -> tuple[ServerModel, Downlink]:
        mean_move = up["scaled_move"].values.mean(dim=0)
        x = server.x - config.lr_local * config.lr_global * mean_move
        return ServerModel(x), {"mean_move": mean_move}

    def client_finish(self, reply: Downlink, clients: TrackingVariates, config: FLConfig
                      ) -> TrackingVariates:
        return TrackingVariates(clients.delta - reply["mean_move"] / config.local_steps)
