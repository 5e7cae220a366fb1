"""FedBAT and its post-training baselines under mpiexec (``--model cnn``): bit for bit the simulation's
trajectory and records, the uplink measured on the wire, and uplinks checked before they are used."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from horizontal.engine import Streams
from horizontal.layered import FederatedCNN, ModelLayout
from horizontal.rounds import sample_clients
from parties.hfl import HflConfig, build_algorithm, client_blocks, load_training_data, main, validate
from parties.hfl.config import build_cnn
from parties.hfl.layered import LayeredServerRank, pack_state, unpack_state
from parties.hfl.wire import WireError
from tests.hfl_mpi_cases import case_config, run_cases

SMALL = HflConfig(dataset="digits", model="cnn", widths=[4, 8, 8], clients=6, per_round=3, local_epochs=2,
                  batch_size=16, lr_local=0.05, rounds=4, eval_every=2, processes=2, progress=False,
                  trajectory=True)

CASES: dict[str, dict[str, object]] = {
    # S = 1: every round one process sits out and replays the sampled client's minibatch draws
    "fedbat": {"algorithm": "fedbat", "per_round": 1, "seed": 1, "options": {"rho": "3", "phi": "0.5"}},
    "fedbat-clamp-last-forward": {"algorithm": "fedbat",
                                  "options": {"alpha_clamp": "0.0005,0.05", "upload": "last_forward"}},
    "ef-signsgd-files": {"algorithm": "ef-signsgd"},           # error memory lives with the client's process
    "fedpaq": {"algorithm": "fedpaq", "compressor": "dithering:levels=7"},
    "stoc-signsgd": {"algorithm": "stoc-signsgd", "options": {"alpha": "0.02"}},
    "fedavg": {"algorithm": "fedavg", "per_round": 2},
}


def _config(name: str, root: Path) -> HflConfig:
    return case_config(SMALL, CASES, name, root)


@pytest.fixture(scope="module")
def mpi_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case in one mpiexec job (server + 2 client processes), one config after another."""
    return run_cases(tmp_path_factory.mktemp("hfl_mpi_layered"), SMALL, CASES, timeout=240,
                     env={"OMP_NUM_THREADS": "1"})


def _simulation(config: HflConfig) -> FederatedCNN:
    data, test = load_training_data(config)
    return FederatedCNN(build_algorithm(config), build_cnn(config), data, clients_per_round=config.per_round,
                        training=config.local_training, seed=config.seed, test=test)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The ranks under mpiexec run torch on one thread each; float32 convolutions sum in another order
    with two threads (differences of ~1e-7), so the simulation runs on one thread too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(CASES))
def test_mpi_run_is_the_simulation_bit_for_bit(mpi_runs: Path, name: str, one_thread: None) -> None:
    config = validate(_config(name, mpi_runs))
    sim = _simulation(config)
    trajectory = np.load(mpi_runs / name / "trajectory.npz")
    records = [json.loads(line) for line in (mpi_runs / name / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == config.rounds and set(trajectory.files) == set(sim.state)
    blocks = [set(b.tolist()) for b in client_blocks(config.clients, config.processes)]
    sampling = Streams.from_seed(config.seed, config.clients).sampling     # the server's draws, replayed
    sat_out = set()
    for t, record in enumerate(records):
        clients = set(sample_clients(config.clients, config.per_round, sampling).tolist())
        expected = sim.step() | (sim.evaluate() if "test_loss" in record else {})
        for key, value in sim.state.items():
            assert np.array_equal(trajectory[key][t], value.numpy()), f"{name}: {key} after round {t + 1}"
        for key, value in expected.items():
            if key != "round_seconds":
                assert record[key] == value, f"{name}: {key} in round {t + 1}"
        sat_out |= {p for p, block in enumerate(blocks) if not block & clients}
    if config.per_round == 1:
        assert sat_out == {0, 1}, "each process sat out a round and replayed the other's draws"


@pytest.mark.parametrize("options, message", [
    (["--algorithm", "fedbat"], "fedbat runs on the BatchNorm CNN: add --model cnn"),
    (["--model", "cnn", "--algorithm", "scaffold"], "scaffold runs on the flat models"),
    (["--model", "cnn", "--algorithm", "fedbat", "--dtype", "float64"], "trains in float32"),
    (["--model", "cnn", "--algorithm", "fedbat", "--lr-global", "2"], "drop --lr-global"),
    (["--model", "cnn", "--algorithm", "fedbat", "--widths", "4,4,4,4"], "4 pooling stages are too many"),
    (["--model", "cnn", "--algorithm", "fedbat", "--alpha-clamp", "0.1,0.01"], "alpha_clamp must be"),
    (["--model", "cnn", "--algorithm", "fedbat", "--upload", "mean"], "choose one of final_fresh"),
    (["--model", "cnn", "--algorithm", "fedpaq"], "fedpaq needs --compressor"),
    (["--model", "cnn", "--algorithm", "fedpaq", "--compressor", "sign"], "unbiased"),
    (["--model", "cnn", "--algorithm", "signsgd", "--sigma", "0.1"], "--sigma does not apply to signsgd"),
])
def test_bad_layered_options_fail_before_any_rank_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         options: list[str], message: str) -> None:
    assert main([*options, "--out", str(tmp_path / "run")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "config.json").exists()


def test_state_on_the_wire_is_checked_against_the_receivers_own_layout() -> None:
    config = validate(SMALL)
    state = build_cnn(config).state_dict()
    data = pack_state(state, list(state))
    back = unpack_state(data, state, "state")
    assert all(torch.equal(back[k], v) for k, v in state.items())
    with pytest.raises(WireError, match="bytes where the model's tensors take"):
        unpack_state(data[:-4], state, "state")
    poisoned = {k: v.clone() for k, v in state.items()}
    next(v for v in poisoned.values() if v.is_floating_point()).view(-1)[0] = float("nan")
    with pytest.raises(WireError, match="non-finite"):
        unpack_state(pack_state(poisoned, list(state)), state, "state")


def test_server_rejects_an_uplink_that_does_not_decode_or_is_not_finite() -> None:
    config = validate(dataclasses.replace(SMALL, algorithm="ef-signsgd"))
    model, method = build_cnn(config), build_algorithm(config)
    server = LayeredServerRank(None, config, method, model, Streams.from_seed(0, config.clients),
                               [[0, 1, 2], [3, 4, 5]], np.full(config.clients, 10), None)
    layout = ModelLayout.of(model)
    state = model.state_dict()
    updates = [torch.full(s, 0.01) for s in layout.shapes]
    payload = method.codec.encode_signs([u > 0 for u in updates], [0.01] * len(updates))
    extras = pack_state(state, layout.extras)
    entry = {"nbytes": len(payload), "loss": 0.5, "info": {}}

    def read(body: bytes, meta_entry: dict[str, object] = entry) -> object:
        meta = {"clients": [1], "uploads": [meta_entry]}
        return server._read_uplink(meta, np.frombuffer(body, np.uint8), [1])

    [(k, upload, update)] = read(payload + extras)                   # type: ignore[misc]
    assert k == 1 and upload.n_samples == 10 and torch.equal(update[0], updates[0])
    with pytest.raises(WireError, match="does not account"):
        read(payload[:-1] + extras)
    with pytest.raises(ValueError, match="layered update of"):
        read(payload[:-1] + extras, entry | {"nbytes": len(payload) - 1} | {})
    bad_scale = np.float32(np.inf).tobytes() + payload[4:]
    with pytest.raises(WireError, match="non-finite"):
        read(bad_scale + extras)
    with pytest.raises(WireError, match="finite numbers"):
        read(payload + extras, entry | {"info": {"alpha": ["x"]}})
    with pytest.raises(WireError, match="answered for clients"):
        body = np.frombuffer(payload + extras, np.uint8)
        server._read_uplink({"clients": [2], "uploads": [entry]}, body, [1])
