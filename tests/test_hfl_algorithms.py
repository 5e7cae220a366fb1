"""Horizontal-FL algorithms: exact equivalences (float64), invariants and behaviour on deterministic
heterogeneous quadratics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from horizontal import (
    FedAvg,
    FedComGate,
    FedEF,
    FederatedData,
    FederatedSimulation,
    FLConfig,
    LeastSquares,
    Scafcom,
    Scaffold,
    ScaffoldTwoVector,
    Scallion,
    least_squares_optimum,
    make_algorithm,
)
from horizontal.base import Algorithm
from protocols.compression import get_compressor

N_CLIENTS, ROWS, DIM = 8, 12, 5


def heterogeneous_quadratics(seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Clients with their own feature scales (different Hessians) and far-apart local optima, so that
    client drift biases FedAvg."""
    rng = np.random.default_rng(seed)
    X = np.concatenate([rng.normal(size=(ROWS, DIM)) * rng.uniform(0.3, 2.0, size=DIM)
                        for _ in range(N_CLIENTS)])
    local_optima = 5.0 * rng.normal(size=(N_CLIENTS, DIM))
    y = np.einsum("nd,nd->n", X, np.repeat(local_optima, ROWS, axis=0))
    parts = [np.arange(i * ROWS, (i + 1) * ROWS) for i in range(N_CLIENTS)]
    return X, y, parts


X_QUAD, Y_QUAD, PARTS_QUAD = heterogeneous_quadratics()
X_STAR = least_squares_optimum(X_QUAD, Y_QUAD, PARTS_QUAD)


def simulation(algorithm: Algorithm, *, S: int = N_CLIENTS, K: int = 5, batch_size: int | None = None,
               lr_local: float = 0.02, lr_global: float = 1.0, seed: int = 0) -> FederatedSimulation:
    data = FederatedData.from_partition(X_QUAD, Y_QUAD, PARTS_QUAD, dtype=torch.float64)
    return FederatedSimulation(algorithm, LeastSquares(DIM), data,
                               FLConfig(N_CLIENTS, S, K, lr_local, lr_global),
                               batch_size=batch_size, seed=seed)


def distance_to_optimum(sim: FederatedSimulation) -> float:
    return float(np.abs(sim.server.x.numpy() - X_STAR).max())


def assert_same_trajectory(a: FederatedSimulation, b: FederatedSimulation, rounds: int,
                           atol: float = 1e-10, client_state: str = "c") -> None:
    """Step both in lockstep; the server state and every client's ``client_state`` tensor (c_i for the
    SCAFFOLD family, u_i for ISCA) must agree after every round."""
    start = a.server.x.clone()
    for t in range(rounds):
        a.step()
        b.step()
        assert torch.equal(a.last_clients, b.last_clients)
        assert a.server.max_abs_diff(b.server) < atol, f"server states differ at round {t}"
        mine, theirs = getattr(a.clients, client_state), getattr(b.clients, client_state)
        assert float((mine - theirs).abs().max()) < atol, f"{client_state}_i differ at round {t}"
    assert float((a.server.x - start).abs().max()) > 0.1, "the trajectory must actually move"


@pytest.mark.parametrize("S", [N_CLIENTS, 3])
def test_original_scaffold_and_single_vector_form_have_the_same_trajectory(S: int) -> None:
    two = simulation(ScaffoldTwoVector(), S=S, batch_size=4, lr_local=0.03)
    one = simulation(Scaffold(), S=S, batch_size=4, lr_local=0.03)
    assert_same_trajectory(two, one, rounds=40)
    assert two.uplink_bits == 2 * one.uplink_bits == 2 * 40 * S * 64 * DIM   # float64: 64 bits/entry


@pytest.mark.parametrize("S", [N_CLIENTS, 3])
def test_identity_compressed_methods_reduce_to_scaffold(S: int) -> None:
    identity = get_compressor("identity")
    reference = simulation(Scaffold(), S=S, batch_size=4)
    assert_same_trajectory(simulation(Scallion(identity, alpha=1.0), S=S, batch_size=4), reference, 30)
    reference = simulation(Scaffold(), S=S, batch_size=4)
    scafcom = simulation(Scafcom(identity, beta=1.0), S=S, batch_size=4)
    assert_same_trajectory(scafcom, reference, 30)
    assert float((scafcom.clients.c - scafcom.clients.v).abs().max()) < 1e-12   # C = I: c_i = v_i


def test_error_feedback_with_identity_is_fedavg() -> None:
    fed_ef = simulation(FedEF(get_compressor("identity")), S=3, batch_size=4)
    fedavg = simulation(FedAvg(), S=3, batch_size=4)
    for _ in range(20):
        fed_ef.step()
        fedavg.step()
    assert fed_ef.server.max_abs_diff(fedavg.server) < 1e-12
    assert float(fed_ef.clients.e.abs().max()) < 1e-12


@pytest.mark.parametrize("algorithm", [
    Scallion(get_compressor("dithering", bits=2), alpha=0.1),
    Scafcom(get_compressor("top-r", r=0.2), beta=0.2),
], ids=["scallion-dither2", "scafcom-top20"])
def test_compressed_rounds_keep_the_invariants(algorithm: Algorithm) -> None:
    """c = mean c_i; x⁺ = x − γ(c + (N/S)(c⁺ − c)); non-participants bitwise frozen."""
    S = 3
    sim = simulation(algorithm, S=S, batch_size=4)
    gamma = sim.config.effective_step
    for _ in range(25):
        before_server, before_clients = sim.server.clone(), sim.clients.clone()
        sim.step()
        assert float((sim.server.c - sim.clients.c.mean(dim=0)).abs().max()) < 1e-12
        expected_x = before_server.x - gamma * (before_server.c
                                                + N_CLIENTS / S * (sim.server.c - before_server.c))
        assert float((sim.server.x - expected_x).abs().max()) < 1e-12
        idle = torch.ones(N_CLIENTS, dtype=torch.bool)
        idle[sim.last_clients] = False
        for name, store in sim.clients.tensors().items():
            assert torch.equal(store[idle], before_clients.tensors()[name][idle]), name


def test_scafcom_with_one_local_step_and_full_gradients_is_ef21() -> None:
    """β = 1, K = 1, S = N, σ = 0: c_i ← c_i + C(∇f_i(x) − c_i), x ← x − η_g η_l mean c_i (EF21)."""
    top = get_compressor("top-r", r=0.4)
    lr_local, lr_global = 0.05, 0.7
    sim = simulation(Scafcom(top, beta=1.0), K=1, lr_local=lr_local, lr_global=lr_global)
    x = sim.server.x.clone()
    c = torch.zeros(N_CLIENTS, DIM, dtype=torch.float64)
    data = sim.data
    for _ in range(15):
        grads = torch.stack([A.T @ (A @ x - b) / ROWS for A, b in map(data.client, range(N_CLIENTS))])
        c = c + top.roundtrip_batch(grads - c)[0]
        x = x - lr_global * lr_local * c.mean(dim=0)
        sim.step()
        assert float((sim.server.x - x).abs().max()) < 1e-12
        assert float((sim.clients.c - c).abs().max()) < 1e-12


def test_same_seed_same_trajectory_and_other_seed_differs() -> None:
    def trajectory(seed: int) -> list[torch.Tensor]:
        sim = simulation(Scafcom(get_compressor("rand-k", k=2), beta=0.5), S=3, batch_size=4, seed=seed)
        return [sim.step() and sim.server.x.clone() for _ in range(10)]

    first, again, other = trajectory(3), trajectory(3), trajectory(4)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[-1], other[-1])


def test_uplink_bits_are_the_compressors_payload_sizes() -> None:
    top = get_compressor("top-r", r=0.4)
    payload_bits = top.compress(torch.randn(DIM, dtype=torch.float64)).nbits
    sim = simulation(Scafcom(top), S=3)
    for _ in range(7):
        sim.step()
    assert sim.uplink_bits == 7 * 3 * payload_bits
    assert sim.downlink_bits == 7 * 3 * 2 * 64 * DIM              # x and c, float64, to each participant


# --- behaviour on deterministic heterogeneous quadratics (σ = 0) ---------------------------------------

def run_rounds(sim: FederatedSimulation, rounds: int) -> FederatedSimulation:
    for _ in range(rounds):
        sim.step()
    return sim


def test_fedavg_and_error_feedback_converge_to_a_biased_point() -> None:
    fedavg = run_rounds(simulation(FedAvg()), 300)
    x_prev = fedavg.server.x.clone()
    fedavg.step()
    assert float((fedavg.server.x - x_prev).abs().max()) < 1e-8, "FedAvg has settled"
    assert distance_to_optimum(fedavg) > 0.05, "...at a point biased by client drift"
    assert distance_to_optimum(run_rounds(simulation(FedEF(get_compressor("top-r", r=0.2))), 300)) > 0.05


@pytest.mark.parametrize(("algorithm", "S", "lr_global"), [
    (Scaffold(), N_CLIENTS, 1.0),
    (Scaffold(), 3, 1.0),
    (Scallion(get_compressor("dithering", bits=2), alpha=0.1), N_CLIENTS, 1.0),
    (Scafcom(get_compressor("top-r", r=0.2), beta=0.2), N_CLIENTS, 0.3),
    (Scafcom(get_compressor("top-r", r=0.2), beta=0.2), 4, 0.3),
    (FedComGate(get_compressor("identity")), N_CLIENTS, 1.0),
], ids=["scaffold", "scaffold-partial", "scallion-dither2", "scafcom-top20", "scafcom-top20-partial",
        "fedcomgate"])
def test_drift_corrected_methods_reach_the_exact_optimum(algorithm: Algorithm, S: int,
                                                         lr_global: float) -> None:
    sim = run_rounds(simulation(algorithm, S=S, lr_global=lr_global), 700)
    assert distance_to_optimum(sim) < 1e-9
    if isinstance(algorithm, Scallion | Scafcom):
        # the compressed messages vanish: every c_i has reached ∇f_i(x*) (c_i moves only by δ̃_i)
        data = sim.data
        for i in range(N_CLIENTS):
            A, b = data.client(i)
            local_grad = A.T @ (A @ torch.as_tensor(X_STAR) - b) / ROWS
            assert float((sim.clients.c[i] - local_grad).abs().max()) < 1e-7


def test_fedcomgate_tracking_variables_sum_to_zero_with_full_participation() -> None:
    sim = simulation(FedComGate(get_compressor("identity")), batch_size=4)
    for _ in range(10):
        sim.step()
        assert float(sim.clients.delta.sum(dim=0).abs().max()) < 1e-12
    assert float(sim.clients.delta.abs().max()) > 1e-3


def test_control_variate_initialisations() -> None:
    sim = simulation(Scaffold(cv_init="full_grad"))
    x0 = sim.server.x.numpy()
    grads = np.stack([X_QUAD[p].T @ (X_QUAD[p] @ x0 - Y_QUAD[p]) / ROWS for p in PARTS_QUAD])
    np.testing.assert_allclose(sim.clients.c.numpy(), grads, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(sim.server.c.numpy(), grads.mean(axis=0), rtol=1e-12, atol=1e-12)
    full_batch = simulation(Scafcom(get_compressor("identity"), cv_init="minibatch"))   # batch = all rows
    np.testing.assert_allclose(full_batch.clients.c.numpy(), grads, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(full_batch.clients.v.numpy(), grads, rtol=1e-12, atol=1e-12)
    minibatch = simulation(Scaffold(cv_init="minibatch"), batch_size=3)
    assert float(np.abs(minibatch.clients.c.numpy() - grads).min()) > 0      # noisy estimates of ∇f_i(x^0)
    assert float((minibatch.server.c - minibatch.clients.c.mean(dim=0)).abs().max()) < 1e-15


def test_bad_options_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="alpha"):
        Scallion(get_compressor("identity"), alpha=0.0)
    with pytest.raises(ValueError, match="beta"):
        Scafcom(get_compressor("identity"), beta=1.5)
    with pytest.raises(ValueError, match="unbiased"):
        Scallion(get_compressor("top-r", r=0.1), allow_biased=False)
    with pytest.raises(TypeError, match="compress_batch"):
        FedEF(compressor="top-r")
    with pytest.raises(ValueError, match="cv_init"):
        Scaffold(cv_init="ones")
    with pytest.raises(ValueError, match="unknown algorithm"):
        make_algorithm("fedprox")
    with pytest.raises(TypeError, match="scallion"):
        make_algorithm("scallion", alpha=0.1)       # compressor missing
    assert isinstance(make_algorithm("scafcom", compressor=get_compressor("identity"), beta=0.3), Scafcom)
