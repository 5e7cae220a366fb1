"""ISCA, ISCAM and FedPAQ: exact relations to SCAFFOLD and FedAvg and the identities of Algorithm 1's
inner loop (float64, seeded), the ledger, and behaviour on heterogeneous quadratics plus a Monte-Carlo
check of ISCAM's one-round unbiasedness."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from horizontal import (
    FedAvg,
    FederatedData,
    FederatedSimulation,
    FedPAQ,
    FLConfig,
    Isca,
    Iscam,
    LeastSquares,
    Scaffold,
    least_squares_optimum,
    make_algorithm,
)
from horizontal.base import Algorithm
from protocols.compression import get_compressor
from tests.test_hfl_algorithms import assert_same_trajectory

N_CLIENTS, ROWS, DIM = 8, 12, 5


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """These problems are tiny: torch's intra-op threads only add overhead (x60 on a loaded machine for a
    [3, 96, 5] batched product)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
DITHER2 = get_compressor("dithering", bits=2)
IDENTITY = get_compressor("identity")


def quadratics(heterogeneous: bool = True, seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Clients with their own feature scales and far-apart local optima (heterogeneous), or every client
    holding the union of that data (homogeneous: f_1 = ... = f_N)."""
    rng = np.random.default_rng(seed)
    X = np.concatenate([rng.normal(size=(ROWS, DIM)) * rng.uniform(0.3, 2.0, size=DIM)
                        for _ in range(N_CLIENTS)])
    local_optima = 5.0 * rng.normal(size=(N_CLIENTS, DIM))
    y = np.einsum("nd,nd->n", X, np.repeat(local_optima, ROWS, axis=0))
    parts = [np.arange(i * ROWS, (i + 1) * ROWS) for i in range(N_CLIENTS)]
    if not heterogeneous:
        return X, y, [np.arange(N_CLIENTS * ROWS)] * N_CLIENTS       # every client holds all the rows
    return X, y, parts


class RecordingLeastSquares(LeastSquares):
    """Least squares that remembers the minibatches of every gradient call, so a plain per-client
    reference loop can replay exactly the data the vectorised engine drew."""

    def __init__(self, n_features: int) -> None:
        super().__init__(n_features)
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def loss_and_grad(self, W: torch.Tensor, X: torch.Tensor, y: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append((X.clone(), y.clone()))
        return super().loss_and_grad(W, X, y)


class LinearLoss(LeastSquares):
    """F(x; a) = a·x: the gradient does not depend on the point."""

    def loss_and_grad(self, W: torch.Tensor, X: torch.Tensor, y: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.bmm(X, W.unsqueeze(-1)).squeeze(-1).mean(dim=1), X.mean(dim=1).expand_as(W).clone()


def simulation(algorithm: Algorithm, *, S: int = N_CLIENTS, K: int = 5, batch_size: int | None = None,
               lr_local: float = 0.02, lr_global: float = 1.0, heterogeneous: bool = True,
               model: LeastSquares | None = None, seed: int = 0) -> FederatedSimulation:
    X, y, parts = quadratics(heterogeneous)
    data = FederatedData.from_partition(X, y, parts, dtype=torch.float64)
    return FederatedSimulation(algorithm, model or LeastSquares(DIM), data,
                               FLConfig(N_CLIENTS, S, K, lr_local, lr_global),
                               batch_size=batch_size, seed=seed)


def optimum(heterogeneous: bool = True) -> np.ndarray:
    return least_squares_optimum(*quadratics(heterogeneous))


def distance_to_optimum(sim: FederatedSimulation, heterogeneous: bool = True) -> float:
    return float(np.abs(sim.server.x.numpy() - optimum(heterogeneous)).max())


def run_rounds(sim: FederatedSimulation, rounds: int) -> FederatedSimulation:
    for _ in range(rounds):
        sim.step()
    return sim


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def assert_same_isca_trajectory(a: FederatedSimulation, b: FederatedSimulation, rounds: int,
                                atol: float = 1e-12) -> None:
    assert_same_trajectory(a, b, rounds, atol, client_state="u")


# --- exact relations --------------------------------------------------------------------------------

@pytest.mark.parametrize("batch_size", [None, 4], ids=["sigma0", "minibatch"])
@pytest.mark.parametrize("S", [N_CLIENTS, 3])
def test_isca_equals_a_literal_per_client_loop_of_algorithm_1(S: int, batch_size: int | None) -> None:
    """Lines 5-18 verbatim (inner-loop copies u_i^{t,k}, v_i^{t,k} updated at every step), with the
    identities that make them redundant asserted inside, against the vectorised ISCA."""
    K, lr_local, lr_global = 4, 0.03, 0.8
    model = RecordingLeastSquares(DIM)
    sim = simulation(Isca(), S=S, K=K, batch_size=batch_size, lr_local=lr_local, lr_global=lr_global,
                     model=model)
    x, v, u = (t.numpy().copy() for t in (sim.server.x, sim.server.v, sim.clients.u))
    np.testing.assert_allclose(v, u.mean(axis=0), rtol=0, atol=1e-13)      # Line 1: v^0 = mean u_i^0
    close = {"rtol": 0, "atol": 1e-12}
    for _ in range(15):
        model.calls.clear()
        u_before = sim.clients.u.clone()
        sim.step()
        assert len(model.calls) == K + 1
        batches = [(A.numpy(), b.numpy()) for A, b in model.calls]

        def gradient(k: int, j: int, w: np.ndarray, batches=batches) -> np.ndarray:
            A, b = batches[k][0][j], batches[k][1][j]
            return A.T @ (A @ w - b) / A.shape[0]

        model_moves, control_moves, u_new = [], [], u.copy()
        for j, i in enumerate(sim.last_clients.tolist()):
            y, v_i, u_i, g_sum = x.copy(), v.copy(), u[i].copy(), np.zeros(DIM)
            for k in range(K):
                g = gradient(k, j, y)
                np.testing.assert_allclose(v_i - u_i, v - u[i], **close)                 # (24a)
                y = y - lr_local * (g - u_i + v_i)                                       # Line 8
                v_i = v_i + g - u_i                                                      # Line 9
                u_i = g                                                                  # Line 10
                np.testing.assert_allclose(v_i, v + g - u[i], **close)
                g_sum += g
            g_last = gradient(K, j, y)                                                   # Line 12
            v_i = v_i + g_last - u_i                                                     # Line 13
            np.testing.assert_allclose(v_i - v, g_last - u[i], **close)
            np.testing.assert_allclose((x - y) / (lr_local * K), v + g_sum / K - u[i], **close)
            u_new[i] = g_last                                                            # Line 14
            model_moves.append(y - x)
            control_moves.append(v_i - v)
        x = x + lr_global / S * sum(model_moves)                                         # Line 17
        v = v + sum(control_moves) / N_CLIENTS                                           # Line 18
        u = u_new
        np.testing.assert_allclose(sim.server.x.numpy(), x, **close)
        np.testing.assert_allclose(sim.server.v.numpy(), v, **close)
        np.testing.assert_allclose(sim.clients.u.numpy(), u, **close)
        np.testing.assert_allclose(sim.server.v.numpy(), sim.clients.u.numpy().mean(axis=0), **close)
        idle = torch.ones(N_CLIENTS, dtype=torch.bool)
        idle[sim.last_clients] = False
        assert torch.equal(sim.clients.u[idle], u_before[idle])                          # bitwise


@pytest.mark.parametrize("S", [N_CLIENTS, 3])
def test_iscam_with_unit_betas_and_identity_is_isca(S: int) -> None:
    """Both draw K + 1 minibatches per round, so σ > 0 is fine."""
    assert_same_isca_trajectory(simulation(Iscam(IDENTITY, beta1=1.0, beta2=1.0), S=S, batch_size=4),
                                simulation(Isca(), S=S, batch_size=4), rounds=30)


@pytest.mark.parametrize("S", [N_CLIENTS, 3])
def test_iscam_beta1_is_a_global_step_for_scale_equivariant_compressors(S: int) -> None:
    """ISCAM(α_out, β1 = 0.1) ≡ ISCAM(0.1·α_out, β1 = 1) under 2-bit dithering with the same
    compressor draws (dithering is positively scale-equivariant)."""
    damped = simulation(Iscam(DITHER2, beta1=0.1, beta2=0.1), S=S, batch_size=4, lr_global=2.0)
    rescaled = simulation(Iscam(DITHER2, beta1=1.0, beta2=0.1), S=S, batch_size=4, lr_global=0.2)
    assert_same_isca_trajectory(damped, rescaled, rounds=30, atol=1e-11)


@pytest.mark.parametrize("S", [N_CLIENTS, 3])
def test_iscam_without_control_learning_is_fedavg(S: int) -> None:
    """β2 = 0, zero controls, β1 = 1, C = I is FedAvg with two-sided learning rates; u and v stay exactly
    0. σ = 0, since ISCAM draws one more minibatch per round than FedAvg."""
    iscam = simulation(Iscam(IDENTITY, beta1=1.0, beta2=0.0, cv_init="zeros"), S=S, lr_global=0.7)
    fedavg = simulation(FedAvg(), S=S, lr_global=0.7)
    for _ in range(30):
        iscam.step()
        fedavg.step()
        assert max_diff(iscam.server.x, fedavg.server.x) < 1e-12
    assert not bool(iscam.clients.u.any()) and not bool(iscam.server.v.any())


@pytest.mark.parametrize("S", [N_CLIENTS, 3])
def test_isca_is_scaffold_when_gradients_do_not_depend_on_the_point(S: int) -> None:
    """Linear losses, σ = 0: g^{t,K} = ḡ^t, so ISCA's refresh equals SCAFFOLD's (option II)."""
    isca = simulation(Isca(cv_init="zeros"), S=S, model=LinearLoss(DIM), lr_local=0.05)
    scaffold = simulation(Scaffold(cv_init="zeros"), S=S, model=LinearLoss(DIM), lr_local=0.05)
    for _ in range(20):
        isca.step()
        scaffold.step()
        assert max_diff(isca.server.x, scaffold.server.x) < 1e-12
        assert max_diff(isca.server.v, scaffold.server.c) < 1e-12
        assert max_diff(isca.clients.u, scaffold.clients.c) < 1e-12
    assert bool(isca.clients.u.any())


def test_full_participation_round_of_isca_and_scaffold() -> None:
    """From the same state and minibatches one round gives the same x^{t+1} (the model direction
    is mean ḡ for both), SCAFFOLD has x⁺ = x − γ·c⁺ and ISCA's v⁺ = mean g^{t,K} ≠ the model direction."""
    isca = simulation(Isca(), batch_size=4)
    scaffold = simulation(Scaffold(cv_init="full_grad"), batch_size=4)
    assert max_diff(isca.server.v, scaffold.server.c) < 1e-15
    x0 = isca.server.x.clone()
    isca.step()
    scaffold.step()
    gamma = isca.config.effective_step
    assert max_diff(isca.server.x, scaffold.server.x) < 1e-12                       # same first K batches
    assert max_diff(scaffold.server.x, x0 - gamma * scaffold.server.c) < 1e-12
    assert max_diff(isca.server.v, isca.clients.u.mean(dim=0)) < 1e-12              # S = N: v⁺ = mean u_i
    assert max_diff(isca.server.x, x0 - gamma * isca.server.v) > 1e-3               # v⁺ is not the direction


def test_communication_and_gradient_ledger() -> None:
    """ISCA sends 2 full-precision vectors and receives 2 per participant and computes K + 1
    gradients; ISCAM sends 2 compressed messages; SCAFFOLD (one vector) and FedAvg compute K."""
    rounds, S, K = 6, 3, 5
    isca = run_rounds(simulation(Isca(), S=S, K=K, batch_size=4), rounds)
    assert isca.uplink_bits == isca.downlink_bits == rounds * S * 2 * 64 * DIM
    assert isca.gradient_evaluations == rounds * S * (K + 1)
    iscam = run_rounds(simulation(Iscam(IDENTITY), S=S, K=K, batch_size=4), rounds)
    identity_bits = IDENTITY.compress(torch.zeros(DIM, dtype=torch.float64)).nbits
    assert iscam.uplink_bits == rounds * S * 2 * identity_bits
    assert iscam.gradient_evaluations == rounds * S * (K + 1)
    scaffold = run_rounds(simulation(Scaffold(), S=S, K=K, batch_size=4), rounds)
    assert scaffold.uplink_bits == rounds * S * 64 * DIM
    assert scaffold.gradient_evaluations == rounds * S * K
    record = simulation(FedPAQ(DITHER2), S=S, K=K, batch_size=4).step()
    assert record["gradient_evaluations"] == S * K and record["uplink_bits"] < S * 64 * DIM


@pytest.mark.parametrize("u_update", ["compressed", "uncompressed_literal"])
def test_iscam_invariant_holds_only_with_the_compressed_u_update(u_update: str) -> None:
    """With compression, v = mean u_i after every round with the compressed u-update; the printed Line 14
    (uncompressed) breaks it."""
    sim = simulation(Iscam(DITHER2, beta1=0.1, beta2=0.1, u_update=u_update), S=3, batch_size=4)
    gaps = []
    for _ in range(30):
        before = sim.clients.clone()
        sim.step()
        gaps.append(max_diff(sim.server.v, sim.clients.u.mean(dim=0)))
        idle = torch.ones(N_CLIENTS, dtype=torch.bool)
        idle[sim.last_clients] = False
        assert torch.equal(sim.clients.u[idle], before.u[idle])
    if u_update == "compressed":
        assert max(gaps) < 1e-12
    else:
        assert gaps[-1] > 1e-3 and gaps[-1] > gaps[0]


def test_iscam_round_is_unbiased_over_the_compressor() -> None:
    """With fixed data (σ = 0) and randomness only from C, E_C[x^{t+1}] and E_C[v^{t+1}] equal the
    identity-compressor round (whose global step is β1·α_out)."""
    draws, S = 600, 4

    def one_round_states(algorithm: Algorithm, repeats: int) -> tuple[np.ndarray, np.ndarray]:
        sim = simulation(algorithm, S=S, lr_global=3.0)
        start_server, start_clients = sim.server.clone(), sim.clients.clone()
        sampling = sim.streams.sampling.get_state()
        xs, vs = [], []
        for _ in range(repeats):
            sim.server, sim.clients = start_server.clone(), start_clients.clone()
            sim.streams.sampling.set_state(sampling)
            sim.step()
            xs.append(sim.server.x.numpy().copy())
            vs.append(sim.server.v.numpy().copy())
        return np.array(xs), np.array(vs)

    x_exact, v_exact = one_round_states(Iscam(IDENTITY, beta1=0.1, beta2=0.1), 1)
    xs, vs = one_round_states(Iscam(DITHER2, beta1=0.1, beta2=0.1), draws)
    for samples, exact in ((xs, x_exact[0]), (vs, v_exact[0])):
        standard_error = samples.std(axis=0) / np.sqrt(draws)
        assert np.all(samples.std(axis=0) > 0), "the compressor must actually be random"
        assert np.all(np.abs(samples.mean(axis=0) - exact) < 5 * standard_error + 1e-12)


# --- behaviour on deterministic quadratics (σ = 0) ----------------------------------------------------

@pytest.mark.parametrize(("algorithm", "S", "lr_global"), [
    (Isca(), N_CLIENTS, 1.0),
    (Isca(), 3, 1.0),
    (Iscam(DITHER2, beta1=0.1, beta2=0.1), N_CLIENTS, 10.0),
    (Iscam(DITHER2, beta1=0.1, beta2=0.1), 4, 10.0),
], ids=["isca", "isca-partial", "iscam-dither2", "iscam-dither2-partial"])
def test_isca_and_iscam_reach_the_exact_optimum_of_heterogeneous_quadratics(
        algorithm: Algorithm, S: int, lr_global: float) -> None:
    sim = run_rounds(simulation(algorithm, S=S, lr_global=lr_global), 700)
    assert distance_to_optimum(sim) < 1e-8
    # the compressed increments vanish: every u_i has reached ∇f_i(x*) (and v = ∇f(x*) = 0)
    x_star = torch.as_tensor(optimum())
    for i in range(N_CLIENTS):
        A, b = sim.data.client(i)
        assert max_diff(sim.clients.u[i], A.T @ (A @ x_star - b) / ROWS) < 1e-6
    assert float(sim.server.v.abs().max()) < 1e-6


def test_iscam_with_the_printed_line_14_converges_to_a_biased_point() -> None:
    """The printed Line 14 (uncompressed u-update) leaves e = v − mean u ≠ 0, and the limit x̂ solves
    ∇f(x̂) = −e."""
    sim = run_rounds(simulation(Iscam(DITHER2, beta1=0.1, beta2=0.1, u_update="uncompressed_literal"),
                                lr_global=10.0), 500)
    assert distance_to_optimum(sim) > 1e-2
    gap = sim.server.v - sim.clients.u.mean(dim=0)
    x_hat = sim.server.x
    full_gradient = torch.stack([A.T @ (A @ x_hat - b) / ROWS
                                 for A, b in map(sim.data.client, range(N_CLIENTS))]).mean(dim=0)
    assert max_diff(full_gradient, -gap) < 1e-9


def test_isca_is_consistent_between_homogeneous_and_heterogeneous_clients_and_fedavg_is_not() -> None:
    """The paper's claim in the noiseless limit: ISCA reaches the optimum on both kinds of data; FedAvg
    with K > 1 only on identical clients (client drift)."""
    for heterogeneous, rounds in ((False, 200), (True, 600)):
        isca = run_rounds(simulation(Isca(), S=3, heterogeneous=heterogeneous), rounds)
        assert distance_to_optimum(isca, heterogeneous) < 1e-9
    fedavg_iid = run_rounds(simulation(FedAvg(), S=3, heterogeneous=False), 200)
    fedavg_non_iid = run_rounds(simulation(FedAvg(), S=N_CLIENTS), 600)
    assert distance_to_optimum(fedavg_iid, heterogeneous=False) < 1e-9
    assert distance_to_optimum(fedavg_non_iid) > 0.05


# --- FedPAQ --------------------------------------------------------------------------------------------

def test_fedpaq_with_the_identity_quantizer_is_fedavg() -> None:
    fedpaq = simulation(FedPAQ(IDENTITY), S=3, batch_size=4, lr_global=0.8)
    fedavg = simulation(FedAvg(), S=3, batch_size=4, lr_global=0.8)
    for _ in range(25):
        fedpaq.step()
        fedavg.step()
        assert max_diff(fedpaq.server.x, fedavg.server.x) < 1e-13
    assert max_diff(fedpaq.server.x, simulation(FedAvg()).server.x) > 0.1


def test_fedpaq_learns_homogeneous_quadratics_with_quantized_updates() -> None:
    """QSGD with s = 3 levels (3 bits/parameter): unbiased noise that shrinks as the moves shrink on
    identical clients, so FedPAQ gets close to the optimum while sending fewer bits than FedAvg."""
    fedpaq = simulation(FedPAQ(get_compressor("dithering", levels=3)), S=4, heterogeneous=False)
    start = distance_to_optimum(fedpaq, heterogeneous=False)
    run_rounds(fedpaq, 100)
    assert distance_to_optimum(fedpaq, heterogeneous=False) < 1e-4 * start


# --- options and registry ------------------------------------------------------------------------------

def test_registry_and_bad_options_are_clear_errors() -> None:
    assert isinstance(make_algorithm("isca"), Isca)
    assert isinstance(make_algorithm("iscam", compressor=DITHER2, beta1=0.1, beta2=0.1), Iscam)
    assert isinstance(make_algorithm("fedpaq", compressor=DITHER2), FedPAQ)
    with pytest.raises(ValueError, match="beta1"):
        Iscam(DITHER2, beta1=0.0)
    with pytest.raises(ValueError, match="beta2"):
        Iscam(DITHER2, beta2=1.5)
    with pytest.raises(ValueError, match="u_update"):
        Iscam(DITHER2, u_update="literal")
    with pytest.raises(ValueError, match="unbiased"):
        Iscam(get_compressor("top-r", r=0.1), allow_biased=False)
    with pytest.raises(ValueError, match="unbiased quantizer"):
        FedPAQ(get_compressor("top-r", r=0.1))
    with pytest.raises(ValueError, match="cv_init"):
        Isca(cv_init="ones")
    with pytest.raises(TypeError, match="compress_batch"):
        FedPAQ("dithering")
    assert Iscam(DITHER2).describe()["u_update"] == "compressed"
