"""FedDRO under mpiexec (``--algorithm feddro``): the simulation's trajectory, ledger and objective, its
exchanges at every local step checked at the receiver, and options refused before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from horizontal.feddro import CompositionalSimulation, FederatedDRO
from parties.hfl import HflConfig, build_algorithm, load_training_data, main, validate
from parties.hfl.compositional import _read_rows
from parties.hfl.config import build_dro_model, build_objective
from parties.hfl.wire import WireError
from tests.hfl_mpi_cases import case_config, run_cases

SMALL = HflConfig(algorithm="feddro", dataset="digits", model="softmax", dtype="float64", clients=6,
                  per_round=6, batch_size=8, lr_local=0.1, rounds=4, eval_every=2, processes=2,
                  progress=False, trajectory=True)

CASES: dict[str, dict[str, object]] = {
    # y averaged at every step, y^{-1} from one initial exchange (init "blend", β < 1)
    "feddro-step": {"options": {"period": "2", "beta": "0.3"}},
    # FedAvg-CO Case II: y shared at each model round's first step only; client data files
    "fedavg-co-ii-files": {"options": {"period": "3", "beta": "1", "y_sync": "round"},
                           "objective": "chi2-dro", "dro_lambda": 2.0},
    # Case I with the switches: never shared, no y^{-1}, a second minibatch for the gradient
    "never-skip-independent": {"options": {"period": "2", "beta": "0.5", "y_sync": "never", "init": "skip",
                                           "independent_grad_batch": "true"}, "seed": 3},
    # MBSGD-CO on an MLP with the ERM objective
    "mbsgd-erm-mlp": {"options": {"period": "1", "beta": "1"}, "objective": "erm", "model": "mlp",
                      "hidden": [16], "rounds": 5},
}


def _config(name: str, root: Path) -> HflConfig:
    return case_config(SMALL, CASES, name, root)


@pytest.fixture(scope="module")
def mpi_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case in one mpiexec job (server + 2 client processes), one config after another."""
    return run_cases(tmp_path_factory.mktemp("hfl_mpi_compositional"), SMALL, CASES, timeout=240)


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(CASES))
def test_mpi_run_follows_the_simulation(mpi_runs: Path, name: str) -> None:
    config = validate(_config(name, mpi_runs))
    data, (X_test, y_test) = load_training_data(config)
    problem = FederatedDRO(build_dro_model(config), build_objective(config), data, config.batch_size)
    sim = CompositionalSimulation(build_algorithm(config), problem, config.lr_local, seed=config.seed)
    trajectory = np.load(mpi_runs / name / "trajectory.npz")["x"]
    records = [json.loads(line) for line in (mpi_runs / name / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == config.rounds == trajectory.shape[0]
    period = sim.algorithm.period
    for r, record in enumerate(records):
        sim.run(period)
        x = sim.state.x[0]
        np.testing.assert_allclose(trajectory[r], x.numpy(), rtol=0, atol=1e-12,
                                   err_msg=f"{name}: x̄ after model round {r + 1}")
        ledger = sim.ledger
        assert (record["inner_uplink_bits"], record["model_uplink_bits"]) == (ledger.inner_uplink_bits,
                                                                              ledger.model_uplink_bits)
        assert record["downlink_bits"] == ledger.inner_downlink_bits + ledger.model_downlink_bits
        if "train_objective" in record:
            objective = problem.objective.value(problem.client_losses(x))
            assert record["train_objective"] == pytest.approx(objective, rel=1e-12)
            losses, predictions = problem.model.losses_and_predictions(x, X_test, y_test)
            assert record["test_accuracy"] == float((predictions == y_test).double().mean())
            assert record["test_loss"] == pytest.approx(float(losses.mean()), rel=1e-12)
    if sim.algorithm.y_sync == "never":
        assert records[-1]["inner_uplink_bits"] == 0, "case I never sends an inner estimate"


@pytest.mark.parametrize("options, message", [
    (["--algorithm", "feddro", "--clients", "6", "--per-round", "3"],
     "set --per-round equal to --clients (6)"),
    (["--algorithm", "feddro", "--per-round", "20", "--lr-global", "0.5"], "drop --lr-global"),
    (["--algorithm", "feddro", "--per-round", "20", "--model", "cnn"], "trains --model softmax or mlp"),
    (["--algorithm", "feddro", "--per-round", "20", "--objective", "cvar"], "unknown --objective 'cvar'"),
    (["--algorithm", "feddro", "--per-round", "20", "--dro-lambda", "0"], "positive finite lambda"),
    (["--algorithm", "feddro", "--per-round", "20", "--y-sync", "often"], "choose one of step, round, never"),
    (["--algorithm", "feddro", "--per-round", "20", "--beta", "0"], "beta must lie in (0, 1]"),
])
def test_bad_feddro_options_fail_before_any_rank_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        options: list[str], message: str) -> None:
    assert main([*options, "--out", str(tmp_path / "run")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "config.json").exists()


def test_exchanged_rows_are_checked_for_length_and_finiteness() -> None:
    rows = torch.arange(6, dtype=torch.float64).reshape(3, 2)
    body = rows.numpy().reshape(-1).view(np.uint8)
    assert torch.equal(_read_rows(body, 3, 2, torch.float64, "rows"), rows)
    with pytest.raises(WireError, match="bytes where 2 x 2"):
        _read_rows(body, 2, 2, torch.float64, "rows")
    rows[1, 1] = float("inf")
    with pytest.raises(WireError, match="non-finite"):
        _read_rows(rows.numpy().reshape(-1).view(np.uint8), 3, 2, torch.float64, "rows")
