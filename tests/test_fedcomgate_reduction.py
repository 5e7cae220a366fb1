"""FedCOMGATE's reductions and the accounting behind its divergence under random dithering.

- With the identity compressor and full participation FedCOMGATE *is* VRL-SGD (Liang et al. 2019,
  Algorithm 1), the method the SCAFCOM paper says it compresses: checked against a plain per-client
  numpy loop written from the VRL-SGD paper, not from our code.
- With K = 1 as well, VRL-SGD is minibatch SGD on the average: the same trajectory as FedAvg with K = 1.
- With a compressor, δ_j is updated with the client's *uncompressed* move but the server's *compressed*
  mean (as in the authors' FedTorch code), so Σ_j δ_j, which VRL-SGD keeps at 0, accumulates exactly the
  compression errors Σ_j (m_j − C(m_j))/K. Nothing pulls it back: this is why FedCOMGATE with 2/4-bit
  dithering on the 235k-parameter MLP diverges at every learning rate (experiments.hfl_isca).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from horizontal import FedAvg, FedComGate, FederatedData, FederatedSimulation, FLConfig, LeastSquares
from horizontal.base import Algorithm
from protocols.compression import Payload, get_compressor

N_CLIENTS, ROWS, DIM = 6, 10, 4


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny problems: torch's intra-op threads only add overhead on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def heterogeneous_clients(seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Least-squares clients with their own feature scales and far-apart local optima, so the tracking
    correction δ_j has real work to do."""
    rng = np.random.default_rng(seed)
    X = np.concatenate([rng.normal(size=(ROWS, DIM)) * rng.uniform(0.3, 2.0, size=DIM)
                        for _ in range(N_CLIENTS)])
    local_optima = 5.0 * rng.normal(size=(N_CLIENTS, DIM))
    y = np.einsum("nd,nd->n", X, np.repeat(local_optima, ROWS, axis=0))
    return X, y, [np.arange(i * ROWS, (i + 1) * ROWS) for i in range(N_CLIENTS)]


X_DATA, Y_DATA, PARTS = heterogeneous_clients()


def simulation(algorithm: Algorithm, *, S: int = N_CLIENTS, K: int = 5, lr_local: float = 0.02,
               lr_global: float = 1.0, batch_size: int | None = None) -> FederatedSimulation:
    data = FederatedData.from_partition(X_DATA, Y_DATA, PARTS, dtype=torch.float64)
    config = FLConfig(N_CLIENTS, S, K, lr_local, lr_global)
    return FederatedSimulation(algorithm, LeastSquares(DIM), data, config, batch_size=batch_size, seed=0)


def vrl_sgd(x0: np.ndarray, rounds: int, K: int, lr: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """VRL-SGD with full local gradients: every worker steps x_i ← x_i − γ(∇f_i(x_i) − Δ_i) K times;
    then x̂ = mean_i x_i, Δ_i ← Δ_i + (x̂ − x_i)/(Kγ), x_i ← x̂. Returns x̂ and Δ after each round."""
    deltas = np.zeros((N_CLIENTS, DIM))
    x = x0.copy()
    xs, all_deltas = [], []
    for _ in range(rounds):
        local = np.repeat(x[None], N_CLIENTS, axis=0)
        for _ in range(K):
            for i, rows in enumerate(PARTS):
                A, b = X_DATA[rows], Y_DATA[rows]
                local[i] -= lr * (A.T @ (A @ local[i] - b) / len(rows) - deltas[i])
        x = local.mean(axis=0)
        deltas = deltas + (x - local) / (K * lr)
        xs.append(x)
        all_deltas.append(deltas)
    return xs, all_deltas


def test_identity_fedcomgate_with_full_participation_is_vrl_sgd() -> None:
    K, lr, rounds = 5, 0.02, 40
    sim = simulation(FedComGate(get_compressor("identity")), K=K, lr_local=lr)
    x0 = sim.server.x.numpy().copy()
    xs, deltas = vrl_sgd(x0, rounds, K, lr)
    for t in range(rounds):
        sim.step()
        np.testing.assert_allclose(sim.server.x.numpy(), xs[t], rtol=0, atol=1e-10, err_msg=f"x, round {t}")
        np.testing.assert_allclose(sim.clients.delta.numpy(), deltas[t], rtol=0, atol=1e-10,
                                   err_msg=f"δ, round {t}")
    assert np.abs(xs[-1] - x0).max() > 0.5 and np.abs(deltas[-1]).max() > 0.5, "a trajectory that moves"


def test_identity_fedcomgate_with_one_local_step_is_fedavg_with_one_local_step() -> None:
    """K = 1, S = N: δ_j = g_j − mean g from the previous round sums to 0, so the server step is
    −η_l η_g · mean_j g_j: minibatch SGD on the average, exactly FedAvg with K = 1 (same minibatches)."""
    options = {"K": 1, "lr_local": 0.05, "lr_global": 0.7, "batch_size": 3}
    gate = simulation(FedComGate(get_compressor("identity")), **options)
    fedavg = simulation(FedAvg(), **options)
    start = gate.server.x.clone()
    for t in range(30):
        gate.step()
        fedavg.step()
        assert gate.server.max_abs_diff(fedavg.server) < 1e-12, f"round {t}"
    assert float((gate.server.x - start).abs().max()) > 0.5


class RecordingCompressor:
    """Delegates to a real compressor and sums the compression errors X − C(X) of every row it sends."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.unbiased = inner.unbiased
        self.error_sum = torch.zeros(DIM, dtype=torch.float64)

    def compress_batch(self, X: torch.Tensor, generators: Sequence[torch.Generator]) -> list[Payload]:
        payloads = self.inner.compress_batch(X, generators)
        self.error_sum += (X - self.inner.decompress_batch(payloads)).sum(dim=0)
        return payloads

    def decompress_batch(self, payloads: Sequence[Payload]) -> torch.Tensor:
        return self.inner.decompress_batch(payloads)


@pytest.mark.parametrize("compressor", ["identity", "dithering"])
def test_tracking_sum_accumulates_exactly_the_compression_errors(compressor: str) -> None:
    """Σ_j δ_j = (1/K)·Σ_rounds Σ_{j∈S} (m_j − C(m_j)), with partial participation: 0 without compression
    (VRL-SGD's invariant, g − δ_j unbiased), an undamped random walk with it."""
    inner = get_compressor("identity") if compressor == "identity" else get_compressor("dithering", bits=2)
    recorder = RecordingCompressor(inner)
    K = 5
    sim = simulation(FedComGate(recorder), S=3, K=K, batch_size=4)
    for _ in range(25):
        sim.step()
    tracking_sum = sim.clients.delta.sum(dim=0)
    torch.testing.assert_close(tracking_sum, recorder.error_sum / K, rtol=0, atol=1e-10)
    if compressor == "identity":
        assert float(tracking_sum.abs().max()) < 1e-12
    else:
        assert float(tracking_sum.abs().max()) > 1e-2 * float(sim.clients.delta.abs().max())
