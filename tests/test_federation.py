"""Federation (``vfl party``): each organisation starts its own party from a job file, no launcher.

The real jobs (marked ``mpi``) start every party as its own ``vfl party`` command, each with its own
folder, key and copy of the job file; the training job runs each party in its own network namespace
(and UTS namespace) when the machine allows it, else on loopback, saying why. The job-file, hello and
command-line checks below them run without MPI.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from parties import netns
from parties.checkpoint import load_checkpoint
from parties.config import ConfigError
from parties.federation import hello
from parties.federation.jobfile import first_difference, parse_job
from parties.federation.leader import HelloServer, JoinFailed
from parties.launch import write_private_key
from protocols.channels import generate_key_pair
from tests.conftest import REPO_ROOT

NAMES = ("bank-a", "bank-b", "clinic-c")
#: A fourth organisation, for the q = 4 job (tests/test_federation_four.py).
NAMES_4 = (*NAMES, "insurer-d")
OPEN_AUDIT = REPO_ROOT / "tests" / "open_audit"
#: The job all three run: deterministic (sync-global, one active party), so it can be compared exactly.
JOB = {"algorithm": "sgd", "mode": "sync-global", "epochs": 2, "batch-size": 8, "seed": 0}


# --------------------------------------------------------------------------------------- helpers


def job_text(keys: dict[str, bytes], address: str, **changes) -> str:
    options = {**JOB, **changes}
    lines = ["[job]", *(f"{k} = {json.dumps(v)}" for k, v in options.items())]
    for i, name in enumerate(keys):   # in rank order
        lines += ["", "[[party]]", f'name = "{name}"', f'role = "{"active" if i == 0 else "passive"}"']
        if i == 0:
            lines.append(f'address = "{address}"')
        lines.append(f'public_key = "{keys[name].hex()}"')
    return "\n".join(lines) + "\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """breast-cancer split for three parties (party 0 holds the labels)."""
    from vfl.cli import main

    folder = tmp_path_factory.mktemp("split")
    assert main(["split", "breast-cancer", "-n", "3", "-m", "1", "--out", str(folder), "--overwrite"]) == 0
    return folder


class Org:
    """One organisation's own folder: its key, its copy of the job file, its data, its run folder."""

    def __init__(self, root: Path, rank: int, split: Path, names: tuple[str, ...] = NAMES) -> None:
        self.name, self.rank = names[rank], rank
        self.root = root / self.name
        self.root.mkdir(parents=True)
        private, self.public = generate_key_pair()
        self.key = self.root / "party.key"
        write_private_key(self.key, private)
        self.data = self.root / "data"
        shutil.copytree(split / f"party-{rank}", self.data)
        self.run = self.root / "run"
        self.job = self.root / "job.toml"

    def command(self, *more: str, prefix: tuple[str, ...] = ()) -> list[str]:
        return [*prefix, sys.executable, "-m", "vfl.cli", "party", str(self.job), "--as", self.name,
                "--key", str(self.key), "--data", str(self.data), "--folder", str(self.run),
                "--no-progress", *more]


def make_orgs(tmp_path: Path, split: Path, names: tuple[str, ...] = NAMES) -> list[Org]:
    return [Org(tmp_path, rank, split, names) for rank in range(len(names))]


def write_jobs(orgs: list[Org], address: str, **changes_at: dict) -> None:
    keys = {o.name: o.public for o in orgs}
    for org in orgs:
        org.job.write_text(job_text(keys, address, **changes_at.get(org.name, {})))


def breast_cancer_orgs(base: Path, **job: object) -> tuple[list[Org], Path]:
    """Three organisations of breast-cancer (``vfl split -n 3 -m 1`` in ``base/split``), with their job
    files written for a free local port and ``job``'s options at every party; and the split."""
    from vfl.cli import main

    split = base / "split"
    assert main(["split", "breast-cancer", "-n", "3", "-m", "1", "--out", str(split)]) == 0
    orgs = make_orgs(base, split)
    write_jobs(orgs, f"127.0.0.1:{free_port()}", **{o.name: dict(job) for o in orgs})
    return orgs, split


def run_parties(commands: list[list[str]], timeout: float, env: dict[str, str] | None = None
                ) -> list[subprocess.CompletedProcess]:
    """Start every command at once (each a separate `vfl party`), wait for all."""
    full = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    procs = [subprocess.Popen(cmd, cwd=REPO_ROOT, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for cmd in commands]
    done = []
    deadline = time.monotonic() + timeout
    try:
        for proc, cmd in zip(procs, commands, strict=True):
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            done.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return done


def run_staged(first: list[list[str]], then: list[list[str]], ready: str, timeout: float
               ) -> list[subprocess.CompletedProcess]:
    """Start ``first``, wait until each has printed ``ready`` (no sleep: its own words), then start
    ``then``; wait for all. Results in the order first + then."""
    full = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}

    def start(cmd: list[str]) -> subprocess.Popen:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    procs = [start(cmd) for cmd in first]
    heard: list[list[str]] = []
    try:
        for proc in procs:
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if ready in line:
                    break
            heard.append(lines)
        procs += [start(cmd) for cmd in then]
        heard += [[] for _ in then]
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return [subprocess.CompletedProcess(p.args, p.returncode, "".join(before) + out, err)
            for p, before, (out, err) in zip(procs, heard, outputs, strict=True)]


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one line a refused party prints on standard error."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{result.stderr}\nstdout:\n{result.stdout}"
    return lines[0]


# ------------------------------------------------------------------------------ a trained model


def party_hosts(n: int):
    """One network namespace per party (own UTS namespace too, as parties.netns's launcher does), or
    loopback with the reason why not: yields ([(command prefix, address)] * n, fallback reason or None)."""
    reason = netns.unavailable()
    if reason is None:
        prefix, subnet = f"vf{n}{os.getpid() % 10000}", f"10.{214 + n}.{os.getpid() % 250}.0/24"
        try:
            emulated = netns.setup(n, prefix=prefix, subnet=subnet)
        except netns.NetnsError as err:
            reason = str(err)
        else:
            try:
                yield [(("ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                         'hostname "$0" && exec "$@"', ns), address)
                       for ns, address in zip(emulated.namespaces, emulated.addresses, strict=True)], None
            finally:
                netns.teardown(prefix)
            return
    yield [((), "127.0.0.1")] * n, f"loopback instead of namespaces: {reason}"


@pytest.fixture(scope="module")
def hosts():
    """Three parties' places (:func:`party_hosts`)."""
    yield from party_hosts(3)


@pytest.mark.mpi
def test_three_organisations_train_the_same_model_as_one_mpiexec(split, hosts, tmp_path, record_property):
    places, fallback = hosts
    if fallback:
        record_property("fallback", fallback)
        print(fallback)
    orgs = make_orgs(tmp_path, split)
    port = 17700 if not fallback else free_port()
    write_jobs(orgs, f"{places[0][1]}:{port}")
    log = tmp_path / "opened.log"
    env = {"PYTHONPATH": f"{OPEN_AUDIT}{os.pathsep}{REPO_ROOT}", "VFL_OPEN_LOG": str(log)}
    results = run_parties([org.command("--join-timeout", "60", prefix=place)
                           for org, (place, _) in zip(orgs, places, strict=True)], timeout=240, env=env)
    for org, result in zip(orgs, results, strict=True):
        assert result.returncode == 0, f"{org.name}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"

    # the same job under one mpiexec, from the same party files
    out = tmp_path / "one-mpiexec"
    cmd = [sys.executable, "-m", "vfl.cli", "train", "-n", "3", "-m", "1", "--party-files", str(split),
           "--algorithm", "sgd", "--mode", "sync-global", "--epochs", "2", "-B", "8", "--seed", "0",
           "--secure-channels", "--no-reference", "--no-progress", "--out", str(out)]
    one = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    expected = json.loads((out / "result.json").read_text())
    got = json.loads((orgs[0].run / "result.json").read_text())
    assert got["updates"] == expected["updates"] and got["epochs"] == expected["epochs"] == 2
    assert got["record"]["loss"] == pytest.approx(expected["record"]["loss"], rel=1e-9)
    assert got["record"]["test_accuracy"] == expected["record"]["test_accuracy"] > 0.9

    # every party printed the run's summary; the others keep it in their own folder
    for org, result in zip(orgs[1:], results[1:], strict=True):
        assert "dominated updates" in result.stdout and "test_accuracy" in result.stdout
        received = json.loads((org.run / "result.json").read_text())
        assert received["updates"] == expected["updates"] and received["from"] == "bank-a"
        assert received["record"]["loss"] == pytest.approx(expected["record"]["loss"], rel=1e-9)

    # each folder holds only its own party's files
    for org in orgs:
        others = [f"party-{r}." for r in range(3) if r != org.rank]
        names = sorted(p.name for p in org.run.iterdir())
        assert f"party-{org.rank}.ckpt.npz" in names and "party.json" in names
        assert not [n for n in names if any(n.startswith(o) for o in others)], names
    assert (orgs[0].run / "metrics.jsonl").exists() and not (orgs[1].run / "metrics.jsonl").exists()

    # no party process opened, listed, made or removed a path in another organisation's folder
    touched: dict[str, set[str]] = {}
    for line in log.read_text().splitlines():
        pid, _event, path = line.split(" ", 2)
        touched.setdefault(pid, set()).add(path)
    for org in orgs:  # the command and its party process, for each organisation: the log saw them
        root = f"{org.root}{os.sep}"
        inside = [pid for pid, paths in touched.items() if any(p.startswith(root) for p in paths)]
        assert len(inside) >= 2, f"{org.name}: {inside}"
    for paths in touched.values():
        mine = {o.name for o in orgs if any(p.startswith(str(o.root) + os.sep) for p in paths)}
        assert len(mine) <= 1, f"one process touched the folders of {sorted(mine)}"


# ------------------------------------------------------------------------------- refusals (jobs)


@pytest.mark.mpi
def test_a_process_without_the_pinned_key_is_refused_and_named(split, tmp_path):
    orgs = make_orgs(tmp_path, split)
    address = f"127.0.0.1:{free_port()}"
    write_jobs(orgs, address)
    # an impostor for bank-b: its own key pair, pinned as bank-b's in its own copy of the job file
    impostor = orgs[1]
    private, public = generate_key_pair()
    write_private_key(impostor.key, private)
    keys = {o.name: o.public for o in orgs} | {"bank-b": public}
    impostor.job.write_text(job_text(keys, address))
    # the parties dial first (every 0.2 s); the leader, started once they do, waits 3 s for the real
    # bank-b: the dialling clinic-c joins within a fraction of that
    fake, clinic, leader = run_staged([o.command("--join-timeout", "60") for o in orgs[1:]],
                                      [orgs[0].command("--join-timeout", "3")], "joining the leader", 180)
    assert leader.returncode == fake.returncode == clinic.returncode == 1
    line = error_line(leader)
    assert "the join ended: bank-b did not join within 3 s" in line and "claiming to be 'bank-b'" in line
    assert "127.0.0.1:" in line and "keys do not agree" in line
    assert "bank-b" in error_line(clinic) and "(from the leader bank-a)" in error_line(clinic)
    assert "do not agree on keys" in error_line(fake)
    assert not (impostor.run / "party.json").exists()  # it never joined


@pytest.mark.mpi
def test_a_job_file_that_differs_in_one_option_is_refused_naming_the_field(split, tmp_path):
    orgs = make_orgs(tmp_path, split)
    write_jobs(orgs, f"127.0.0.1:{free_port()}", **{"clinic-c": {"epochs": 3}})
    full = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}

    def start(org: Org) -> subprocess.Popen:
        return subprocess.Popen(org.command("--join-timeout", "60"), cwd=REPO_ROOT, env=full,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    # clinic-c comes once bank-b is in the hello, so that bank-b hears the leader end the join (one
    # that came later would find the hello closed and wait out its own --join-timeout)
    procs = [start(orgs[0]), start(orgs[1])]
    try:
        seen = []
        for line in procs[0].stdout:
            seen.append(line)
            if "bank-b joined the hello" in line:
                break
        procs.append(start(orgs[2]))
        outputs = [p.communicate(timeout=180) for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    leader, bank, clinic = (subprocess.CompletedProcess([], p.returncode, out, err)
                            for p, (out, err) in zip(procs, outputs, strict=True))
    assert leader.returncode == bank.returncode == clinic.returncode == 1, "".join(seen)
    assert "clinic-c runs another job than the leader bank-a: [job] epochs is 3.0 at clinic-c, 2.0 at " \
           "bank-a" in error_line(leader)
    assert "[job] epochs is 3.0 here, 2.0 at bank-a" in error_line(clinic)
    assert "clinic-c runs another job" in error_line(bank) and "(from the leader bank-a)" in error_line(bank)


@pytest.mark.mpi
def test_a_party_that_never_arrives_ends_the_join_for_everyone_naming_it(split, tmp_path):
    orgs = make_orgs(tmp_path, split)
    write_jobs(orgs, f"127.0.0.1:{free_port()}")
    bank, leader = run_staged([orgs[1].command("--join-timeout", "60")],
                              [orgs[0].command("--join-timeout", "3")], "joining the leader", 180)
    assert leader.returncode == bank.returncode == 1
    assert error_line(leader) == "vfl party bank-a: the join ended: clinic-c did not join within 3 s " \
                                 "(--join-timeout)"
    assert error_line(bank).startswith("vfl party bank-b: the join ended: clinic-c did not join within 3 s")


def the_others_end(procs: list[subprocess.Popen], dead: float) -> tuple[list[float], list[tuple[str, str]]]:
    """After the third party died at ``dead``: how long the first two took to end, and every output."""
    ended = []
    for proc in procs[:2]:
        proc.wait(timeout=60)
        ended.append(time.monotonic() - dead)
    return ended, [p.communicate(timeout=30) for p in procs]


def kill_leftovers(procs: list[subprocess.Popen]) -> None:
    """Leave no party process behind for the next test, whatever the verdict."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _party_process(org: Org) -> int | None:
    """The pid of the party process (under mpiexec) of an organisation, from /proc."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if b"parties.federation.member" in words and str(org.run).encode() in words and \
                name not in ("mpiexec", "hydra_pmi_proxy"):
            return int(entry.name)
    return None


def _processes_naming(folder: Path) -> list[int]:
    """Processes whose command line holds ``folder`` (a party's mpiexec and its member process)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(folder).encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.mpi
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_killing_vfl_party_leaves_no_mpiexec_or_party_process_behind(split, tmp_path):
    import signal

    orgs = make_orgs(tmp_path, split)
    write_jobs(orgs, f"127.0.0.1:{free_port()}")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    leader = subprocess.Popen(orgs[0].command("--join-timeout", "120"), cwd=REPO_ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 90
    try:
        # its mpiexec and its member process run, the member waiting for the others to join
        while len([p for p in _processes_naming(orgs[0].run) if p != leader.pid]) < 2:
            assert time.monotonic() < deadline and leader.poll() is None, "the leader's party never started"
            time.sleep(0.1)
        leader.kill()  # SIGKILL: vfl party runs no cleanup at all
        leader.wait()
        gone_by = time.monotonic() + 5
        while _processes_naming(orgs[0].run) and time.monotonic() < gone_by:
            time.sleep(0.1)
        survivors = _processes_naming(orgs[0].run)
        assert not survivors, f"alive 5 s after vfl party's death: {survivors}"
    finally:  # leave nothing behind for the next test, whatever the verdict
        leader.kill()
        for pid in _processes_naming(orgs[0].run):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.mpi
def test_a_party_killed_mid_run_ends_the_run_and_resume_continues_from_the_agreed_epoch(split, tmp_path):
    import signal

    orgs = make_orgs(tmp_path, split)
    longer = {"epochs": 5, "batch-size": 4, "peer-timeout": 5}
    write_jobs(orgs, f"127.0.0.1:{free_port()}", **{o.name: longer for o in orgs})
    full = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    procs = [subprocess.Popen(o.command("--join-timeout", "60"), cwd=REPO_ROOT, env=full,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for o in orgs]
    try:
        manifest = orgs[0].run / "checkpoint.json"
        deadline = time.monotonic() + 150
        while not manifest.exists() and time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.05)
        assert manifest.exists(), "no epoch was marked complete"
        victim = _party_process(orgs[2])
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        while Path(f"/proc/{victim}").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        dead = time.monotonic()
        ended, outputs = the_others_end(procs, dead)
    finally:
        kill_leftovers(procs)
    assert max(ended) < 5 + 2, f"the others took {ended} s after the party died (--peer-timeout 5)"
    for proc, (_, err) in zip(procs[:2], outputs[:2], strict=True):
        assert proc.returncode == 1
        line = err.strip().splitlines()[-1]
        assert "the run ended: clinic-c (party 2) left the run" in line, err
    agreed = json.loads(manifest.read_text())["epochs"]
    assert 1 <= agreed < 5
    for org in orgs:  # every party's block of the agreed epoch is there, whole
        with np.load(org.run / f"party-{org.rank}.ckpt.npz") as z:
            width = z["w"].size
        restored = load_checkpoint(org.run, org.rank, width, agreed)
        assert restored.epochs == agreed and np.isfinite(restored.w).all()

    results = run_parties([o.command("--join-timeout", "60", "--resume") for o in orgs], timeout=240)
    for org, result in zip(orgs, results, strict=True):
        assert result.returncode == 0, f"{org.name}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert f"resuming from epoch {agreed:g}, the newest epoch every party completed" in results[0].stdout
    final = json.loads((orgs[0].run / "result.json").read_text())
    assert final["epochs"] == 5
    epochs = [json.loads(line)["epoch"] for line in (orgs[0].run / "metrics.jsonl").read_text().splitlines()]
    assert epochs == sorted(set(epochs)) and epochs[-1] == 5  # each epoch logged once, in order


# ------------------------------------------------------------------------- the command's checks


def test_a_key_that_is_not_the_pinned_one_is_refused_before_anything_starts(split, tmp_path, capsys):
    from vfl.cli import main

    orgs = make_orgs(tmp_path, split)
    write_jobs(orgs, "127.0.0.1:1")
    argv = orgs[1].command()[3:]
    argv[argv.index("--key") + 1] = str(orgs[2].key)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not bank-b's key" in err


def test_a_folder_with_an_earlier_run_needs_resume_or_overwrite(split, tmp_path, capsys):
    from vfl.cli import main

    orgs = make_orgs(tmp_path, split)
    write_jobs(orgs, "127.0.0.1:1")
    orgs[1].run.mkdir()
    (orgs[1].run / "party.json").write_text(json.dumps({"name": "bank-b", "job": {}}))
    assert main(orgs[1].command()[3:]) == 2
    assert "holds an earlier run" in capsys.readouterr().err
    assert main(orgs[1].command("--resume")[3:]) == 2
    assert "--resume keeps the run's job" in capsys.readouterr().err
    assert main(orgs[2].command("--listen", "0.0.0.0:7700")[3:]) == 2
    assert "--listen is for the leader (bank-a) only" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- the job file


def _keys() -> dict[str, bytes]:
    return {name: generate_key_pair()[1] for name in NAMES}


def test_job_file_reads_like_vfl_train_and_fills_in_defaults():
    keys = _keys()
    job = parse_job(job_text(keys, "10.0.0.1:7700"))
    assert (job.options.parties, job.options.active, job.options.batch_size) == (3, 1, 8)
    assert job.options.secure_channels and job.leader.name == "bank-a"
    assert [p.name for p in job.parties] == list(NAMES)
    # epochs given as its default, or left out: the same job
    same = parse_job(job_text(keys, "10.0.0.1:7700").replace("[job]", "[job]\nlink_delay = 0.0"))
    assert same.digest() == job.digest()
    other = parse_job(job_text(keys, "10.0.0.1:7700", epochs=3))
    assert other.digest() != job.digest()
    assert first_difference(job.canonical(), other.canonical()) == ("[job] epochs", "2.0", "3.0")
    moved = parse_job(job_text(keys, "10.0.0.9:7700"))
    assert first_difference(job.canonical(), moved.canonical())[0] == "[[party]] 1 (bank-a) address"
    assert first_difference(job.canonical(), "garbage") == ("the job", "a job file", '"garbage"')


@pytest.mark.parametrize("change, message", [
    (("[job]", "[job]\nepoch = 3"), "[job] has no option 'epoch' (did you mean epochs?)"),
    (("[job]", "[job]\nout = \"/tmp/x\""), "out is not a job option: each party gives its own --folder"),
    (("[job]", "[job]\nparty-files = \"x\""), "each party gives its own data with --data"),
    (("[job]", "[job]\nlam = \"small\""), "[job] lam must be a number, got 'small'"),
    (("[job]", "[job]\nbatch_size = 2"), "[job] sets batch-size twice"),
    (("[job]", "[job]\nthreads = 1.5"), "[job] threads must be a whole number"),
    (("[job]", "[job]\nlabel-privacy = \"dp\""), "--label-privacy dp needs --epsilon"),
    (('role = "passive"', 'role = "active"'), "active party clinic-c follows passive party bank-b"),
    (('address = "10.0.0.1:7700"\n', ""), "leads the job: it needs an address"),
    (('address = "10.0.0.1:7700"', 'address = "10.0.0.1"'), "address must be \"host:port\""),
    (('name = "clinic-c"', 'name = "bank-b"'), "two parties are named 'bank-b'"),
    (("[[party]]", "[[party]]\ncolour = 1"), "has no key 'colour'"),
    (("[job]", "[jobs]"), "unknown table [jobs]"),
])
def test_bad_job_files_are_refused_in_one_line(change, message):
    text = job_text(_keys(), "10.0.0.1:7700")
    old, new = change
    if old == 'role = "passive"':  # make the last party active: it follows a passive one
        head, _, tail = text.rpartition(old)
        text = head + new + tail
    else:
        text = text.replace(old, new, 1)
    with pytest.raises(ConfigError) as err:
        parse_job(text, "job.toml")
    assert message in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------------------------ the hello


class _Leader:
    """A hello server of the leader on a free loopback port, in this process, and the job it serves."""

    def __init__(self) -> None:
        self.pairs = {name: generate_key_pair() for name in NAMES}
        keys = {n: pub for n, (_, pub) in self.pairs.items()}
        self.job = parse_job(job_text(keys, f"127.0.0.1:{free_port()}"))
        self.lines: list[str] = []
        bind = ("127.0.0.1", int(self.job.leader.address.rsplit(":", 1)[1]))
        self.server = HelloServer(self.job, self.pairs["bank-a"][0], bind, resume=False,
                                        log=self.lines.append)


def test_hello_authenticates_both_ways_and_hands_out_a_bound_token():
    leader = _Leader()
    job, sessions = leader.job, {}

    def join(rank: int) -> None:
        s = hello.party_hello(job, rank, leader.pairs[NAMES[rank]][0], resume=False,
                              deadline=time.monotonic() + 10)
        hello.check_same_job(s, job, 10)
        sessions[rank] = s

    threads = [threading.Thread(target=join, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    joined = leader.server.wait(time.monotonic() + 10, 10)
    for t in threads:
        t.join()
    assert [s.peer for s in joined] == ["bank-b", "clinic-c"]
    port = "tag#0$connentry#00$"
    assert joined[0].token(port) == sessions[1].token(port) != sessions[2].token(port)
    joined[0].send({"status": "connect", "port": port, "job_id": "00" * 16})
    assert hello.await_turn(sessions[1], time.monotonic() + 5) == (port, bytes(16))
    joined[1].send({"status": "abort", "reason": "bank-z left\x1b[2J"})
    with pytest.raises(hello.HelloRefused, match=r"the join ended: bank-z left\\x1b\[2J \(from the leader"):
        hello.await_turn(sessions[2], time.monotonic() + 5)


def test_hello_refuses_a_wrong_key_and_garbage_and_goes_on_waiting():
    leader = _Leader()
    port = leader.server.listener.getsockname()[1]
    for junk in (b"\xff\xff\xff\xff", b"\x00\x00\x00\x04abcd"):  # an oversized frame; not JSON
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(junk)
            s.settimeout(5)
            assert s.recv(10) == b""  # closed, unanswered
    wrong = generate_key_pair()[0]  # a process with another key, claiming to be bank-b
    with pytest.raises(hello.HelloRefused, match="do not agree on keys"):
        hello.party_hello(leader.job, 1, wrong, resume=False, deadline=time.monotonic() + 5)
    with pytest.raises(JoinFailed) as failed:
        leader.server.wait(time.monotonic() + 1.0, 1.0)
    assert "bank-b and clinic-c did not join within 1 s" in str(failed.value)
    assert "claiming to be 'bank-b'" in str(failed.value) and "keys do not agree" in str(failed.value)
    assert any("announced a frame of 4294967295 bytes" in line for line in leader.lines)
    assert any("not JSON" in line for line in leader.lines)


def test_hello_names_the_first_differing_field_at_both_ends():
    leader = _Leader()
    text = job_text({n: pub for n, (_, pub) in leader.pairs.items()}, leader.job.leader.address, seed=7)
    theirs = parse_job(text)
    session = hello.party_hello(theirs, 2, leader.pairs["clinic-c"][0], resume=False,
                                deadline=time.monotonic() + 5)
    with pytest.raises(hello.HelloRefused, match=r"\[job\] seed is 7 here, 0 at bank-a"):
        hello.check_same_job(session, theirs, 5)
    with pytest.raises(JoinFailed, match=r"clinic-c runs another job than the leader bank-a: \[job\] "
                                                r"seed is 7 at clinic-c, 0 at bank-a"):
        leader.server.wait(time.monotonic() + 5, 5)
