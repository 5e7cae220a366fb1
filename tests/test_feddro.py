"""FedDRO and vanilla FedAvg for compositional optimisation: exact identities on closed-form problems, the
bias of FedAvg-CO under heterogeneity, the inner estimator's variance, the DRO objectives, the
communication ledger, resume, and the paper's -ST construction. Float64 throughout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from horizontal.data import FederatedData
from horizontal.dro_objectives import (
    ERM,
    KLDRO,
    AffineBatch,
    AffineInnerProblem,
    Chi2DRO,
    p1_problem,
    p2_problem,
)
from horizontal.feddro import CompositionalSimulation, FedDRO, FederatedDRO, StepDecay
from horizontal.models import small_cnn
from horizontal.models import torch_mlp as mlp
from horizontal.partitions import imbalanced_st_indices, shard_partition
from tests.conftest import requires_dataset

P2_X0 = torch.tensor([2.0, 2.0], dtype=torch.float64)
ROWS = 10


def sync_points(sim: CompositionalSimulation, iterations: int) -> list[torch.Tensor]:
    """x̄ right after every model round."""
    out = []
    for _ in range(iterations):
        if sim.step()["synced"]:
            out.append(sim.model().clone())
    return out


def exact_init(problem: AffineInnerProblem, x0: torch.Tensor) -> torch.Tensor:
    return problem.A_mean @ x0 + problem.c.mean(0)


# ------------------------------------------------------------------------ exact identities (σ = 0)


@pytest.mark.parametrize("beta", [0.3, 1.0])
def test_inner_estimate_tracks_the_average_of_local_inner_values_across_syncs(beta):
    problem = p2_problem()
    sim = CompositionalSimulation(FedDRO(period=3, beta=beta), problem, 0.05, x0=P2_X0,
                                  y_init=exact_init(problem, P2_X0))
    for _ in range(12):
        sim.step()
        points = sim.state.x_prev                             # where this step's ȳ was estimated
        G = (torch.einsum("kgd,kd->kg", problem.A, points) + problem.c).mean(0)
        torch.testing.assert_close(sim.state.y_used[0], G, rtol=0, atol=1e-12)
        assert torch.equal(sim.state.y_used, sim.state.y_used[:1].expand_as(sim.state.y_used))


@pytest.mark.parametrize("make_problem", [p1_problem, p2_problem])
def test_feddro_with_period_one_is_gradient_descent_on_phi(make_problem):
    problem = make_problem()
    x0 = torch.full((problem.dim,), 1.5, dtype=torch.float64)
    sim = CompositionalSimulation(FedDRO(period=1, beta=0.2), problem, 0.1, x0=x0,
                                  y_init=exact_init(problem, x0))
    x = x0.clone()
    for _ in range(30):
        x = x - 0.1 * problem.grad_phi(x)
        sim.step()
        torch.testing.assert_close(sim.model(), x, rtol=0, atol=1e-12)


def test_case_two_with_period_one_is_gd_on_phi_and_case_one_is_gd_on_phi_nd():
    problem = p2_problem()
    case_one = CompositionalSimulation(FedDRO.fedavg_co("I", 1), problem, 0.05, x0=P2_X0)
    case_two = CompositionalSimulation(FedDRO.fedavg_co("II", 1), problem, 0.05, x0=P2_X0)
    x_nd, x = P2_X0.clone(), P2_X0.clone()
    for _ in range(30):
        x_nd = x_nd - 0.05 * problem.grad_phi_nd(x_nd)
        x = x - 0.05 * problem.grad_phi(x)
        case_one.step()
        case_two.step()
        torch.testing.assert_close(case_one.model(), x_nd, rtol=0, atol=1e-12)
        torch.testing.assert_close(case_two.model(), x, rtol=0, atol=1e-12)


def algorithm_one_reference(problem: AffineInnerProblem, x0: torch.Tensor, eta: float, period: int,
                            iterations: int, case: str) -> list[np.ndarray]:
    """Algorithm 1 written out independently, numpy, client by client; Case I in its proof
    version (after averaging a client uses g_k(x̄))."""
    A, c, mu = problem.A.numpy(), problem.c.numpy(), problem.mu

    def grad_f(y: np.ndarray) -> np.ndarray:
        return y / math.sqrt(float(y @ y) + mu ** 2)

    K = A.shape[0]
    x = [x0.numpy().copy() for _ in range(K)]
    y = [A[k] @ x[k] + c[k] for k in range(K)]
    if case == "II":
        y = [np.mean(y, axis=0)] * K
    synced = []
    for t in range(iterations):
        x = [x[k] - eta * A[k].T @ grad_f(y[k]) for k in range(K)]
        y = [A[k] @ x[k] + c[k] for k in range(K)]
        if (t + 1) % period == 0:
            x_bar = np.mean(x, axis=0)
            x = [x_bar.copy() for _ in range(K)]
            y = [A[k] @ x_bar + c[k] for k in range(K)]
            if case == "II":
                y = [np.mean(y, axis=0)] * K
            synced.append(x_bar)
    return synced


@pytest.mark.parametrize("case", ["I", "II"])
def test_ablation_switch_reproduces_an_independent_algorithm_one(case):
    problem = p2_problem()
    sim = CompositionalSimulation(FedDRO.fedavg_co(case, 3), problem, 0.05, x0=P2_X0)
    ours = sync_points(sim, 60)
    reference = algorithm_one_reference(problem, P2_X0, 0.05, 3, 60, case)
    np.testing.assert_allclose(np.stack([x.numpy() for x in ours]), np.stack(reference), rtol=0, atol=1e-12)


def test_sync_timing_and_previous_point_is_never_averaged():
    problem = p2_problem()
    sim = CompositionalSimulation(FedDRO(period=3, beta=0.5), problem, 0.05, x0=P2_X0)
    for t in range(9):
        before = sim.state.x.clone()
        record = sim.step()
        assert record["synced"] == float((t + 1) % 3 == 0)
        rows_equal = bool((sim.state.x == sim.state.x[:1]).all())
        assert rows_equal == ((t + 1) % 3 == 0)
        assert torch.equal(sim.state.x_prev, before)      # x_k^t, pre-step, not the average
    assert sim.ledger.model_rounds == 3


# ------------------------------------------------------ P1 / P2: FedDRO converges, FedAvg-CO is biased


def test_p1_counterexample_fedavg_co_stays_above_half_feddro_converges():
    problem, eta, x0 = p1_problem(), 0.1, torch.tensor([0.5], dtype=torch.float64)
    iterations = 2000                                             # 200 / η
    finals = {}
    for name, alg in {"I": FedDRO.fedavg_co("I", 2), "II": FedDRO.fedavg_co("II", 2),
                      "feddro": FedDRO(period=2, beta=0.3)}.items():
        y_init = exact_init(problem, x0) if name == "feddro" else None
        synced = sync_points(CompositionalSimulation(alg, problem, eta, x0=x0, y_init=y_init), iterations)
        finals[name] = float(synced[-1][0])
        if name != "feddro":
            assert min(float(x[0]) for x in synced) >= 0.5           # Theorem 4.1
    assert finals["I"] == pytest.approx(1.24229, abs=1e-4)           # independent reference (proof version)
    assert finals["II"] == pytest.approx(1.21828, abs=1e-4)
    assert abs(finals["feddro"]) < 1e-10


@pytest.mark.parametrize("period", [1, 2, 5])
def test_p2_feddro_reaches_x_star_for_exact_and_zero_inner_init(period):
    problem = p2_problem()
    x_star = problem.x_star()
    torch.testing.assert_close(x_star, torch.tensor([0.0, -1.0], dtype=torch.float64))
    for y_init in (exact_init(problem, P2_X0), torch.zeros(2, dtype=torch.float64)):
        sim = CompositionalSimulation(FedDRO(period=period, beta=0.3), problem, 0.05, x0=P2_X0, y_init=y_init)
        sim.run(2000)
        assert float((sim.model() - x_star).norm()) < 1e-8


@pytest.mark.parametrize(("case", "expected"), [("I", (1.02078, -0.39411)), ("II", (0.83068, -0.80271))])
def test_p2_fedavg_co_settles_at_the_biased_points(case, expected):
    problem = p2_problem()
    sim = CompositionalSimulation(FedDRO.fedavg_co(case, 2), problem, 0.05, x0=P2_X0)
    sim.run(2000)
    x = sim.model()
    np.testing.assert_allclose(x.numpy(), expected, atol=1e-4)       # independent reference, η = .05, I = 2
    assert float((x - problem.x_star()).norm()) > 0.3
    assert float(problem.grad_phi(x).norm()) > 0.3


def test_p2_drift_feddro_bias_is_first_order_in_the_step_size():
    problem = p2_problem(drift=True)
    x_star = torch.tensor([0.0, -1.0], dtype=torch.float64)
    errors = {}
    for eta in (0.02, 0.01):
        sim = CompositionalSimulation(FedDRO(period=2, beta=0.5), problem, eta, x0=x_star,
                                      y_init=exact_init(problem, x_star))
        sim.run(int(20 / eta))
        errors[eta] = sim.model() - x_star
    ratio = float(errors[0.02].norm() / errors[0.01].norm())
    assert 1.9 <= ratio <= 2.1                                       # halving η halves FedDRO's drift
    np.testing.assert_allclose(errors[0.01].numpy(), (0.00888, 0.00378), atol=2e-4)   # ≈ η(I−1)/2·(1.75, .75)


# ---------------------------------------------------------------------- stochastic inner estimator (8)


class FreshBatchAtOldPoint(AffineInnerProblem):
    """The classic bug: evaluating g_k(x_k^{t−1}) on a *fresh* batch instead of this step's batch."""

    def __init__(self, base: AffineInnerProblem, generator: torch.Generator) -> None:
        super().__init__(base.A, base.c, base.mu, base.v, base.noise_std, base.jac_noise_std, base.batch_size)
        self._generator = generator

    def inner_values(self, X: torch.Tensor, batch: AffineBatch) -> torch.Tensor:
        return super().inner_values(X, self.sample(self._generator))


@pytest.mark.parametrize("buggy", [False, True])
def test_inner_estimator_variance_matches_theory_and_detects_a_fresh_batch_bug(buggy):
    beta, K, iterations = 0.5, 4, 3000
    problem = p2_problem(noise_std=1.0)
    if buggy:
        problem = FreshBatchAtOldPoint(problem, torch.Generator().manual_seed(1))
    sim = CompositionalSimulation(FedDRO(period=2, beta=beta), problem, 0.01, x0=P2_X0, seed=3)
    errors = []
    for t in range(iterations):
        sim.step()
        G = (torch.einsum("kgd,kd->kg", problem.A, sim.state.x_prev) + problem.c).mean(0)
        if t >= 50:
            errors.append(sim.state.y_used[0] - G)
    variance = float(torch.stack(errors).var(dim=0).mean())
    same_batch = beta / ((2 - beta) * K)                          # β σ² / ((2 − β) K |b|)
    if buggy:
        assert variance > 3 * same_batch                # ((1−β)² + 1)/(β(2−β)K|b|): 5x larger at β = 0.5
    else:
        assert variance == pytest.approx(same_batch, rel=0.1)      # ~4 standard errors


def test_beta_one_inner_estimate_is_the_plain_minibatch_mean():
    problem = p2_problem(noise_std=1.0, batch_size=3)
    seen: list[AffineBatch] = []
    original = problem.sample

    def spy(generator: torch.Generator) -> AffineBatch:
        seen.append(original(generator))
        return seen[-1]

    problem.sample = spy  # type: ignore[method-assign]
    sim = CompositionalSimulation(FedDRO.mbsgd(), problem, 0.05, x0=P2_X0)
    for _ in range(5):
        sim.step()
        batch = seen[-1]
        expected = (torch.einsum("kgd,kd->kg", problem.A, sim.state.x_prev) + problem.c
                    + batch.value_noise.mean(1)).mean(0)
        torch.testing.assert_close(sim.state.y_used[0], expected, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------- DRO objectives


def tiny_classification(seed: int = 0, n: int = 48, p: int = 5, classes: int = 3):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, p))
    y = rng.integers(0, classes, size=n)
    X[np.arange(n), y] += 0.5                                    # learnable, far from separable
    return X, y


def test_kl_gradient_is_the_softmax_weighted_loss_gradient_and_shift_invariant():
    X, y = tiny_classification()
    model = mlp(5, (), 3)
    data = FederatedData.from_partition(X, y, [np.arange(48)], dtype=torch.float64)
    w = model.init(torch.Generator().manual_seed(0), torch.float64)
    Xt, yt = torch.as_tensor(X), torch.as_tensor(y)
    for lam, scaled in ((0.5, True), (0.5, False), (2.0, True)):
        w_leaf = w.clone().requires_grad_(True)
        losses = model.per_sample_losses(w_leaf.unsqueeze(0), Xt.unsqueeze(0), yt.unsqueeze(0))[0]
        dro = lam * (torch.logsumexp(losses / lam, 0) - math.log(48))
        expected = torch.autograd.grad(dro if scaled else dro / lam, w_leaf)[0]
        gradients = []
        for shift in (0.0, 3.0):
            problem = FederatedDRO(model, KLDRO(lam, scale_by_lambda=scaled, shift=shift), data, None)
            evaluation = problem.evaluate(w.unsqueeze(0), problem.sample(torch.Generator()))
            gradients.append(evaluation.gradient(problem.grad_f(evaluation.inner))[0])
        torch.testing.assert_close(gradients[0], expected, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(gradients[1], gradients[0], rtol=1e-9, atol=1e-12)
        # λ·log-mean-exp is the KL-penalised inner maximum, attained at p = softmax(ℓ/λ)
        p = torch.softmax(losses.detach() / lam, 0)
        dual = float(p @ losses.detach() - lam * (p * torch.log(48 * p)).sum())
        assert KLDRO(lam).value([losses.detach()]) == pytest.approx(dual, rel=1e-12)


def simplex_projection(v: np.ndarray) -> np.ndarray:
    u = np.sort(v)[::-1]
    css = np.cumsum(u) - 1
    rho = np.nonzero(u - css / np.arange(1, v.size + 1) > 0)[0][-1]
    return np.maximum(v - css[rho] / (rho + 1), 0)


def chi2_inner_maximum(losses: np.ndarray, lam: float) -> float:
    """max_{p ∈ simplex} Σ p ℓ − λ (m/2) Σ (p − 1/m)², by projected gradient ascent."""
    m = losses.size
    p = np.full(m, 1 / m)
    for _ in range(5000):
        p = simplex_projection(p + (losses - lam * m * (p - 1 / m)) / (lam * m))
    return float(p @ losses - lam * m / 2 * np.sum((p - 1 / m) ** 2))


def test_chi2_corrected_form_is_the_dro_value_and_the_printed_form_is_not():
    losses = np.array([0.3, 1.2, 0.8, 2.0, 0.1])
    lam = 5.0                                                    # every optimal weight stays ≥ 0
    value = Chi2DRO(lam).value([torch.as_tensor(losses)])
    assert value == pytest.approx(chi2_inner_maximum(losses, lam), abs=1e-8)
    printed_eq5 = -np.mean(losses ** 2) / (2 * lam) + np.mean(losses) ** 2 / (2 * lam)
    assert printed_eq5 == pytest.approx(-np.var(losses) / (2 * lam))
    assert abs(printed_eq5 - value) > 0.5
    # small λ: the simplex constraint binds, the closed form overshoots, and negative weights are counted
    objective = Chi2DRO(0.2)
    assert objective.value([torch.as_tensor(losses)]) > chi2_inner_maximum(losses, 0.2) + 1e-3
    weights = objective.sample_weights(torch.as_tensor(losses)[None], objective.grad_f(
        torch.tensor([[losses.mean()]])))
    assert bool((weights < 0).any()) and objective.diagnostics()["negative_weight_fraction"] > 0


def test_kl_grad_f_clamps_below_the_floor_and_counts():
    objective = KLDRO(1.0, shift=0.0)
    s = objective.grad_f(torch.tensor([[-0.5], [0.5], [2.0]], dtype=torch.float64))
    torch.testing.assert_close(s, torch.tensor([[1.0], [1.0], [0.5]], dtype=torch.float64))
    assert objective.diagnostics()["grad_f_clamps"] == 2
    with pytest.raises(FloatingPointError, match="overflowed"):
        objective.inner(torch.tensor([1000.0]))


def label_skewed_problem(objective, batch_size=None, dtype=torch.float64):
    """Four clients holding one class each (ROWS rows: equal sizes for full batches)."""
    X, y = tiny_classification(n=64, classes=4)
    parts = [p[:ROWS] for p in shard_partition(y, 4, 1, np.random.default_rng(0))]
    data = FederatedData.from_partition(X, y, parts, dtype=dtype)
    return FederatedDRO(mlp(5, (), 4), objective, data, batch_size)


def test_federated_kl_full_batch_feddro_is_centralised_gd_and_case_one_solves_local_dro():
    """Label-skewed clients, KL-DRO (λ = 1), I = 1, full batches: FedDRO is gradient descent on the
    global λ log((1/K)Σ_k g_k); FedAvg-CO Case I is gradient descent on the *local* DRO
    (1/K)Σ_k λ log g_k, a different problem whose solution is far from stationary for the global one."""
    problem = label_skewed_problem(KLDRO(1.0))
    x0 = problem.init(torch.Generator().manual_seed(0))

    def client_log_means(w: torch.Tensor) -> torch.Tensor:        # log g_k(w), [K]
        losses = problem.model.per_sample_losses(w.expand(4, -1), problem.data.X.view(4, ROWS, 5),
                                                 problem.data.y.view(4, ROWS))
        return torch.logsumexp(losses, 1) - math.log(ROWS)

    def phi(w: torch.Tensor) -> torch.Tensor:
        return torch.logsumexp(client_log_means(w), 0) - math.log(4)

    def local_dro(w: torch.Tensor) -> torch.Tensor:
        return client_log_means(w).mean()

    def grad(fn, w: torch.Tensor) -> torch.Tensor:
        leaf = w.clone().requires_grad_(True)
        return torch.autograd.grad(fn(leaf), leaf)[0]

    feddro = CompositionalSimulation(FedDRO(period=1, beta=0.5), problem, 0.5, x0=x0)
    case_one = CompositionalSimulation(FedDRO.fedavg_co("I", 1), problem, 0.5, x0=x0)
    x, x_local = x0.clone(), x0.clone()
    for _ in range(20):
        x, x_local = x - 0.5 * grad(phi, x), x_local - 0.5 * grad(local_dro, x_local)
        feddro.step()
        case_one.step()
        torch.testing.assert_close(feddro.model(), x, rtol=0, atol=1e-10)
        torch.testing.assert_close(case_one.model(), x_local, rtol=0, atol=1e-10)
    feddro.run(200)
    case_one.run(200)
    assert float(grad(phi, feddro.model()).norm()) < 1e-3            # measured 5e-5
    assert float(grad(phi, case_one.model()).norm()) > 0.05          # measured 0.060, and not moving
    assert float(phi(case_one.model())) > float(phi(feddro.model())) + 1e-3


def test_independent_gradient_batch_and_skip_init_still_converge_on_p2():
    problem = p2_problem()
    for alg in (FedDRO(period=2, beta=0.5, independent_grad_batch=True), FedDRO(2, 0.5, init="skip")):
        sim = CompositionalSimulation(alg, problem, 0.05, x0=P2_X0)
        sim.run(2000)
        assert float((sim.model() - problem.x_star()).norm()) < 1e-8


# ------------------------------------------------------------------------ ledger, resume, validation


def test_ledger_counts_real_payloads_at_two_frequencies():
    problem = label_skewed_problem(KLDRO(1.0), batch_size=4, dtype=torch.float32)   # models in float32
    K, d, period, iterations = 4, problem.dim, 4, 12
    sim = CompositionalSimulation(FedDRO(period=period, beta=0.1), problem, 0.1)
    sim.run(iterations)
    ledger = sim.ledger
    assert ledger.model_rounds == iterations // period
    assert ledger.inner_exchanges == iterations + 1               # one per iteration + the init
    assert ledger.inner_uplink_bits == K * 64 * (iterations + 1)  # one float64 per client
    assert ledger.model_uplink_bits == K * 32 * d * ledger.model_rounds
    assert ledger.model_downlink_bits == ledger.model_uplink_bits
    assert sim.uplink_bits_per_client_round() == pytest.approx(32 * d + 64 * (iterations + 1) / 3)
    case_one = CompositionalSimulation(FedDRO.fedavg_co("I", period), problem, 0.1)
    case_one.run(iterations)
    assert case_one.ledger.inner_uplink_bits == 0                 # Case I never shares the inner value


def test_resume_reproduces_the_trajectory_bitwise():
    problem = label_skewed_problem(KLDRO(1.0), batch_size=5)
    sim = CompositionalSimulation(FedDRO(period=3, beta=0.3), problem, StepDecay(0.3, 8))
    sim.run(7)
    saved = sim.state_dict()
    sim.run(6)
    expected = sim.state.clone()
    sim.load_state_dict(saved)
    sim.run(6)
    assert sim.state.max_abs_diff(expected) == 0.0
    assert sim.current_lr() == pytest.approx(0.03)


def test_validation_errors_are_clear():
    with pytest.raises(ValueError, match="beta"):
        FedDRO(beta=0.0)
    with pytest.raises(ValueError, match="period"):
        FedDRO(period=0)
    with pytest.raises(ValueError, match="y_sync"):
        FedDRO(y_sync="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="y_init"):
        CompositionalSimulation(FedDRO(), p2_problem(), 0.1, y_init=torch.zeros(3))
    with pytest.raises(ValueError, match="lr"):
        CompositionalSimulation(FedDRO(), p2_problem(), -1.0)
    with pytest.raises(ValueError, match="lambda"):
        KLDRO(0.0)
    X, y = tiny_classification()
    data = FederatedData.from_partition(X, y, [np.arange(48)], dtype=torch.float64)
    with pytest.raises(ValueError, match="features"):
        FederatedDRO(mlp(4, (), 3), ERM(), data, 8)
    with pytest.raises(ValueError, match="labels"):
        FederatedDRO(mlp(5, (), 2), ERM(), data, 8)
    with pytest.raises(FloatingPointError, match="overflowed"):      # a clear error, never silent NaNs
        CompositionalSimulation(FedDRO(), label_skewed_problem(KLDRO(0.1), batch_size=4), 1e4).run(20)


def test_erm_objective_trains_like_plain_parallel_sgd():
    problem = label_skewed_problem(ERM())
    x0 = problem.init(torch.Generator().manual_seed(0))
    sim = CompositionalSimulation(FedDRO.mbsgd(), problem, 0.5, x0=x0)
    sim.run(3)
    x = x0.clone()
    for _ in range(3):
        leaf = x.clone().requires_grad_(True)
        losses = problem.model.per_sample_losses(leaf.expand(4, -1), problem.data.X.view(4, ROWS, 5),
                                                 problem.data.y.view(4, ROWS))
        x = x - 0.5 * torch.autograd.grad(losses.mean(), leaf)[0]
    torch.testing.assert_close(sim.model(), x, rtol=0, atol=1e-12)


def test_small_cnn_matches_the_spec_size_and_batches_clients():
    model = small_cnn()
    assert model.dim == 18_378
    W = torch.stack([model.init(torch.Generator().manual_seed(s)) for s in (0, 1)])
    X = torch.rand(2, 3, 784, generator=torch.Generator().manual_seed(2))
    y = torch.tensor([[0, 1, 2], [3, 4, 5]])
    batched = model.per_sample_losses(W, X, y)
    for k in range(2):
        single, _ = model.losses_and_predictions(W[k], X[k], y[k])
        torch.testing.assert_close(batched[k], single, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------ the -ST split


def test_st_indices_keep_the_last_rows_of_the_first_half_of_the_classes():
    labels = np.array([0, 1, 0, 2, 3, 0, 1, 1, 2, 3, 0, 1])
    kept = imbalanced_st_indices(labels, n_keep=2)
    # classes 0 and 1 keep their last 2 rows (0: rows 5, 10; 1: rows 7, 11); classes 2, 3 keep all
    np.testing.assert_array_equal(kept, [3, 4, 5, 7, 8, 9, 10, 11])
    with pytest.raises(ValueError, match="fewer than n_keep"):
        imbalanced_st_indices(labels, n_keep=5)


@pytest.mark.data
@requires_dataset("fashion-mnist")
def test_fashion_mnist_st_has_the_paper_construction():
    from horizontal.partitions import iid_partition
    from vertical.datasets import load
    ds = load("fashion-mnist")
    kept = imbalanced_st_indices(ds.y_train)
    counts = np.bincount(ds.y_train[kept], minlength=10)
    np.testing.assert_array_equal(counts, [100] * 5 + [6000] * 5)
    for cls in range(5):
        rows = np.flatnonzero(ds.y_train == cls)
        np.testing.assert_array_equal(kept[ds.y_train[kept] == cls], rows[-100:])
    sizes = sorted(len(p) for p in iid_partition(kept.size, 8, np.random.default_rng(0)))
    assert sizes == [3812] * 4 + [3813] * 4
    assert np.bincount(ds.y_test).tolist() == [1000] * 10


# ------------------------------------------------------------------------ the --quick experiments


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory) -> tuple[object, object]:
    from experiments import feddro_fmnist, feddro_toy
    out = tmp_path_factory.mktemp("feddro-quick")
    assert feddro_toy.main(["--quick", "--out", str(out)]) == 0
    assert feddro_fmnist.main(["--quick", "--out", str(out)]) == 0
    return out, feddro_fmnist


def test_quick_toy_experiment_shows_the_bias_of_fedavg_co(quick_runs):
    import json
    out, _ = quick_runs
    assert (out / "toy_p1.png").stat().st_size > 0 and "| P2 |" in (out / "toy_table.md").read_text()
    results = json.loads((out / "toy_results.json").read_text())
    for key, entry in results["p2"].items():
        if key.startswith("FedDRO"):
            assert entry["distance_to_x_star"] < 1e-8
        else:
            assert entry["distance_to_x_star"] > 0.3
            np.testing.assert_allclose(entry["final"], entry["reference"], atol=1e-4)
    assert all(e["min_over_rounds"] >= 0.5 for k, e in results["p1"].items() if "Case" in k)


def test_quick_image_experiment_writes_every_table_plot_and_measured_bits(quick_runs):
    import csv
    import json
    out, module = quick_runs
    for name in ("summary.json", "results.md", "main.csv", "period.csv", "clients.csv", "ablation.csv",
                 "main.png", "period.png"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    d = module.torch_mlp(64, module.QUICK.hidden, 10).dim
    finals = summary["main"]["finals"]
    mbsgd = finals["MBSGD-CO (parallel)"][0]
    assert mbsgd["uplink_bits_per_client_round"] == 32 * d + 64           # model + one float64 per round
    feddro = finals[f"FedDRO (I=1, β={module.QUICK.beta})"][0]
    T = module.QUICK.main_iterations
    assert feddro["uplink_bits_per_client_round"] == pytest.approx(32 * d + 64 * (T + 1) / T)
    for runs in finals.values():
        assert 0.0 <= runs[0]["test_accuracy"] <= 1.0 and 0.0 <= runs[0]["train_accuracy"] <= 1.0
    assert feddro["train_kl_dro"] < finals["ERM-SGD (parallel, not DRO)"][0]["train_kl_dro"]
    with (out / "main.csv").open() as fh:
        rows = [r for r in csv.DictReader(fh) if r["method"].startswith("FedDRO")]
    assert float(rows[-1]["train_kl_dro"]) < float(rows[0]["train_kl_dro"]) - 0.3   # it learns
    text = (out / "results.md").read_text()
    assert text.count("### ") == 5 and "label-skew" in text
    # the λ × β sweep: MBSGD-CO is FedDRO with β = 1, so its row and FedDRO's share every other setting
    with (out / "sweep.csv").open() as fh:
        sweep = list(csv.DictReader(fh))
    assert {float(r["beta"]) for r in sweep} == {0.1, 1.0} and "MBSGD-CO (= FedDRO β=1)" in text
