"""FedDRO (Khanduri et al., Algorithm 2) and vanilla FedAvg for compositional optimisation (Algorithm 1),
simulated with all K clients stacked as ``[K, d]`` tensors.

Why not :class:`horizontal.engine.FederatedSimulation`: its round is "broadcast → I independent local steps →
aggregate", while FedDRO needs a barrier at *every* local step: each client sends its estimate y_k of the
inner function g = (1/K)Σ_k g_k, the server averages them and every client steps along
∇h_k + ∇g_k·∇f(ȳ) (Algorithm 2, line 6). So this module runs its own iterations and reuses the engine's
pieces by composition: :class:`~horizontal.data.FederatedData` (client-contiguous rows, one-gather
minibatches with replacement), :class:`~horizontal.engine.Streams` (seeded random streams),
:func:`~horizontal.base.wire_bits` (bits of real payloads) and :class:`~horizontal.engine.MetricsLog`.

One iteration t (the paper's letters: K clients, I local steps per model round, t counts local steps):

1. every client draws one minibatch b_k^t and evaluates its inner value at x_k^t **and** at x_k^{t−1}
   (the point of its previous gradient step, untouched by averaging) on that same batch;
2. y_k^t = (1−β)(y_k^{t−1} − ĝ_k(x_k^{t−1}; b)) + ĝ_k(x_k^t; b)   (eq. (8));
3. ``y_sync="step"`` (FedDRO): the server averages, every client sets y_k^t := ȳ^t;
4. x_k^{t+1} = x_k^t − η^t [∇̂h_k(x_k^t) + ∇̂g_k(x_k^t)·∇f(y_k^t)]   (eq. (7), same batch);
5. if (t+1) mod I == 0: every x_k^{t+1} := x̄^{t+1} (model round).

Ablation switch ``y_sync``: "round" shares y only at the first step of each model round,
"never" never shares. With β = 1 and exact evaluations these are exactly Algorithm 1 Case II and Case I
(the proof version of Appendix D: after averaging a client uses g_k(x̄)), and "step" is the "modified
FedAvg" of Theorem 4.2. :meth:`FedDRO.fedavg_co` and :meth:`FedDRO.mbsgd` build these baselines; MBSGD-CO
(minibatch SGD for CO, the paper's parallel baseline) is FedDRO with β = 1 and I = 1.

Decisions where the paper is silent (also returned by :meth:`FedDRO.describe` for the logs):

* y_k^{−1}, which (8) needs at t = 0 but the paper's initialisation leaves undefined: ``init="blend"``
  sets y^{−1} := ȳ_init and runs (8) at t = 0, which gives (1−β)ȳ_init + β·ĝ_k(x̄^0; b^0) because
  x^{−1} = x^0; ``init="skip"`` uses ȳ^0 = ȳ_init. ȳ_init is one extra all-reduce of one minibatch per
  client at x̄^0 (counted in the ledger), unless given.
* The returned model is the last synchronised x̄, not the theory's random iterate.
* Inner estimates travel in float64 (64 bits per entry; the recursion is done in float64); models
  travel in their own dtype. The ledger counts both exchanges separately; the paper's
  "communication rounds" are the model rounds only.
* ``independent_grad_batch=True`` draws a second minibatch for the gradient (7) (the analysis treats
  ∇f(ȳ^t) as independent of the gradient batch); the default shares one batch between (7) and (8), as
  the paper's notation does.
* No momentum or weight decay on x (the momentum is on the inner estimate only); constant β (clipped to
  (0, 1] by validation).
* Models here have no BatchNorm, so the extra forward pass at x_k^{t−1} has no running statistics to
  disturb.

The data-backed problem is :class:`FederatedDRO` (any :class:`TorchModel` + a
:class:`~horizontal.dro_objectives.LossComposition`); the closed-form toy problems are in
:mod:`horizontal.dro_objectives`; :func:`horizontal.partitions.imbalanced_st_indices` builds the paper's "-ST"
training sets.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

import torch

from horizontal.base import VectorState, wire_bits
from horizontal.data import FederatedData
from horizontal.dro_objectives import FLOAT, LossComposition
from horizontal.engine import Streams
from horizontal.models import TorchModel

YSync = Literal["step", "round", "never"]
InitMode = Literal["blend", "skip"]


# ------------------------------------------------------------------------------------------ problems


class Evaluation(Protocol):
    """Every client's inner estimate ĝ_k(x_k; b) ``[K, d_g]`` and, given ∇f values ``s [K, d_g]``, the
    stochastic gradient (7) ∇̂h_k(x_k) + ∇̂g_k(x_k)ᵀ s_k ``[K, d]`` on the same batch."""

    inner: torch.Tensor

    def gradient(self, s: torch.Tensor) -> torch.Tensor: ...


class CompositeProblem(Protocol):
    """A federated compositional problem Φ = (1/K)Σh_k + f((1/K)Σg_k), as the algorithms see it."""

    n_clients: int
    dim: int
    d_g: int

    def f(self, y: torch.Tensor) -> torch.Tensor: ...

    def grad_f(self, y: torch.Tensor) -> torch.Tensor: ...

    def sample(self, generator: torch.Generator) -> Any:
        """One minibatch per client (opaque to the algorithm; reused for several evaluations)."""
        ...

    def evaluate(self, X: torch.Tensor, batch: Any) -> Evaluation: ...

    def inner_values(self, X: torch.Tensor, batch: Any) -> torch.Tensor:
        """ĝ_k(x_k; b) ``[K, d_g]`` without any gradient work (the extra pass at x_k^{t−1})."""
        ...

    def init(self, generator: torch.Generator) -> torch.Tensor: ...

    def diagnostics(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class LossEvaluation:
    """Per-sample losses ``[K, B]`` with their autograd graph back to the leaf ``W [K, d]``."""

    W: torch.Tensor
    losses: torch.Tensor
    inner: torch.Tensor
    objective: LossComposition

    def gradient(self, s: torch.Tensor) -> torch.Tensor:
        """Eq. (7) as the gradient of the surrogate mean_j w_j ℓ_j with detached w_j = h'(ℓ_j) + s·g'(ℓ_j)."""
        weights = self.objective.sample_weights(self.losses.detach(), s) / self.losses.shape[1]
        surrogate = (weights.to(self.losses.dtype) * self.losses).sum()
        return torch.autograd.grad(surrogate, self.W)[0]


class FederatedDRO:
    """A DRO objective on real client data: per-sample losses of ``model`` composed by ``objective``.
    ``batch_size=None`` evaluates every client's whole data set (deterministic; equal client sizes)."""

    def __init__(self, model: TorchModel, objective: LossComposition, data: FederatedData,
                 batch_size: int | None) -> None:
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None (each client's whole data), got {batch_size}")
        if data.X.shape[1] != model.n_features:
            raise ValueError(f"data has {data.X.shape[1]} features but the model expects {model.n_features}")
        if data.y.dtype != torch.int64 or int(data.y.min()) < 0 or int(data.y.max()) >= model.n_classes:
            raise ValueError(f"labels must be int64 in [0, {model.n_classes})")
        self.model = model
        self.objective = objective
        self.data = data
        self.batch_size = batch_size
        self.n_clients = data.n_clients
        self.dim = model.dim
        self.d_g = objective.d_g
        self._clients = torch.arange(self.n_clients)

    def f(self, y: torch.Tensor) -> torch.Tensor:
        return self.objective.f(y)

    def grad_f(self, y: torch.Tensor) -> torch.Tensor:
        return self.objective.grad_f(y)

    def sample(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data.sample_batches(self._clients, self.batch_size, generator)

    def evaluate(self, X: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> LossEvaluation:
        W = X.detach().requires_grad_(True)
        losses = self.model.per_sample_losses(W, *batch)
        inner = self.objective.inner(losses.detach()).mean(1, keepdim=True)
        return LossEvaluation(W, losses, inner, self.objective)

    @torch.no_grad()
    def inner_values(self, X: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.objective.inner(self.model.per_sample_losses(X, *batch)).mean(1, keepdim=True)

    def init(self, generator: torch.Generator) -> torch.Tensor:
        return self.model.init(generator, self.data.X.dtype)

    def diagnostics(self) -> dict[str, float]:
        return self.objective.diagnostics()

    def client_losses(self, w: torch.Tensor) -> list[torch.Tensor]:
        """Per-sample losses of model ``w`` on each client's whole data set (objective value, tracking)."""
        losses, _ = self.model.losses_and_predictions(w, self.data.X, self.data.y)
        return [losses[int(lo):int(hi)] for lo, hi in zip(self.data.offsets[:-1], self.data.offsets[1:],
                                                          strict=True)]


# ------------------------------------------------------------------------------------------ algorithm


@dataclass(frozen=True)
class FedDRO:
    """FedDRO's settings: communication period I, momentum β of the inner estimator (weight of the fresh
    estimate; β = 1 keeps no memory), and the switches documented in the module docstring."""

    period: int = 1
    beta: float = 0.1
    y_sync: YSync = "step"
    init: InitMode = "blend"
    independent_grad_batch: bool = False
    label: str = "feddro"

    def __post_init__(self) -> None:
        if self.period < 1:
            raise ValueError(f"period I must be >= 1, got {self.period}")
        if not 0 < self.beta <= 1:
            raise ValueError(f"beta must lie in (0, 1], got {self.beta}")
        if self.y_sync not in ("step", "round", "never"):
            raise ValueError(f"y_sync must be 'step', 'round' or 'never', got {self.y_sync!r}")
        if self.init not in ("blend", "skip"):
            raise ValueError(f"init must be 'blend' or 'skip', got {self.init!r}")

    @classmethod
    def fedavg_co(cls, case: Literal["I", "II"], period: int) -> FedDRO:
        """Algorithm 1 (vanilla FedAvg for CO): Case I never shares the inner value, Case II shares it
        when the models are averaged. Each client plugs in its own minibatch value (β = 1)."""
        if case not in ("I", "II"):
            raise ValueError(f"FedAvg-CO case must be 'I' or 'II', got {case!r}")
        return cls(period, 1.0, "never" if case == "I" else "round", label=f"fedavg-co-{case}")

    @classmethod
    def mbsgd(cls) -> FedDRO:
        """Parallel minibatch SGD for CO: every step averages the models and the K clients' minibatch
        inner values (one K·|b| batch per step, no memory)."""
        return cls(1, 1.0, "step", label="mbsgd-co")

    def shares_initial_inner(self) -> bool:
        """Whether ȳ_init is one exchange before t = 0 (not when y is never shared, nor when β = 1 with
        ``init="blend"`` gives y^{−1} weight 0)."""
        return not (self.y_sync == "never" or (self.beta == 1 and self.init == "blend"))

    def shares_inner(self, t: int) -> bool:
        """Whether iteration t averages the inner estimates (step 3 of the module docstring)."""
        return self.y_sync == "step" or (self.y_sync == "round" and t % self.period == 0)

    def averages_models(self, t: int) -> bool:
        """Whether iteration t ends with a model round (step 5)."""
        return (t + 1) % self.period == 0

    def describe(self) -> dict[str, object]:
        return {"algorithm": self.label, "I": self.period, "beta": self.beta, "y_sync": self.y_sync,
                "init": self.init, "independent_grad_batch": self.independent_grad_batch,
                "returned_model": "last synchronised average", "inner_wire_dtype": "float64"}


@dataclass(eq=False)
class FedDROState(VectorState):
    """Per-client models x_k ``[K, d]``, the points of their previous gradient step x_k^{t−1} ``[K, d]``,
    and the inner estimates they used in that step ``[K, d_g]`` (all rows equal ȳ under "step")."""

    x: torch.Tensor
    x_prev: torch.Tensor
    y_used: torch.Tensor


@dataclass
class CommLedger:
    """Bits on the wire, summed over clients, kept apart for the two exchange frequencies
    (inner estimates every iteration, models every I iterations)."""

    inner_uplink_bits: int = 0
    inner_downlink_bits: int = 0
    model_uplink_bits: int = 0
    model_downlink_bits: int = 0
    inner_exchanges: int = 0
    model_rounds: int = 0

    @property
    def uplink_bits(self) -> int:
        return self.inner_uplink_bits + self.model_uplink_bits


LearningRate = float | Callable[[int], float]


class CompositionalSimulation:
    """Run a :class:`FedDRO` configuration on a :class:`CompositeProblem`, one iteration per :meth:`step`.

    ``lr``: a constant or a function of the iteration t. ``x0``: the shared initial model (default: the
    problem's seeded init). ``y_init``: ȳ_init ``[d_g]`` (default: one extra all-reduce of a fresh
    minibatch per client at x0; each client keeps its own value instead when y is never shared or when
    β = 1 makes y^{−1} irrelevant). ``seed`` feeds :class:`horizontal.engine.Streams` (same initial model as
    the engine for the same seed)."""

    def __init__(self, algorithm: FedDRO, problem: CompositeProblem, lr: LearningRate, *, seed: int = 0,
                 x0: torch.Tensor | None = None, y_init: torch.Tensor | None = None) -> None:
        if not callable(lr) and not (lr > 0 and math.isfinite(lr)):
            raise ValueError(f"lr must be a positive finite number or a schedule, got {lr}")
        self.algorithm = algorithm
        self.problem = problem
        self.lr = lr
        streams = Streams.from_seed(seed, problem.n_clients)
        self.generator = streams.data
        x0 = problem.init(streams.init) if x0 is None else x0
        if x0.shape != (problem.dim,):
            raise ValueError(f"x0 must have shape ({problem.dim},), got {tuple(x0.shape)}")
        K = problem.n_clients
        self.ledger = CommLedger()
        X = x0.detach().expand(K, -1).clone()
        if y_init is not None:
            if y_init.shape != (problem.d_g,):
                raise ValueError(f"y_init must have shape ({problem.d_g},), got {tuple(y_init.shape)}")
            Y0 = y_init.to(FLOAT).expand(K, -1).clone()
        else:
            local = problem.inner_values(X, problem.sample(self.generator)).to(FLOAT)
            shared = algorithm.shares_initial_inner()
            Y0 = self._all_reduce_inner(local).expand(K, -1).clone() if shared else local
        self.state = FedDROState(X, X.clone(), Y0)
        self.iteration = 0

    def _all_reduce_inner(self, local: torch.Tensor) -> torch.Tensor:
        """The server's mean of the clients' inner estimates; counts the real payloads both ways."""
        local = local.to(FLOAT)
        mean = local.mean(0)
        K = local.shape[0]
        self.ledger.inner_uplink_bits += sum(wire_bits(local[k]) for k in range(K))
        self.ledger.inner_downlink_bits += K * wire_bits(mean)
        self.ledger.inner_exchanges += 1
        return mean

    def _average_models(self, X: torch.Tensor) -> torch.Tensor:
        K = X.shape[0]
        mean = X.mean(0)
        self.ledger.model_uplink_bits += sum(wire_bits(X[k]) for k in range(K))
        self.ledger.model_downlink_bits += K * wire_bits(mean)
        self.ledger.model_rounds += 1
        return mean.expand(K, -1).clone()

    def current_lr(self) -> float:
        return float(self.lr(self.iteration)) if callable(self.lr) else float(self.lr)

    def step(self) -> dict[str, float]:
        """One iteration t for all clients (steps 1–5 of the module docstring)."""
        alg, problem, state, t = self.algorithm, self.problem, self.state, self.iteration
        batch = problem.sample(self.generator)
        if alg.independent_grad_batch:
            current = problem.inner_values(state.x, batch)
            evaluation = problem.evaluate(state.x, problem.sample(self.generator))
        else:
            evaluation = problem.evaluate(state.x, batch)
            current = evaluation.inner
        if t == 0 and alg.init == "skip":
            y_local = state.y_used
        else:
            previous = problem.inner_values(state.x_prev, batch)
            y_local = (1 - alg.beta) * (state.y_used - previous.to(FLOAT)) + current.to(FLOAT)
        y_used = y_local
        if alg.shares_inner(t):
            y_used = self._all_reduce_inner(y_local).expand_as(y_local).clone()
        lr = self.current_lr()
        grad = evaluation.gradient(problem.grad_f(y_used))
        x_next = state.x - lr * grad.to(state.x.dtype)
        synced = alg.averages_models(t)
        if synced:
            x_next = self._average_models(x_next)
        if not bool(torch.isfinite(x_next).all()):
            raise FloatingPointError(f"{alg.label}: models became non-finite at iteration {t} (diverged): "
                                     f"lower the learning rate (now {lr})")
        self.state = FedDROState(x_next, state.x, y_used)
        self.iteration += 1
        return {"iteration": self.iteration, "model_rounds": self.ledger.model_rounds, "lr": lr,
                "synced": float(synced), "ybar": float(y_used[:, 0].mean())}

    def run(self, iterations: int) -> list[dict[str, float]]:
        if iterations < 0:
            raise ValueError(f"iterations must be >= 0, got {iterations}")
        return [self.step() for _ in range(iterations)]

    def model(self) -> torch.Tensor:
        """x̄ = (1/K)Σ_k x_k: the shared model right after a model round (a virtual average mid-round)."""
        return self.state.x.mean(0)

    def uplink_bits_per_client_round(self) -> float:
        """Mean uplink bits one client sent per model round so far (inner estimates + its model)."""
        rounds = max(self.ledger.model_rounds, 1)
        return self.ledger.uplink_bits / (self.problem.n_clients * rounds)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bitwise: models, previous points, inner estimates,
        the iteration (lr-schedule position), the minibatch stream and the ledger."""
        return {"state": self.state.clone().tensors(), "iteration": self.iteration,
                "generator": self.generator.get_state(), "ledger": asdict(self.ledger)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.state = FedDROState(**{k: v.clone() for k, v in saved["state"].items()})
        self.iteration = int(saved["iteration"])
        self.generator.set_state(saved["generator"])
        self.ledger = CommLedger(**saved["ledger"])


@dataclass
class StepDecay:
    """η^t = lr for t < milestone, lr·factor afterwards (the paper divides by 10 once)."""

    lr: float
    milestone: int
    factor: float = 0.1

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)) or self.milestone < 0 or not 0 < self.factor <= 1:
            raise ValueError(f"need lr > 0, milestone >= 0 and factor in (0, 1], got {self}")

    def __call__(self, t: int) -> float:
        return self.lr if t < self.milestone else self.lr * self.factor
