"""SCAFFOLD (Karimireddy et al. 2020b, option II) in its two equivalent forms (Algorithms 3 and 4 of
the SCAFCOM paper).

Both run the same local steps ``y ← y − η_l·(g − c_i + c)`` from x^t and keep c = mean_i c_i.

- :class:`ScaffoldTwoVector` (Algorithm 3, the original): sends y − x and Δc_i = c_i^{t+1} − c_i^t with
  c_i^{t+1} = c_i − c + (x − y)/(η_l K); server: x += (η_g/S)Σ(y − x), c += (1/N)ΣΔc_i. Two d-vectors up.
- :class:`Scaffold` (Algorithm 4): sends the single vector Δ_i = ḡ_i − c_i (= (x − y)/(η_l K) − c);
  the server, which knows c, recovers both increments: x −= (γ/S)Σ(Δ_i + c) with γ = η_g η_l K and
  c += (1/N)ΣΔ_i. Same trajectory, half the uplink.

Decision: Algorithm 4 computes Δ_i from the accumulated mean gradient ḡ_i, not from (x − y)/(η_l K),
which loses precision in float32; Algorithm 3 keeps the paper's literal formula, since reproducing the
original is its purpose. In float64 the two agree to ~1e-13.

Control-variate initialisation ``cv_init``: "zeros" (default; the papers' practice, c_i^0 = c^0 = 0),
"full_grad" (c_i^0 = ∇f_i(x^0): Theorems 1-2 and ISCA's Line 1) or "minibatch" (one minibatch gradient
per client at x^0, batch = the run's batch size: Theorems 3-4). Always c^0 = mean_i c_i^0, never an
independent estimate, so that the invariant c = mean_i c_i holds from round 0. The initialisation pass is
not counted in the bit ledger.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from horizontal.base import (
    Algorithm,
    Downlink,
    FLConfig,
    InitContext,
    LocalResult,
    Message,
    RoundContext,
    ServerControl,
    Uplink,
    VectorState,
    zeros_like_clients,
)

ControlInit = Literal["zeros", "full_grad", "minibatch"]
CONTROL_INITS = ("zeros", "full_grad", "minibatch")


@dataclass(eq=False)
class ControlVariates(VectorState):
    """Per-client control variables c_i, ``[N, d]`` (rows of the sampled clients inside a round)."""

    c: torch.Tensor


def check_cv_init(cv_init: str) -> ControlInit:
    if cv_init not in CONTROL_INITS:
        raise ValueError(f"cv_init must be one of {CONTROL_INITS}, got {cv_init!r}")
    return cv_init  # type: ignore[return-value]


def initial_controls(ctx: InitContext, cv_init: ControlInit) -> tuple[ServerControl, torch.Tensor]:
    """Server (x^0, c^0) and the ``[N, d]`` c_i^0 with c^0 = mean_i c_i^0."""
    check_cv_init(cv_init)
    if cv_init == "zeros":
        c_clients = zeros_like_clients(ctx.x0, ctx.n_clients)
    elif cv_init == "full_grad":
        c_clients = ctx.full_local_gradients(ctx.x0)
    else:
        c_clients = ctx.minibatch_local_gradients(ctx.x0)
    return ServerControl(ctx.x0, c_clients.mean(dim=0)), c_clients


def corrected_local_run(down: Downlink, c_clients: torch.Tensor, ctx: RoundContext) -> LocalResult:
    """K local steps on the SCAFFOLD direction g − c_i + c, all sampled clients from the same (x^t, c^t)."""
    return ctx.solver.run(down["x"], correction=down["c"] - c_clients)


def apply_control_messages(server: ServerControl, messages: torch.Tensor, config: FLConfig) -> ServerControl:
    """Server step shared by Algorithm 4, SCALLION and SCAFCOM: with the decoded messages δ̃_i ``[S, d]``,
    x ← x − γ·(mean_S δ̃_i + c) and c ← c + (1/N)·Σ_S δ̃_i (1/S for the model, 1/N for c: 1/S there would
    break c = mean_i c_i under partial participation)."""
    x = server.x - config.effective_step * (messages.mean(dim=0) + server.c)
    c = server.c + messages.sum(dim=0) / config.n_clients
    return ServerControl(x, c)


@dataclass(eq=False)
class _ScaffoldFamily(Algorithm[ServerControl, ControlVariates]):
    """Shared state and downlink of the control-variate methods that keep only c_i per client."""

    cv_init: ControlInit = field(default="zeros", kw_only=True)

    def __post_init__(self) -> None:
        check_cv_init(self.cv_init)

    def init(self, ctx: InitContext) -> tuple[ServerControl, ControlVariates]:
        server, c_clients = initial_controls(ctx, self.cv_init)
        return server, ControlVariates(c_clients)

    def broadcast(self, server: ServerControl) -> Downlink:
        return {"x": server.x, "c": server.c}

    def describe(self) -> dict[str, object]:
        return {"algorithm": self.name, "cv_init": self.cv_init}


@dataclass(eq=False)
class ScaffoldTwoVector(_ScaffoldFamily):
    """Algorithm 3: the original SCAFFOLD, two full-precision uplink vectors."""

    name = "scaffold-2v"

    def client_update(self, down: Downlink, clients: ControlVariates, ctx: RoundContext
                      ) -> tuple[Uplink, ControlVariates]:
        x, c = down["x"], down["c"]
        local = corrected_local_run(down, clients.c, ctx)
        cfg = ctx.config
        c_new = clients.c - c + (x - local.y) / (cfg.lr_local * cfg.local_steps)
        up = {"model_delta": Message.full_precision(local.y - x),
              "control_delta": Message.full_precision(c_new - clients.c)}
        return up, ControlVariates(c_new)

    def server_update(self, server: ServerControl, up: Uplink, config: FLConfig
                      ) -> tuple[ServerControl, Downlink]:
        x = server.x + config.lr_global * up["model_delta"].values.mean(dim=0)
        c = server.c + up["control_delta"].values.sum(dim=0) / config.n_clients
        return ServerControl(x, c), {}


@dataclass(eq=False)
class Scaffold(_ScaffoldFamily):
    """Algorithm 4: SCAFFOLD with the single uplink vector Δ_i = ḡ_i − c_i (full precision)."""

    name = "scaffold"

    def client_update(self, down: Downlink, clients: ControlVariates, ctx: RoundContext
                      ) -> tuple[Uplink, ControlVariates]:
        local = corrected_local_run(down, clients.c, ctx)
        delta = local.grad_mean - clients.c
        return {"delta": Message.full_precision(delta)}, ControlVariates(clients.c + delta)

    def server_update(self, server: ServerControl, up: Uplink, config: FLConfig
                      ) -> tuple[ServerControl, Downlink]:
        return apply_control_messages(server, up["delta"].values, config), {}
