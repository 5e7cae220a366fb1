"""Horizontal FL under mpiexec: the same trajectory as the simulation, the uplink bits measured on the
wire, client data files, clear option errors, and a killed rank ending the job."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from horizontal import FederatedSimulation, Message
from parties.hfl import (
    HflConfig,
    build_algorithm,
    build_model,
    build_parser,
    client_blocks,
    from_args,
    load_training_data,
    main,
    validate,
    write_client_files,
)
from parties.hfl.wire import WireError, decode_uplink, encode_uplink, pack_vectors, unpack_vectors
from protocols.compression import get_compressor
from tests.conftest import REPO_ROOT, says_died_first
from tests.hfl_mpi_cases import case_config, run_cases

SMALL = HflConfig(dataset="digits", model="softmax", dtype="float64", clients=6, per_round=3, local_steps=3,
                  batch_size=8, rounds=5, eval_every=2, processes=2, lr_local=0.2, progress=False,
                  trajectory=True)

CASES: dict[str, dict[str, object]] = {
    # S = 1: every round one client process sits out and must catch up on the shared minibatch stream
    "fedavg": {"algorithm": "fedavg", "per_round": 1, "seed": 1},
    "scaffold": {"algorithm": "scaffold", "per_round": 2, "options": {"cv_init": "minibatch"}},
    "scafcom-top-r": {"algorithm": "scafcom", "compressor": "top-r:r=0.1",
                      "options": {"beta": "0.3", "cv_init": "full_grad"}},
    "scallion-dithering-files": {"algorithm": "scallion", "compressor": "dithering:bits=2",
                                 "options": {"alpha": "0.5"}},
    "fedcomgate-reply": {"algorithm": "fedcomgate", "compressor": "dithering:bits=3"},
    # two compressed messages a client, and options that only the options dataclass declares
    "iscam-options": {"algorithm": "iscam", "compressor": "dithering:bits=2",
                      "options": {"beta1": "0.3", "beta2": "0.5", "u_update": "uncompressed_literal"}},
}


def _config(name: str, root: Path) -> HflConfig:
    return case_config(SMALL, CASES, name, root)


@pytest.fixture(scope="module")
def mpi_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case in one mpiexec job (server + 2 client processes), one config after another."""
    return run_cases(tmp_path_factory.mktemp("hfl_mpi"), SMALL, CASES, timeout=180)


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(CASES))
def test_mpi_run_follows_the_simulation_trajectory_and_bit_ledger(mpi_runs: Path, name: str) -> None:
    config = validate(_config(name, mpi_runs))
    data, test = load_training_data(config)
    sim = FederatedSimulation(build_algorithm(config), build_model(config), data, config.fl,
                              batch_size=config.batch_size, seed=config.seed, test=test)
    trajectory = np.load(mpi_runs / name / "trajectory.npz")
    records = [json.loads(line) for line in (mpi_runs / name / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == config.rounds
    assert set(trajectory.files) == set(sim.server.tensors())
    blocks = [set(b.tolist()) for b in client_blocks(config.clients, config.processes)]
    hosting_rounds: list[set[int]] = []
    for t, record in enumerate(records):
        expected = sim.step()
        for key, value in sim.server.tensors().items():
            np.testing.assert_allclose(trajectory[key][t], value.numpy(), rtol=0, atol=1e-10,
                                       err_msg=f"{name}: server {key} after round {t + 1}")
        assert record["uplink_bits"] == expected["uplink_bits"]     # bytes that crossed MPI, times 8
        assert record["downlink_bits"] == expected["downlink_bits"]
        assert record["gradient_evaluations"] == expected["gradient_evaluations"]   # the same server step
        assert record["local_loss"] == pytest.approx(expected["local_loss"], rel=1e-12)
        if "train_loss" in record:
            for key, value in sim.evaluate().items():
                assert record[key] == pytest.approx(value, rel=1e-12), key
        sampled = set(sim.last_clients.tolist())
        hosting_rounds.append({p for p, block in enumerate(blocks) if block & sampled})
    assert all(hosting_rounds), "every round has participants"
    if CASES[name].get("per_round") == 1:
        assert {1} in hosting_rounds and {0} in hosting_rounds, "each process sat out a round, then caught up"


@pytest.mark.mpi
def test_killed_client_rank_ends_the_job_with_a_message(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "parties.hfl", "--algorithm", "fedavg", "--clients", "6", "--per-round", "3",
           "--local-steps", "1", "--rounds", "100000000", "--eval-every", "100000000", "--processes", "2",
           "--out", str(out), "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and metrics.stat().st_size > 0):   # rounds are being logged
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the job never started training"
            time.sleep(0.1)
        os.kill(int((out / "party-2.pid").read_text()), signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert says_died_first(stderr, "rank 2 (client process 1)"), stdout + stderr


@pytest.mark.parametrize(("options", "message"), [
    (["--algorithm", "fedprox"], "unknown --algorithm 'fedprox'"),
    (["--algorithm", "scafcom"], "scafcom needs --compressor"),
    (["--algorithm", "fedavg", "--beta", "0.2"], "--beta does not apply to fedavg"),
    (["--algorithm", "scafcom", "--compressor", "top-r:q=3"], "bad parameters for compressor 'top-r'"),
    (["--algorithm", "fedavg", "--beta1", "0.3"], "--beta1 does not apply to fedavg"),
    (["--algorithm", "iscam", "--compressor", "identity", "--beta1", "2"], "ISCAM beta1 must be in (0, 1]"),
    (["--algorithm", "iscam", "--compressor", "identity", "--beta2", "x"], "--beta2 'x': expected a number"),
    (["--algorithm", "iscam", "--compressor", "identity", "--u-update", "exact"],
     "--u-update 'exact': choose one of compressed, uncompressed_literal"),
    (["--algorithm", "scallion", "--compressor", "top-r:r=0.1", "--allow-biased", "no"],
     "scallion needs an unbiased compressor"),
    (["--clients", "4", "--per-round", "5"], "--per-round"),
    (["--clients", "4", "--per-round", "2", "--processes", "5"], "every client process must host"),
    (["--model", "least-squares"], "--model least-squares does not fit data with class labels"),
    (["--dataset", "diabetes", "--model", "least-squares"], "use --partition iid"),
    (["--client-files", "/nonexistent/folder"], "missing clients-0.npz, clients-1.npz"),
])
def test_bad_options_fail_before_any_rank_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 options: list[str], message: str) -> None:
    assert main([*options, "--out", str(tmp_path / "run")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "config.json").exists()


def test_client_files_hold_each_client_once_and_are_checked(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    config = dataclasses.replace(SMALL, clients=7, processes=3)
    paths = write_client_files(config, tmp_path)
    data, _ = load_training_data(validate(config))
    hosted = []
    for path, block in zip(paths, client_blocks(7, 3), strict=True):
        with np.load(path) as f:
            assert f["client_ids"].tolist() == block.tolist()
            lo, hi = int(data.offsets[block[0]]), int(data.offsets[block[-1] + 1])
            np.testing.assert_array_equal(f["X"], data.X[lo:hi].numpy())
            hosted.extend(f["client_ids"].tolist())
    assert hosted == list(range(7))
    assert main(["--client-files", str(tmp_path), "--clients", "8", "--processes", "3",
                 "--out", str(tmp_path / "run")]) == 2
    assert "federation of 7 clients, but --clients is 8" in capsys.readouterr().err


def test_every_iscam_option_reaches_the_algorithm_from_the_command_line() -> None:
    args = ["--algorithm", "iscam", "--compressor", "dithering:bits=2", "--beta1", "0.3", "--beta2", "0.5",
            "--u-update", "uncompressed_literal", "--cv-init", "zeros", "--allow-biased", "false"]
    config = from_args(build_parser().parse_args(args))
    assert HflConfig.from_json(config.to_json()) == config            # what every rank reads back
    algorithm = build_algorithm(config)
    assert (algorithm.beta1, algorithm.beta2, algorithm.u_update, algorithm.cv_init, algorithm.allow_biased) \
        == (0.3, 0.5, "uncompressed_literal", "zeros", False)
    assert algorithm.compressor == get_compressor("dithering", bits=2)


def test_uplink_decoding_rejects_a_body_that_does_not_match_its_layout() -> None:
    top = get_compressor("top-r", r=0.25)
    rows = torch.randn(2, 16, dtype=torch.float64)
    generators = [torch.Generator().manual_seed(s) for s in range(2)]
    up = {"delta": Message.compressed(top, rows, generators), "x": Message.full_precision(rows)}
    entries, chunks = encode_uplink(up, top)
    body = np.frombuffer(chunks, dtype=np.uint8)
    parts = decode_uplink(entries, body, top, 16, torch.float64)
    assert parts["delta"].payloads == up["delta"].payloads and parts["x"].payloads is None
    for key in up:
        assert parts[key].bits == up[key].bits
        torch.testing.assert_close(parts[key].values, up[key].values, rtol=0, atol=0)
    with pytest.raises(WireError, match="accounts for"):
        decode_uplink(entries, body[:-1], top, 16, torch.float64)
    with pytest.raises(WireError, match="full precision only"):
        decode_uplink(entries, body, None, 16, torch.float64)
    with pytest.raises(WireError, match="rows of"):
        decode_uplink(entries[1:], body[-2 * 16 * 8:], top, 17, torch.float64)
    with pytest.raises(WireError, match=r"decoded \(2, 16\), expected \(2, 12\)"):
        decode_uplink(entries[:1], body[:-2 * 16 * 8], top, 12, torch.float64)
    with pytest.raises(ValueError, match="declares no uplink compressor"):
        encode_uplink(up, None)
    layout, packed = pack_vectors({"x": rows[0], "c": rows[1].float()})
    restored = unpack_vectors(layout, packed)
    assert restored["c"].dtype == torch.float32
    torch.testing.assert_close(restored["x"], rows[0], rtol=0, atol=0)


class _Announcing:
    """A communicator whose peer sends only a frame header: what a receiver allocates comes after."""

    def __init__(self, header: list[int]) -> None:
        self.header, self.receives = header, 0

    def Recv(self, buf, source: int, tag: int) -> None:  # mpi4py's name
        self.receives += 1
        if self.receives > 1:
            raise AssertionError("the receiver went on to receive what the header announced")
        buf[:] = self.header

    def Irecv(self, buf, source: int, tag: int):  # the header's wait polls (wire._await)
        comm = self

        class Arrived:
            def Test(self) -> bool:
                comm.Recv(buf, source, tag)
                return True

        return Arrived()


@pytest.mark.parametrize("header", [[2, 0, 2**40], [2, 2**31, 0], [2, -1, 0], [2, 0, 1 << 20]])
def test_a_frame_announcing_more_than_the_job_needs_is_refused_before_allocation(header):
    from parties.hfl.wire import MAX_META_BYTES, Kind, body_limit, recv_frame

    comm = _Announcing(header)
    with pytest.raises(WireError, match=r"rank 3 sent frame kind 2 .* at most"):
        recv_frame(comm, 3, Kind.UPLINK, max_body=body_limit(dim=1000, vectors=4))
    assert comm.receives == 1 and MAX_META_BYTES < 2**31
