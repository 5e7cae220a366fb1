"""ISCA (Improved Stochastic Controlled Averaging, Algorithm 1 of the ISCA paper).

The client keeps a cached gradient u_i (SCAFFOLD's c_i), the server a global control v = mean_i u_i
(SCAFFOLD's c). Client i ∈ S^t, from the round's shared snapshot (x^t, v^t):

- K local steps ``y ← y − α_in·(g − u_i + v)`` (Lines 6-10; Line 9 keeps v_i^{t,k} − u_i^{t,k} equal to
  v^t − u_i^{t,0}, the paper's step (24a), so its inner-loop copies never change this direction and are
  not materialised);
- one **extra** minibatch gradient g_i^{t,K} at the final local model y_i^{t,K}, on a fresh minibatch
  (Line 12); it refreshes the cache, u_i ← g_i^{t,K} (Line 14), and never moves the model;
- two full-precision vectors up (Line 15): the model move y − x and the control increment
  Δ_i = v_i^{t,K+1} − v^t = g_i^{t,K} − u_i (Lines 9 and 13 telescope to this).

Server: x ← x + (α_out/S)·Σ(y − x) (Line 17, weight 1/S) and v ← v + (1/N)·ΣΔ_i (Line 18, weight 1/N:
keeps v = mean_i u_i under partial participation, which 1/S would break). ISCA is therefore SCAFFOLD whose
control variate is refreshed with one gradient at y_i^{t,K} instead of the mean of the K local gradients.

Decisions:
- Line 15 sends v_i^{t,K+1} itself; the server only ever uses v_i^{t,K+1} − v^t, so the increment is sent
  instead: the same d floats, the same server state in exact arithmetic, and no float32 cancellation
  (v + Δ) − v on the server. The tests compare this form with a literal per-client Lines 5-18 loop.
- ``cv_init`` defaults to "full_grad": Line 1, u_i^0 = ∇f_i(x^0) on each client's whole data, v^0 their
  mean (the pass touches all N clients before round 0 and is not in the bit ledger). "zeros" and
  "minibatch" are the other options, always with v^0 = mean_i u_i^0.
- Costs per participant and round: K + 1 gradients, 2 vectors up, 2 down (x and v).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from horizontal.base import (
    Algorithm,
    Downlink,
    FLConfig,
    InitContext,
    LocalResult,
    Message,
    RoundContext,
    Uplink,
    VectorState,
)
from horizontal.scaffold import ControlInit, check_cv_init, initial_controls


@dataclass(eq=False)
class CachedControl(VectorState):
    """Server state of ISCA/ISCAM: the model x and the global control v = mean_i u_i."""

    x: torch.Tensor
    v: torch.Tensor


@dataclass(eq=False)
class CachedGradients(VectorState):
    """Per-client cached gradients u_i, ``[N, d]`` (rows of the sampled clients inside a round)."""

    u: torch.Tensor


@dataclass(frozen=True)
class ExtraGradientPass:
    """End of an ISCA local pass: the K-step result and the extra gradient g^{t,K} at y^{t,K}, ``[S, d]``."""

    local: LocalResult
    final_gradient: torch.Tensor


def extra_gradient_pass(down: Downlink, u: torch.Tensor, ctx: RoundContext) -> ExtraGradientPass:
    """Lines 5-12 of Algorithms 1 and 2: K corrected local steps from (x^t, v^t), then one gradient at the
    final local models on a fresh minibatch (K + 1 gradient evaluations per client)."""
    local = ctx.solver.run(down["x"], correction=down["v"] - u)
    return ExtraGradientPass(local, ctx.solver.gradient(local.y))


def initial_cached_gradients(ctx: InitContext, cv_init: ControlInit) -> tuple[CachedControl, CachedGradients]:
    """(x^0, v^0) and u_i^0 with v^0 = mean_i u_i^0 (Lemma 5 needs it, whatever the initialisation)."""
    server, u = initial_controls(ctx, cv_init)
    return CachedControl(server.x, server.c), CachedGradients(u)


class CachedGradientRounds(Algorithm[CachedControl, CachedGradients]):
    """What ISCA and ISCAM share: the state (x, v) and u_i initialised by ``cv_init``, and (x, v) down."""

    cv_init: ControlInit

    def init(self, ctx: InitContext) -> tuple[CachedControl, CachedGradients]:
        return initial_cached_gradients(ctx, self.cv_init)

    def broadcast(self, server: CachedControl) -> Downlink:
        return {"x": server.x, "v": server.v}

    @staticmethod
    def advance(server: CachedControl, model_step: torch.Tensor, up: Uplink, config: FLConfig
                ) -> tuple[CachedControl, Downlink]:
        """The server update both share: x ← x + ``model_step``, v ← v + Σ_{i∈S} Δu_i / N (over all N,
        so v stays mean_i u_i while the other clients' u_i are unchanged); no reply."""
        v = server.v + up["control_delta"].values.sum(dim=0) / config.n_clients
        return CachedControl(server.x + model_step, v), {}


@dataclass(eq=False)
class Isca(CachedGradientRounds):
    name = "isca"

    cv_init: ControlInit = field(default="full_grad", kw_only=True)

    def __post_init__(self) -> None:
        check_cv_init(self.cv_init)

    def client_update(self, down: Downlink, clients: CachedGradients, ctx: RoundContext
                      ) -> tuple[Uplink, CachedGradients]:
        result = extra_gradient_pass(down, clients.u, ctx)
        up = {"model_delta": Message.full_precision(result.local.y - down["x"]),
              "control_delta": Message.full_precision(result.final_gradient - clients.u)}
        return up, CachedGradients(result.final_gradient)

    def server_update(self, server: CachedControl, up: Uplink, config: FLConfig
                      ) -> tuple[CachedControl, Downlink]:
        return self.advance(server, config.lr_global * up["model_delta"].values.mean(dim=0), up, config)

    def describe(self) -> dict[str, object]:
        return {"algorithm": self.name, "cv_init": self.cv_init}
