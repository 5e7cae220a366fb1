"""Parties on different hosts: each rank in its own network namespace, MPICH over TCP between them.

The namespace tests need root, iproute2 and a kernel that allows ``ip netns add``; elsewhere they
skip with the reason. The option checks and the launcher script are tested everywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from parties import hosts as host_options
from parties import netns
from tests.conftest import REPO_ROOT, run_mpi

N_HOSTS = 4


@pytest.fixture(scope="module")
def emulated():
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(reason)
    # A prefix and subnet of this test process only, so parallel runs on one machine do not collide.
    prefix, subnet = f"vt{os.getpid() % 100000}", f"10.214.{os.getpid() % 250}.0/24"
    try:
        hosts = netns.setup(N_HOSTS, prefix=prefix, subnet=subnet)
    except netns.NetnsError as err:  # e.g. namespaces allowed but bridges not
        pytest.skip(f"cannot emulate hosts here: {err}")
    try:
        yield hosts
    finally:
        netns.teardown(prefix)
    assert not any(name.startswith(f"{prefix}-h") for name in _namespaces()), "teardown left a namespace"


def _namespaces() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()


@pytest.mark.mpi
def test_each_rank_is_on_its_own_host_and_ranks_talk_tcp(emulated, tmp_path):
    run_mpi(N_HOSTS, ["tests/mpi_scripts/host_probe.py", "--out", str(tmp_path)], timeout=60,
            env=emulated.mpiexec_env())
    reports = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(N_HOSTS)]
    here = os.readlink("/proc/self/ns/net")
    assert len({r["netns"] for r in reports}) == N_HOSTS and here not in {r["netns"] for r in reports}
    assert [r["hostname"] for r in reports] == list(emulated.namespaces)
    assert len({r["processor"] for r in reports}) == N_HOSTS  # MPICH sees four nodes: no shared memory
    for rank, report in enumerate(reports):
        mine = emulated.addresses[rank]
        peers = {remote.split(":")[0] for local, remote in report["tcp"] if local.startswith(f"{mine}:")}
        others = set(emulated.addresses) - {mine}
        assert others <= peers, f"rank {rank} on {mine} has no TCP connection to {sorted(others - peers)}"


@pytest.mark.mpi
@pytest.mark.parametrize("engine", ["python", "compiled"])
def test_vfl_train_runs_across_four_hosts(emulated, tmp_path, engine):
    """Every rank in its own network namespace; ``--engine compiled`` too (its pump is compiled into
    numba's cache first, as tests/test_compiled_loop.py does, not by four ranks at once)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    engine_options = ["--engine", engine]
    if engine == "compiled":  # it runs sgd (the default is svrg)
        engine_options += ["--algorithm", "sgd"]
        warm = "from parties.compiled_pump import compile_once; compile_once()"
        subprocess.run([sys.executable, "-c", warm], cwd=REPO_ROOT, env=env, check=True, timeout=300)
    emulated.launch_log.unlink(missing_ok=True)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "vfl.cli", "train", "-n", str(N_HOSTS), "--dataset", "breast-cancer",
           "--epochs", "1", "--out", str(out), "--no-progress", *engine_options,
           *emulated.train_options()]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["updates"] > 0 and result["record"]["test_accuracy"] > 0.9
    launched = [tuple(line.split()) for line in emulated.launch_log.read_text().splitlines()]
    assert sorted(launched) == sorted(zip(emulated.addresses, emulated.namespaces, strict=True))


def _links() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout


def test_setup_is_idempotent_and_cleans_up_after_a_failed_step(emulated, monkeypatch):
    prefix, subnet = f"vu{os.getpid() % 100000}", f"10.216.{os.getpid() % 250}.0/24"
    netns.setup(2, prefix=prefix, subnet=subnet)
    again = netns.setup(2, prefix=prefix, subnet=subnet)  # leftovers of the same prefix are replaced
    assert sorted(n for n in _namespaces() if n.startswith(f"{prefix}-")) == sorted(again.namespaces)
    assert sorted(netns.teardown(prefix)) == sorted([*again.namespaces, again.bridge])
    assert netns.teardown(prefix) == []

    real_run = netns._run

    def failing(cmd, *, check=True):
        if cmd[:3] == ["ip", "-n", f"{prefix}-h1"] and "addr" in cmd:
            raise netns.NetnsError("injected failure")
        return real_run(cmd, check=check)

    monkeypatch.setattr(netns, "_run", failing)
    with pytest.raises(netns.NetnsError, match="injected"):
        netns.setup(2, prefix=prefix, subnet=subnet)
    assert not [n for n in _namespaces() if n.startswith(f"{prefix}-")]
    assert f"{prefix}br" not in _links() and not (netns.STATE_ROOT / prefix).exists()


def test_launcher_enters_the_namespace_of_the_named_host(tmp_path):
    hosts = dataclasses.replace(netns.plan(2, prefix="vx", subnet="10.9.8.0/29"), folder=tmp_path)
    script = tmp_path / "launcher"
    script.write_text(netns._launcher_script(hosts))
    script.chmod(0o755)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ip").write_text('#!/bin/sh\n'
                             'echo "ip $*"; env | grep -E "^(MPIR_CVAR_CH4_NETMOD|FI_PROVIDER)="\n')
    (fake / "ip").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    ran = subprocess.run([str(script), "-x", "10.9.8.2", "/bin/proxy --id 1"], capture_output=True,
                         text=True, env=env)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("ip netns exec vx-h1 unshare --uts sh -c")
    assert "/bin/proxy --id 1" in ran.stdout and "FI_PROVIDER=tcp" in ran.stdout
    assert (tmp_path / "launched.log").read_text() == "10.9.8.2 vx-h1\n"
    stranger = subprocess.run([str(script), "-x", "10.9.8.5", "true"], capture_output=True, text=True,
                              env=env)
    assert stranger.returncode == 255 and "not one of the emulated hosts" in stranger.stderr


def test_plan_refuses_bad_names_and_full_subnets():
    assert netns.plan(3, prefix="ab", subnet="10.1.2.0/24").addresses == ("10.1.2.1", "10.1.2.2", "10.1.2.3")
    assert netns.plan(3, prefix="ab", subnet="10.1.2.0/24").gateway == "10.1.2.254"
    with pytest.raises(netns.NetnsError, match="prefix"):
        netns.plan(2, prefix="Bad-Name")
    with pytest.raises(netns.NetnsError, match="do not fit"):
        netns.plan(7, subnet="10.1.2.0/29")  # 6 usable addresses, one of them the bridge's
    with pytest.raises(netns.NetnsError, match="subnet"):
        netns.plan(2, subnet="10.1.2.300/24")


def test_setup_refuses_clearly_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in netns.unavailable()
    with pytest.raises(netns.NetnsError, match="root"):
        netns.setup(2)
    assert netns.main(["up", "-n", "2"]) == 2


def _options(**given) -> argparse.Namespace:
    return argparse.Namespace(**{"hostfile": None, "launcher_exec": None, "iface": None, **given})


def test_host_options_become_hydra_environment(tmp_path):
    assert host_options.mpiexec_env(_options()) == {}  # one host: mpiexec exactly as before
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the parties\nbank-a.example\nhospital-b.example:1\n")
    launcher = tmp_path / "launcher"
    launcher.write_text("#!/bin/sh\nexec ssh \"$@\"\n")
    launcher.chmod(0o755)
    env = host_options.mpiexec_env(_options(hostfile=str(hostfile), launcher_exec=str(launcher), iface="lo"),
                                   environ={})
    assert env == {"HYDRA_HOST_FILE": str(hostfile), "HYDRA_LAUNCHER": "ssh",
                   "HYDRA_LAUNCHER_EXEC": str(launcher), "HYDRA_IFACE": "lo", "MPIR_CVAR_CH4_NETMOD": "ofi"}
    chosen = host_options.mpiexec_env(_options(hostfile=str(hostfile)),
                                      environ={"MPIR_CVAR_CH4_NETMOD": "ucx"})
    assert "MPIR_CVAR_CH4_NETMOD" not in chosen  # the user's own choice stands


@pytest.mark.parametrize("given, message", [
    ({"launcher_exec": "/bin/sh"}, "needs --hostfile"),
    ({"hostfile": "/no/such/hosts"}, "cannot read it"),
    ({"hostfile": "EMPTY"}, "no host in it"),
    ({"hostfile": "HOSTS", "launcher_exec": "HOSTS"}, "not an executable file"),
    ({"hostfile": "HOSTS", "iface": "no-such-if0"}, "no such network interface"),
])
def test_bad_host_options_are_one_line_usage_errors(tmp_path, capsys, given, message):
    (tmp_path / "EMPTY").write_text("\n# nothing\n")
    (tmp_path / "HOSTS").write_text("10.0.0.1\n")
    argv = ["train"]
    for key, value in given.items():
        argv += [f"--{key.replace('_', '-')}", str(tmp_path / value) if value.isupper() else value]
    from vfl.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
