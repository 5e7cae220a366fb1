"""The simulation engine: vectorised rounds equal a per-client reference loop, sampling, bit ledger,
metric logs, learning on real data, and clear errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from horizontal import (
    MLP,
    FedAvg,
    FederatedData,
    FederatedSimulation,
    FLConfig,
    LeastSquares,
    MetricsLog,
    Scafcom,
    Scaffold,
    shard_partition,
)
from horizontal.rounds import check_finite
from protocols.compression import get_compressor

N, ROWS, DIM = 6, 10, 4


def quadratic_data() -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(5)
    X = np.concatenate([rng.normal(size=(ROWS, DIM)) * rng.uniform(0.5, 1.5, DIM) for _ in range(N)])
    y = rng.normal(size=N * ROWS) + np.repeat(3.0 * rng.normal(size=N), ROWS)
    return X, y, [np.arange(i * ROWS, (i + 1) * ROWS) for i in range(N)]


def quadratic_simulation(algorithm, S: int = 3, K: int = 4, lr_local: float = 0.05, lr_global: float = 0.8,
                         batch_size: int | None = None, seed: int = 0) -> FederatedSimulation:
    X, y, parts = quadratic_data()
    data = FederatedData.from_partition(X, y, parts, dtype=torch.float64)
    return FederatedSimulation(algorithm, LeastSquares(DIM), data, FLConfig(N, S, K, lr_local, lr_global),
                               batch_size=batch_size, seed=seed)


def test_vectorised_rounds_equal_the_per_client_reference_loop() -> None:
    """SCAFCOM with Top-r, partial participation, σ = 0, against a plain per-client loop."""
    top = get_compressor("top-r", r=0.5)
    beta, K, lr_local, lr_global, S = 0.4, 4, 0.05, 0.8, 3
    sim = quadratic_simulation(Scafcom(top, beta=beta), S=S, K=K, lr_local=lr_local, lr_global=lr_global)
    X, y, parts = quadratic_data()
    x = sim.server.x.numpy().copy()
    c, c_i, v_i = np.zeros(DIM), np.zeros((N, DIM)), np.zeros((N, DIM))

    def grad(i: int, w: np.ndarray) -> np.ndarray:
        A, b = X[parts[i]], y[parts[i]]
        return A.T @ (A @ w - b) / ROWS

    for _ in range(12):
        sim.step()
        messages = []
        for i in sim.last_clients.tolist():
            w, g_sum = x.copy(), np.zeros(DIM)
            for _ in range(K):
                g = grad(i, w)
                g_sum += g
                w = w - lr_local * (g - c_i[i] + c)
            v_i[i] = (1 - beta) * v_i[i] + beta * g_sum / K
            message = top.roundtrip_batch(torch.as_tensor(v_i[i] - c_i[i]).unsqueeze(0))[0][0].numpy()
            c_i[i] = c_i[i] + message
            messages.append(message)
        x = x - lr_global * lr_local * K / S * sum(m + c for m in messages)
        c = c + sum(messages) / N
        np.testing.assert_allclose(sim.server.x.numpy(), x, rtol=0, atol=1e-12)
        np.testing.assert_allclose(sim.server.c.numpy(), c, rtol=0, atol=1e-12)
        np.testing.assert_allclose(sim.clients.c.numpy(), c_i, rtol=0, atol=1e-12)
        np.testing.assert_allclose(sim.clients.v.numpy(), v_i, rtol=0, atol=1e-12)


def test_clients_are_sampled_uniformly_without_replacement_and_alike_across_algorithms() -> None:
    a = quadratic_simulation(FedAvg(), S=2, batch_size=3)
    b = quadratic_simulation(Scaffold(), S=2, batch_size=3)
    for _ in range(50):
        a.step()
        b.step()
        assert torch.equal(a.last_clients, b.last_clients)        # same seed, same participants
    counts = np.zeros(N)
    draws = 3000
    for _ in range(draws):
        sample = a.sample_clients()
        assert sample.unique().numel() == 2
        counts[sample.numpy()] += 1
    expected = draws * 2 / N
    assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected))


def test_bit_ledger_counts_full_precision_vectors_per_participant() -> None:
    sim = quadratic_simulation(Scaffold(), S=3)
    for _ in range(5):
        sim.step()
    assert sim.uplink_bits == 5 * 3 * 64 * DIM                   # one float64 vector per client
    assert sim.downlink_bits == 5 * 3 * 2 * 64 * DIM              # x and c


def test_run_writes_metrics_to_jsonl_and_csv(tmp_path: Path) -> None:
    X, y, _ = quadratic_data()
    sim = quadratic_simulation(Scaffold(), batch_size=4)
    sim.test = (torch.as_tensor(X[:20]), torch.as_tensor(y[:20]))
    with MetricsLog(tmp_path / "m.jsonl", tmp_path / "m.csv", extra={"algorithm": "scaffold"}) as log:
        records = sim.run(5, eval_every=2, log=log, progress=False)
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["round"] for r in lines] == [1, 2, 3, 4, 5]
    assert lines == [{"algorithm": "scaffold", **r} for r in records]
    assert "train_loss" in lines[1] and "train_loss" not in lines[2] and "test_loss" in lines[4]
    assert lines[4]["uplink_bits"] == 5 * 3 * 64 * DIM
    assert all(np.isfinite(r["local_loss"]) and r["round_seconds"] > 0 for r in lines)
    with open(tmp_path / "m.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 5 and rows[0]["train_loss"] == "" and float(rows[1]["train_loss"]) > 0
    assert float(rows[4]["train_loss"]) < float(rows[1]["train_loss"])


def test_divergence_is_reported_not_silent() -> None:
    sim = quadratic_simulation(FedAvg(), lr_local=5.0, lr_global=5.0)
    with pytest.raises(FloatingPointError, match=r"non-finite.*lower lr_local"):
        for _ in range(200):
            sim.step()


def test_divergence_inside_a_compressed_round_is_reported_as_divergence() -> None:
    """A non-finite update must surface as the engine's divergence error, not as a codec error."""
    sim = quadratic_simulation(Scafcom(get_compressor("top-r", r=0.5), beta=0.5), lr_local=50.0,
                               lr_global=50.0)
    with pytest.raises(FloatingPointError, match=r"non-finite.*lower lr_local"):
        for _ in range(200):
            sim.step()


def test_configuration_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="clients_per_round"):
        FLConfig(5, 6, 1, 0.1)
    with pytest.raises(ValueError, match="lr_local"):
        FLConfig(5, 2, 1, float("nan"))
    X, y, parts = quadratic_data()
    data = FederatedData.from_partition(X, y, parts, dtype=torch.float64)
    with pytest.raises(ValueError, match="n_clients=4 but the data has 6"):
        FederatedSimulation(FedAvg(), LeastSquares(DIM), data, FLConfig(4, 2, 1, 0.1))
    with pytest.raises(ValueError, match=r"features must be \(n, 5\)"):
        FederatedSimulation(FedAvg(), LeastSquares(5), data, FLConfig(N, 2, 1, 0.1))
    with pytest.raises(ValueError, match="x0 must have shape"):
        FederatedSimulation(FedAvg(), LeastSquares(DIM), data, FLConfig(N, 2, 1, 0.1), x0=torch.zeros(3))


def test_mlp_learns_label_shards_of_real_digits_and_scaffold_beats_fedavg() -> None:
    from vertical.datasets import load

    ds = load("digits")
    parts = shard_partition(ds.y_train, 20, 2, np.random.default_rng(0))
    data = FederatedData.from_partition(ds.X_train, ds.y_train, parts)
    test = (torch.as_tensor(ds.X_test), torch.as_tensor(ds.y_test))
    accuracy = {}
    for algorithm in (FedAvg(), Scaffold()):
        sim = FederatedSimulation(algorithm, MLP(64, (32,), 10), data, FLConfig(20, 5, 5, 0.3),
                                  batch_size=16, seed=0, test=test)
        assert sim.evaluate()["test_accuracy"] < 0.3
        accuracy[algorithm.name] = sim.run(40, eval_every=40, progress=False)[-1]["test_accuracy"]
    assert accuracy["scaffold"] > 0.9
    assert accuracy["scaffold"] > accuracy["fedavg"]


def test_a_diverging_run_stops_at_the_round_it_diverged_naming_the_state() -> None:
    """The one divergence check (``horizontal.rounds.check_finite``, run by the shared server step) stops the
    simulation at the round whose record would hold NaNs, naming the algorithm, the tensor and the round."""
    sim = quadratic_simulation(FedAvg(), lr_local=50.0)
    with pytest.raises(FloatingPointError) as raised:
        for _ in range(500):
            sim.step()
    assert str(raised.value) == (f"fedavg: server state 'x' became non-finite at round {sim.round} "
                                 "(diverged): lower lr_local=50.0 or lr_global=0.8")
    assert 1 < sim.round < 500 and not bool(torch.isfinite(sim.server.x).all())


def test_the_divergence_check_skips_integer_tensors_and_names_the_first_non_finite_one() -> None:
    tensors = {"count": torch.tensor([3]), "w": torch.ones(2), "b": torch.tensor([1.0, float("inf")])}
    expected = r"^m: global 'b' became non-finite at round 7 \(diverged\): go$"
    with pytest.raises(FloatingPointError, match=expected):
        check_finite(tensors, owner="m", what="global", round=7, advice="go")
    finite = {"count": torch.tensor([3]), "w": torch.ones(2)}
    check_finite(finite, owner="m", what="global", round=1, advice="")   # nothing to say
