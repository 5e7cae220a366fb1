"""Federation of a horizontal job (``[job] kind = "hfl"``): a ``parties.hfl`` server and its client
processes, each started by its own organisation as ``vfl party``, each in its own network namespace
when the machine allows it (the ``hosts`` fixture of ``tests/test_federation.py``).

The job is FedAvg on digits, float64, a few rounds: it must end with the model that the same job under
one ``mpiexec`` (``python -m parties.hfl --client-files``) ends with, bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from parties.config import ConfigError
from parties.federation.jobfile import parse_job
from parties.launch import write_private_key
from protocols.channels import generate_key_pair
from tests.conftest import REPO_ROOT
from tests.test_federation import (
    OPEN_AUDIT,
    error_line,
    free_port,
    kill_leftovers,
    run_parties,
    the_others_end,
)
from tests.test_federation import hosts as hosts  # the fixture: one network namespace a party

NAMES = ("server-org", "clinic-a", "clinic-b")
#: The job: small, deterministic (float64), and long enough to learn something.
JOB = {"kind": "hfl", "algorithm": "fedavg", "model": "softmax", "n-features": 64, "n-classes": 10,
       "clients": 6, "per-round": 3, "rounds": 4, "local-steps": 5, "lr-local": 0.2, "batch-size": 16,
       "dtype": "float64", "seed": 0, "eval-every": 4}
#: The same options as `python -m parties.hfl` flags.
FLAGS = ["--algorithm", "fedavg", "--model", "softmax", "--clients", "6", "--per-round", "3",
         "--rounds", "4", "--local-steps", "5", "--lr-local", "0.2", "--batch-size", "16",
         "--dtype", "float64", "--seed", "0", "--eval-every", "4"]


def hfl_job_text(keys: dict[str, bytes], address: str, **changes) -> str:
    options = {**JOB, **changes}
    lines = ["[job]", *(f"{k} = {json.dumps(v)}" for k, v in options.items() if v is not None)]
    for i, name in enumerate(keys):
        lines += ["", "[[party]]", f'name = "{name}"', f'role = "{"server" if i == 0 else "client"}"']
        if i == 0:
            lines.append(f'address = "{address}"')
        lines.append(f'public_key = "{keys[name].hex()}"')
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def hfl_split(tmp_path_factory):
    """digits, 6 clients (IID) in 2 client files and the server's test.npz."""
    from parties.hfl.cli import main

    folder = tmp_path_factory.mktemp("hfl-split")
    assert main(["split", "--dataset", "digits", "--clients", "6", "--processes", "2", "--partition", "iid",
                 "--seed", "0", "--out", str(folder)]) == 0
    return folder


class HflOrg:
    """One organisation: its key, its copy of the job file, its one data file, its run folder."""

    def __init__(self, root: Path, rank: int, split: Path) -> None:
        self.name, self.rank = NAMES[rank], rank
        self.root = root / self.name
        self.root.mkdir(parents=True)
        private, self.public = generate_key_pair()
        self.key = self.root / "party.key"
        write_private_key(self.key, private)
        own = "test.npz" if rank == 0 else f"clients-{rank - 1}.npz"
        self.data = self.root / own
        shutil.copy(split / own, self.data)
        self.run = self.root / "run"
        self.job = self.root / "job.toml"

    def command(self, *more: str, prefix: tuple[str, ...] = ()) -> list[str]:
        return [*prefix, sys.executable, "-m", "vfl.cli", "party", str(self.job), "--as", self.name,
                "--key", str(self.key), "--data", str(self.data), "--folder", str(self.run),
                "--no-progress", *more]


def make_hfl_orgs(tmp_path: Path, split: Path, address: str) -> list[HflOrg]:
    orgs = [HflOrg(tmp_path, rank, split) for rank in range(len(NAMES))]
    text = hfl_job_text({o.name: o.public for o in orgs}, address)
    for org in orgs:
        org.job.write_text(text)
    return orgs


@pytest.mark.mpi
def test_a_horizontal_job_of_three_organisations_ends_with_the_one_mpiexec_model(hfl_split, hosts, tmp_path,
                                                                                 record_property):
    places, fallback = hosts
    if fallback:
        record_property("fallback", fallback)
    port = 17800 if not fallback else free_port()
    orgs = make_hfl_orgs(tmp_path, hfl_split, f"{places[0][1]}:{port}")
    log = tmp_path / "opened.log"
    env = {"PYTHONPATH": f"{OPEN_AUDIT}{os.pathsep}{REPO_ROOT}", "VFL_OPEN_LOG": str(log)}
    results = run_parties([org.command("--join-timeout", "60", prefix=place)
                           for org, (place, _) in zip(orgs, places, strict=True)], timeout=240, env=env)
    for org, result in zip(orgs, results, strict=True):
        assert result.returncode == 0, f"{org.name}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"

    one = tmp_path / "one-mpiexec"
    done = subprocess.run([sys.executable, "-m", "parties.hfl", "--client-files", str(hfl_split), "-P", "2",
                           *FLAGS, "--no-progress", "--out", str(one)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with np.load(one / "model.npz") as expected, np.load(orgs[0].run / "model.npz") as got:
        assert expected.files == got.files and all(np.array_equal(expected[k], got[k]) for k in got.files)
    last = json.loads((one / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["test_accuracy"] > 0.5   # it learned something: the comparison is not of two untrained models
    for org, result in zip(orgs[1:], results[1:], strict=True):
        summary = json.loads((org.run / "result.json").read_text())
        assert summary["from"] == NAMES[0] and summary["rounds"] == 4
        assert summary["record"]["test_accuracy"] == last["test_accuracy"]
        assert "test_accuracy" in result.stdout

    # each folder holds only its own files: the server's model and metrics, the clients' summaries
    assert sorted(p.name for p in orgs[0].run.iterdir()) == ["metrics.csv", "metrics.jsonl", "model.npz",
                                                             "party.json"]
    for org in orgs[1:]:
        assert sorted(p.name for p in org.run.iterdir()) == ["party.json", "result.json"]
    touched: dict[str, set[str]] = {}
    for line in log.read_text().splitlines():
        pid, _event, path = line.split(" ", 2)
        touched.setdefault(pid, set()).add(path)
    for paths in touched.values():
        mine = {o.name for o in orgs if any(p.startswith(str(o.root) + os.sep) for p in paths)}
        assert len(mine) <= 1, f"one process touched the folders of {sorted(mine)}"


@pytest.mark.mpi
def test_a_client_whose_file_does_not_fit_the_job_is_refused_in_one_line(hfl_split, tmp_path):
    orgs = make_hfl_orgs(tmp_path, hfl_split, f"127.0.0.1:{free_port()}")
    shutil.copy(hfl_split / "test.npz", orgs[1].data)   # the server's file where a client's should be
    result = run_parties([orgs[1].command()], timeout=60)[0]
    assert result.returncode == 2
    assert error_line(result).startswith(f"vfl party {NAMES[1]}: error: client file {orgs[1].data}")


@pytest.mark.mpi
def test_a_client_that_claims_another_clients_rows_ends_the_run_for_everyone_named(hfl_split, tmp_path):
    """After the join: the server refuses a client process that hosts a client another one hosts (its
    line names the rank, which the start line maps to the party), and the run line ends the others."""
    orgs = make_hfl_orgs(tmp_path, hfl_split, f"127.0.0.1:{free_port()}")
    shutil.copy(hfl_split / "clients-0.npz", orgs[2].data)   # clinic-b brings clinic-a's clients
    commands = [org.command("--join-timeout", "60") for org in orgs]
    server, clinic_a, clinic_b = run_parties(commands, timeout=120)
    assert server.returncode == 1 and clinic_a.returncode == 1 and clinic_b.returncode == 1
    assert error_line(server) == (f"vfl party {NAMES[0]}: error: rank 2 (client process 1) hosts client 0, "
                                  "which rank 1 (client process 0) hosts too")
    assert f"ranks 0 {NAMES[0]}, 1 {NAMES[1]}, 2 {NAMES[2]}" in server.stdout
    for client in (clinic_a, clinic_b):
        assert f"the leader {NAMES[0]} left the run" in client.stderr, client.stderr
    assert not (orgs[0].run / "model.npz").exists()


@pytest.mark.mpi
def test_a_client_killed_mid_run_ends_the_run_for_the_others_named(hfl_split, tmp_path):
    import signal

    from tests.test_federation import _party_process

    orgs = make_hfl_orgs(tmp_path, hfl_split, f"127.0.0.1:{free_port()}")
    text = orgs[0].job.read_text().replace('rounds = 4', 'rounds = 100000').replace('eval-every = 4',
                                                                                    'eval-every = 100000')
    for org in orgs:
        org.job.write_text(text)
    full = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    procs = [subprocess.Popen(o.command("--join-timeout", "60"), cwd=REPO_ROOT, env=full,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for o in orgs]
    try:
        metrics, deadline = orgs[0].run / "metrics.jsonl", time.monotonic() + 150
        while time.monotonic() < deadline and all(p.poll() is None for p in procs) and not (
                metrics.exists() and metrics.stat().st_size):
            time.sleep(0.05)
        victim = _party_process(orgs[2])
        assert victim is not None and metrics.stat().st_size, "the rounds did not start"
        os.kill(victim, signal.SIGKILL)
        dead = time.monotonic()
        ended, outputs = the_others_end(procs, dead)
    finally:
        kill_leftovers(procs)
    assert max(ended) < 5, f"the others took {ended} s after the client died"
    for proc, (_, err) in zip(procs[:2], outputs[:2], strict=True):
        assert proc.returncode == 1
        assert f"the run ended: {NAMES[2]} (party 2) left the run" in err.strip().splitlines()[-1], err
    assert not (orgs[0].run / "model.npz").exists()


# --------------------------------------------------------------------------------- the job file


def _keys() -> dict[str, bytes]:
    return {name: bytes([i + 1]) * 32 for i, name in enumerate(NAMES)}


def test_an_hfl_job_file_reads_like_the_hfl_command_and_fills_in_defaults():
    scaffold = {"cv-init": "full_grad", "algorithm": "scaffold"}
    job = parse_job(hfl_job_text(_keys(), "10.0.0.1:7700", **scaffold))
    assert job.kind == "hfl" and job.options.processes == 2
    assert job.options.options == {"cv_init": "full_grad"}
    assert job.options.n_features == 64 and job.options.lr_global == 1.0   # a default, filled in
    same = parse_job(hfl_job_text(_keys(), "10.0.0.1:7700", **scaffold, **{"lr-global": 1.0}))
    assert same.digest() == job.digest()
    assert parse_job(hfl_job_text(_keys(), "10.0.0.1:7700", rounds=5)).digest() != job.digest()


@pytest.mark.parametrize("change, message", [
    ({"secure-channels": True}, "is not an hfl job option: the horizontal frames are not sealed"),
    ({"dataset": "digits"}, "is not an hfl job option: each party gives its own data file"),
    ({"n-classes": None}, "needs n-classes"),
    ({"roundz": 3}, "has no hfl option 'roundz' (did you mean rounds?)"),
    ({"rounds": 1.5}, "rounds must be a whole number"),
    ({"per-round": 9}, "per-round"),
    ({"kind": "hfx"}, 'kind must be "vfl" (the default) or "hfl"'),
])
def test_bad_hfl_job_files_are_refused_in_one_line(change, message):
    with pytest.raises(ConfigError) as err:
        parse_job(hfl_job_text(_keys(), "10.0.0.1:7700", **change))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_hfl_job_has_one_server_listed_first():
    text = hfl_job_text(_keys(), "10.0.0.1:7700").replace('role = "server"', 'role = "client"', 1)
    with pytest.raises(ConfigError, match="one server, listed first"):
        parse_job(text)
    text = hfl_job_text(_keys(), "10.0.0.1:7700").replace('role = "client"', 'role = "passive"', 1)
    with pytest.raises(ConfigError, match='role must be "server" or "client"'):
        parse_job(text)


def test_resume_and_audit_are_refused_for_a_horizontal_job(hfl_split, tmp_path, capsys):
    from vfl.cli import main

    orgs = make_hfl_orgs(tmp_path, hfl_split, "127.0.0.1:7700")
    for flag in ("--resume", "--audit"):
        code = main(["party", str(orgs[1].job), "--as", orgs[1].name, "--key", str(orgs[1].key), "--data",
                     str(orgs[1].data), "--folder", str(orgs[1].run), flag])
        assert code == 2
        assert f"{flag} is for vertical jobs" in capsys.readouterr().err


class _Replay:
    """A communicator stand-in whose Recv hands out the given buffers in order (one peer's frame)."""

    def __init__(self, *buffers: np.ndarray) -> None:
        self.buffers = list(buffers)

    def Recv(self, buf, source, tag) -> None:
        buf[...] = self.buffers.pop(0)

    def Irecv(self, buf, source, tag):  # the header's wait polls (parties/hfl/wire.py, _await)
        self.Recv(buf, source, tag)
        return SimpleNamespace(Test=lambda: True)


@pytest.mark.parametrize("meta, message", [(b"\xff{", "meta is not JSON"),
                                           (b"[1, 2]", "meta is not a JSON object")])
def test_a_frame_whose_meta_is_not_a_json_object_is_refused_naming_the_sender(meta, message):
    from parties.hfl.wire import Kind, WireError, recv_frame

    header = np.array([int(Kind.UPLINK), len(meta), 0], dtype=np.int64)
    with pytest.raises(WireError, match=f"rank 2 sent a UPLINK frame whose {message}"):
        recv_frame(_Replay(header, np.frombuffer(meta, dtype=np.uint8)), 2, Kind.UPLINK, max_body=0)
