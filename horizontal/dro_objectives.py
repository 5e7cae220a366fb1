"""Compositional objectives Φ(x) = h(x) + f(g(x)) of FedDRO (Khanduri et al.).

Federated form (paper eq. (2)): K clients, h = (1/K)Σ_k h_k and g = (1/K)Σ_k g_k, f shared. A client can
evaluate its own h_k, g_k and their gradients, never g; that is what makes local compositional gradients
biased and what FedDRO's shared inner estimate ȳ repairs.

Two families live here:

* :class:`LossComposition`: the DRO objectives of the paper's Section 2.1, written through the per-sample
  loss ℓ = ℓ(x; ζ) with a *scalar* inner function (d_g = 1). A composition only maps losses to inner values
  g(ℓ), non-compositional terms h(ℓ) and their slopes, so any model that yields per-sample losses plugs in.
  The stochastic gradient (7) is then a weighted loss gradient Σ_j w_j ∇ℓ_j / |b| with
  w_j = h'(ℓ_j) + ∇f(ȳ)·g'(ℓ_j).

  - :class:`KLDRO`: KL-regularised DRO, g = exp((ℓ − c₀)/λ), f = λ·log(y) + c₀ (the exact dual value,
    ``scale_by_lambda=True``, default) or log(y) + c₀/λ (the paper's eq. (4), which drops the factor λ:
    same minimisers, gradients 1/λ times larger, i.e. a rescaled learning rate). The shift c₀ is a
    constant of the run (changing it mid-run would corrupt the recursion (8)); gradients do not depend on
    it. Because ℓ ≥ 0, g ≥ exp(−c₀/λ); ∇f is evaluated at max(ȳ, that floor) and each clamp is counted,
    while the unclamped ȳ stays the recursion state.
  - :class:`Chi2DRO`: χ²-regularised DRO in its **corrected** form (the paper's printed eq. (5) has the
    wrong sign and misses the mean loss: it equals −Var(ℓ)/(2λ)): h = ℓ + ℓ²/(2λ), g = ℓ,
    f(u) = −u²/(2λ). The closed form equals the DRO value only while every optimal weight
    1 + (ℓ_j − ℓ̄)/λ is ≥ 0; negative per-sample weights are counted.
  - :class:`ERM`: h = ℓ, g = 0, the plain empirical risk (a reference, not a paper baseline).

* :class:`AffineInnerProblem`: closed-form toy problems with g_k(x; ζ) = A_k x + c_k + ζ, optional linear
  h_k(x) = ⟨v_k, x⟩ and f(y) = √(‖y‖² + μ²), on which ∇Φ, x* and the biased fixed points are known:
  :func:`p1_problem` (the paper's Theorem 4.1 counterexample, eq. (10)), :func:`p2_problem` (its 2-D
  generalisation: four clients, heterogeneous Jacobians), with ``drift=True`` heterogeneous linear terms
  h_k that average to zero and with ``noise_std > 0`` noisy inner values. It implements the same
  two-phase problem protocol as the data-backed :class:`horizontal.feddro.FederatedDRO` (``sample`` →
  ``evaluate`` → ``Evaluation.gradient``), so the algorithms run unchanged on both.

Scalar arithmetic (g, ȳ, weights) is done in float64 whatever the model's dtype.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

FLOAT = torch.float64


class LossComposition(ABC):
    """A DRO objective with scalar inner function, written through per-sample losses (see module doc)."""

    name: str = "composition"
    d_g: int = 1

    def __init__(self) -> None:
        self.clamps = 0               # ∇f evaluations that had to clamp ȳ into the domain of f (KL)
        self.negative_weights = 0     # per-sample weights < 0 seen in gradients (χ², small λ)
        self.weights_seen = 0

    @abstractmethod
    def inner(self, loss: torch.Tensor) -> torch.Tensor:
        """g(ℓ), elementwise, float64."""

    @abstractmethod
    def inner_slope(self, loss: torch.Tensor) -> torch.Tensor:
        """dg/dℓ, elementwise, float64."""

    def outer(self, loss: torch.Tensor) -> torch.Tensor:
        """h(ℓ), the non-compositional part (default 0)."""
        return torch.zeros_like(loss, dtype=FLOAT)

    def outer_slope(self, loss: torch.Tensor) -> torch.Tensor:
        """dh/dℓ (default 0)."""
        return torch.zeros_like(loss, dtype=FLOAT)

    @abstractmethod
    def f(self, y: torch.Tensor) -> torch.Tensor:
        """Outer function on ``[..., 1]`` inner values; returns ``[...]``."""

    @abstractmethod
    def grad_f(self, y: torch.Tensor) -> torch.Tensor:
        """∇f on ``[..., 1]`` inner values (same shape)."""

    def sample_weights(self, loss: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """Per-sample weights w_j = h'(ℓ_j) + s·g'(ℓ_j) of ∇ℓ_j in eq. (7); ``loss [K, B]``, ``s [K, 1]``."""
        loss = loss.to(FLOAT)
        weights = self.outer_slope(loss) + s.to(FLOAT) * self.inner_slope(loss)
        self.weights_seen += weights.numel()
        self.negative_weights += int((weights < 0).sum())
        return weights

    def value(self, client_losses: Sequence[torch.Tensor]) -> float:
        """Federated objective Φ = (1/K)Σ_k mean h(ℓ) + f((1/K)Σ_k mean g(ℓ)) from each client's losses
        on its whole data set (clients weigh 1/K whatever their size, as in the paper's eq. (2))."""
        return self.value_from_summaries(torch.stack([self.client_summary(ell) for ell in client_losses]))

    def client_summary(self, losses: torch.Tensor) -> torch.Tensor:
        """What Φ needs from one client's losses, computed where the losses are: (mean h(ℓ), mean g(ℓ))."""
        return torch.stack([self.outer(losses.to(FLOAT)).mean(), self.inner(losses.to(FLOAT)).mean()])

    def value_from_summaries(self, summaries: torch.Tensor) -> float:
        """Φ from the clients' :meth:`client_summary` rows ``[K, m]`` (how a server computes it)."""
        h, g = (summaries[:, j].contiguous().mean() for j in range(2))   # value()'s summation order
        return float(h + self.f(g.reshape(1)))

    def diagnostics(self) -> dict[str, float]:
        """Counters for the logs: ȳ clamps inside ∇f, and the fraction of negative sample weights."""
        return {"grad_f_clamps": self.clamps,
                "negative_weight_fraction": self.negative_weights / max(self.weights_seen, 1)}

    def describe(self) -> dict[str, object]:
        return {"objective": self.name}


class KLDRO(LossComposition):
    """KL-regularised DRO, λ·log((1/m)Σ exp(ℓ_i/λ)) (or without the λ factor: paper eq. (4))."""

    name = "kl-dro"

    def __init__(self, lam: float = 1.0, *, scale_by_lambda: bool = True, shift: float = 0.0) -> None:
        super().__init__()
        if not (lam > 0 and math.isfinite(lam)):
            raise ValueError(f"KL-DRO needs a positive finite lambda, got {lam}")
        if not math.isfinite(shift):
            raise ValueError(f"KL-DRO shift c0 must be finite, got {shift}")
        self.lam = float(lam)
        self.scale_by_lambda = scale_by_lambda
        self.shift = float(shift)
        self.floor = math.exp(-self.shift / self.lam)      # g ≥ exp(−c₀/λ) because ℓ ≥ 0

    def inner(self, loss: torch.Tensor) -> torch.Tensor:
        values = torch.exp((loss.to(FLOAT) - self.shift) / self.lam)
        if not bool(torch.isfinite(values).all()):
            raise FloatingPointError(f"KL-DRO: exp((loss - c0)/lambda) overflowed (max loss "
                                     f"{float(loss.max()):.3g}, lambda={self.lam}): raise lambda or shift c0")
        return values

    def inner_slope(self, loss: torch.Tensor) -> torch.Tensor:
        return self.inner(loss) / self.lam

    @property
    def _scale(self) -> float:
        return self.lam if self.scale_by_lambda else 1.0

    def f(self, y: torch.Tensor) -> torch.Tensor:
        return self._scale * (torch.log(y.to(FLOAT).squeeze(-1)) + self.shift / self.lam)

    def grad_f(self, y: torch.Tensor) -> torch.Tensor:
        y = y.to(FLOAT)
        self.clamps += int((y < self.floor).sum())
        return self._scale / y.clamp_min(self.floor)

    def client_summary(self, losses: torch.Tensor) -> torch.Tensor:
        """log mean exp(ℓ/λ) of one client, a log-sum-exp so that large losses cannot overflow."""
        return (torch.logsumexp(losses.to(FLOAT) / self.lam, 0) - math.log(losses.numel())).reshape(1)

    def value_from_summaries(self, summaries: torch.Tensor) -> float:
        return self._scale * float(torch.logsumexp(summaries[:, 0], 0) - math.log(summaries.shape[0]))

    def describe(self) -> dict[str, object]:
        return {"objective": self.name, "lambda": self.lam, "kl_scale_by_lambda": self.scale_by_lambda,
                "shift_c0": self.shift}


class Chi2DRO(LossComposition):
    """χ²-regularised DRO, corrected closed form ℓ̄ + (1/(2λ))[(1/m)Σℓ² − ℓ̄²], not the
    paper's printed eq. (5) (wrong sign, no mean loss)."""

    name = "chi2-dro"

    def __init__(self, lam: float = 1.0) -> None:
        super().__init__()
        if not (lam > 0 and math.isfinite(lam)):
            raise ValueError(f"chi2-DRO needs a positive finite lambda, got {lam}")
        self.lam = float(lam)

    def inner(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.to(FLOAT)

    def inner_slope(self, loss: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(loss, dtype=FLOAT)

    def outer(self, loss: torch.Tensor) -> torch.Tensor:
        loss = loss.to(FLOAT)
        return loss + loss.square() / (2 * self.lam)

    def outer_slope(self, loss: torch.Tensor) -> torch.Tensor:
        return 1 + loss.to(FLOAT) / self.lam

    def f(self, y: torch.Tensor) -> torch.Tensor:
        return -y.to(FLOAT).squeeze(-1).square() / (2 * self.lam)

    def grad_f(self, y: torch.Tensor) -> torch.Tensor:
        return -y.to(FLOAT) / self.lam

    def describe(self) -> dict[str, object]:
        return {"objective": self.name, "lambda": self.lam}


class ERM(LossComposition):
    """Plain empirical risk (h = ℓ, g = f = 0): the non-robust reference trained by the same code."""

    name = "erm"

    def inner(self, loss: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(loss, dtype=FLOAT)

    def inner_slope(self, loss: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(loss, dtype=FLOAT)

    def outer(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.to(FLOAT)

    def outer_slope(self, loss: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(loss, dtype=FLOAT)

    def f(self, y: torch.Tensor) -> torch.Tensor:
        return torch.zeros(y.shape[:-1], dtype=FLOAT)

    def grad_f(self, y: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(y, dtype=FLOAT)


def make_objective(name: str, lam: float = 1.0) -> LossComposition:
    """A DRO objective by name: ``kl-dro`` and ``chi2-dro`` with their λ, or ``erm``."""
    if name == "kl-dro":
        return KLDRO(lam)
    if name == "chi2-dro":
        return Chi2DRO(lam)
    if name == "erm":
        return ERM()
    raise ValueError(f"unknown DRO objective {name!r}; choose one of {', '.join(DRO_OBJECTIVES)}")


DRO_OBJECTIVES = ("kl-dro", "chi2-dro", "erm")


# ----------------------------------------------------------------------------- closed-form toy problems


@dataclass(frozen=True)
class AffineEvaluation:
    """Inner values of all clients at their models on one batch, and the gradient (7) for any ∇f."""

    inner: torch.Tensor                  # [K, d_g]
    jacobians: torch.Tensor              # [K, d_g, d] (noisy when jac_noise_std > 0)
    linear: torch.Tensor                 # [K, d]: ∇h_k = v_k

    def gradient(self, s: torch.Tensor) -> torch.Tensor:
        """∇h_k + ∇g_kᵀ s_k for every client k (``s [K, d_g]``)."""
        return self.linear + torch.einsum("kgd,kg->kd", self.jacobians, s)


@dataclass(frozen=True)
class AffineBatch:
    """Additive noise ζ on the inner values (``[K, B, d_g]``) and on the Jacobians (``[K, d_g, d]``)."""

    value_noise: torch.Tensor | None
    jacobian_noise: torch.Tensor | None


@dataclass
class AffineInnerProblem:
    """g_k(x; ζ) = A_k x + c_k + ζ, h_k(x) = ⟨v_k, x⟩, f(y) = √(‖y‖² + μ²) (convex, B_f = 1, L_f = 1/μ).

    ``A [K, d_g, d]``, ``c [K, d_g]``, ``v [K, d]`` (zeros if omitted). With zero-mean v (h ≡ 0) the
    minimiser of Φ is the solution of Āx + c̄ = 0 (Ā square and invertible), see :meth:`x_star`.
    """

    A: torch.Tensor
    c: torch.Tensor
    mu: float = 2.0
    v: torch.Tensor | None = None
    noise_std: float = 0.0
    jac_noise_std: float = 0.0
    batch_size: int = 1

    def __post_init__(self) -> None:
        self.A, self.c = self.A.to(FLOAT), self.c.to(FLOAT)
        if self.A.ndim != 3 or self.c.shape != self.A.shape[:2]:
            raise ValueError(f"A must be [K, d_g, d] and c [K, d_g], got {tuple(self.A.shape)}, "
                             f"{tuple(self.c.shape)}")
        self.v = torch.zeros(self.n_clients, self.dim, dtype=FLOAT) if self.v is None else self.v.to(FLOAT)
        if self.v.shape != (self.n_clients, self.dim):
            raise ValueError(f"v must be [K, d] = {(self.n_clients, self.dim)}, got {tuple(self.v.shape)}")
        if self.mu <= 0 or self.noise_std < 0 or self.jac_noise_std < 0 or self.batch_size < 1:
            raise ValueError("need mu > 0, noise_std >= 0, jac_noise_std >= 0 and batch_size >= 1")

    @property
    def n_clients(self) -> int:
        return self.A.shape[0]

    @property
    def d_g(self) -> int:
        return self.A.shape[1]

    @property
    def dim(self) -> int:
        return self.A.shape[2]

    # -- the problem protocol used by horizontal.feddro
    def f(self, y: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(y.square().sum(-1) + self.mu ** 2)

    def grad_f(self, y: torch.Tensor) -> torch.Tensor:
        return y / torch.sqrt(y.square().sum(-1, keepdim=True) + self.mu ** 2)

    def sample(self, generator: torch.Generator) -> AffineBatch:
        K = self.n_clients
        values = (self.noise_std * torch.randn(K, self.batch_size, self.d_g, generator=generator, dtype=FLOAT)
                  if self.noise_std > 0 else None)
        jac = (self.jac_noise_std * torch.randn(K, self.d_g, self.dim, generator=generator, dtype=FLOAT)
               if self.jac_noise_std > 0 else None)
        return AffineBatch(values, jac)

    def inner_values(self, X: torch.Tensor, batch: AffineBatch) -> torch.Tensor:
        """(1/|b|)Σ_i g_k(x_k; ζ_i) for every client, ``[K, d_g]``."""
        values = torch.einsum("kgd,kd->kg", self.A, X) + self.c
        return values if batch.value_noise is None else values + batch.value_noise.mean(1)

    def evaluate(self, X: torch.Tensor, batch: AffineBatch) -> AffineEvaluation:
        jac = self.A if batch.jacobian_noise is None else self.A + batch.jacobian_noise
        return AffineEvaluation(self.inner_values(X, batch), jac, self.v)

    def init(self, generator: torch.Generator) -> torch.Tensor:
        return torch.zeros(self.dim, dtype=FLOAT)

    def diagnostics(self) -> dict[str, float]:
        return {}

    # -- closed forms
    @property
    def A_mean(self) -> torch.Tensor:
        return self.A.mean(0)

    def phi(self, x: torch.Tensor) -> float:
        """Φ(x) = f(Āx + c̄) + v̄·x."""
        return float(self.f(self.A_mean @ x + self.c.mean(0)) + self.v.mean(0) @ x)

    def grad_phi(self, x: torch.Tensor) -> torch.Tensor:
        return self.A_mean.T @ self.grad_f(self.A_mean @ x + self.c.mean(0)) + self.v.mean(0)

    def phi_nd(self, x: torch.Tensor) -> float:
        """Φ_ND(x) = (1/K)Σ_k f(g_k(x)) + v̄·x: what local plug-in gradients minimise (eq. (9))."""
        return float(self.f(torch.einsum("kgd,d->kg", self.A, x) + self.c).mean() + self.v.mean(0) @ x)

    def grad_phi_nd(self, x: torch.Tensor) -> torch.Tensor:
        inner = torch.einsum("kgd,d->kg", self.A, x) + self.c
        return torch.einsum("kgd,kg->d", self.A, self.grad_f(inner)) / self.n_clients + self.v.mean(0)

    def x_star(self) -> torch.Tensor:
        """argmin Φ when h ≡ 0: Āx* = −c̄ (f is minimised at y = 0)."""
        if float(self.v.mean(0).abs().max()) > 0:
            raise ValueError("x_star has a closed form only when the linear terms average to zero")
        return torch.linalg.solve(self.A_mean, -self.c.mean(0))


def p1_problem() -> AffineInnerProblem:
    """The paper's Theorem 4.1 counterexample (eq. (10)): K = 2, g₁ = 4x − 4, g₂ = −2x + 4, f = √(y² + 4);
    g(x) = x, Φ(x) = √(x² + 4), x* = 0, while the clients' own composite minimisers are 1 and 2."""
    return AffineInnerProblem(torch.tensor([[[4.0]], [[-2.0]]]), torch.tensor([[-4.0], [4.0]]), mu=2.0)


P2_A = ((((4.0, 0.0), (0.0, 1.0)), ((-2.0, 1.0), (0.0, 2.0)), ((1.0, 0.0), (1.0, -1.0)),
         ((1.0, -1.0), (-1.0, 2.0))))
P2_C = ((-4.0, 2.0), (4.0, -6.0), (2.0, 3.0), (-2.0, 5.0))
P2_DRIFT_V = ((1.0, 0.0), (-1.0, 1.0), (0.0, -1.0), (0.0, 0.0))


def p2_problem(*, drift: bool = False, noise_std: float = 0.0, jac_noise_std: float = 0.0,
               batch_size: int = 1) -> AffineInnerProblem:
    """P1 in 2-D: K = 4, d = d_g = 2, Ā = I, c̄ = (0, 1), x* = (0, −1), heterogeneous A_k and c_k.
    ``drift`` adds h_k = ⟨v_k, x⟩ with Σ v_k = 0; ``noise_std`` adds value noise ζ."""
    return AffineInnerProblem(torch.tensor(P2_A), torch.tensor(P2_C), mu=2.0,
                              v=torch.tensor(P2_DRIFT_V) if drift else None, noise_std=noise_std,
                              jac_noise_std=jac_noise_std, batch_size=batch_size)
