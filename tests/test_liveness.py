"""Liveness is progress (issue 26): every wait on a peer has a deadline, heartbeats or not.

Real ``mpiexec`` jobs in which one rank stays alive, heartbeating, but stops doing its part: each must
end within ``--peer-timeout`` + 2 s naming that rank (the levels of ``protocols/liveness.py`` add at
most 1.25 s here). Beside them: control words that lie (a DONE below the count, a second DONE, a
replayed ACK, a short HE reply), a launcher killed outright leaving nothing behind, and a straggler
that is slow, not stalled, finishing its job.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from protocols.aggregation import AggregationNode, Kind
from protocols.liveness import Liveness, PeerTimeout
from protocols.trees import build_all_tree_pairs
from tests.conftest import REPO_ROOT, run_mpi

TIMEOUT = 3.0  # the scripts' --peer-timeout
CANCER = ["--dataset", "breast-cancer", "--problem", "logistic", "--lam", "0.1", "--gamma", "0.02"]


def _stalled_for(proc: subprocess.CompletedProcess, ended: float) -> float:
    """Seconds from the hostile rank's ``STALL <time>`` line to the end of the job."""
    found = re.search(r"STALL (\d+\.\d+)", proc.stdout)
    assert found, proc.stdout + proc.stderr
    return ended - float(found.group(1))


# ------------------------------------------------------------------------------------ the rule itself


def test_a_wait_measures_the_peers_silence_not_the_exchanges_length() -> None:
    now = [100.0]
    liveness = Liveness(0, 3, 3.0, clock=lambda: now[0])
    since = now[0]
    for _ in range(10):  # a slow exchange whose peer keeps delivering: 20 s, never 3 s silent
        now[0] += 2.0
        liveness.delivered(1)
        liveness.check({1: 0}, since, "its list")
    now[0] += 3.1
    with pytest.raises(PeerTimeout, match=r"^party 1 has been silent for 3\.1 s while party 0 waited for "
                                          r"its list \(heartbeats do not count\)"):
        liveness.check({1: 0}, since, "its list")
    liveness.check({1: 1}, since, "its list")  # one level up: 0.25 s more


def test_the_party_nearest_a_stall_is_named_first() -> None:
    """Party 0 waits for party 1, which waits for party 2 (the culprit): 1's wait is one level lower,
    so it fires first although both clocks started together."""
    now = [0.0]
    parent, child = (Liveness(r, 3, 3.0, clock=lambda: now[0]) for r in (0, 1))
    now[0] = 3.0 + parent.stagger / 2
    parent.check({1: 1}, 0.0, "its partial sum")
    with pytest.raises(PeerTimeout, match="party 2 has been silent"):
        child.check({2: 0}, 0.0, "its partial sum")
    assert parent.segment_level > 2 and parent.exchange_level == parent.segment_level + 1


def test_a_node_says_which_children_it_still_waits_for_and_how_deep_they_are() -> None:
    """q = 3: tree 1 is a star at the root, tree 2 a chain root ← a ← b. With every tree-1 sum in, the
    root still waits for a (height 1 in tree 2); a waits for b (a leaf: height 0)."""
    pairs = build_all_tree_pairs(3, 0)
    nodes = [AggregationNode(r, 3, pairs) for r in range(3)]
    a = next(c for c in (1, 2) if pairs[0].t2.parent[c] == 0)
    b = 3 - a
    rid, announcements = nodes[0].announce(np.array([0]))
    nodes[0].start(0, rid, np.zeros(1))
    assert nodes[0].awaited(0, rid) == {1: 0, 2: 0}  # both missing from the star: level 0
    tree_two = []
    for message in announcements:
        requested = nodes[message.dest].receive(0, message.buffer).event
        for out in nodes[message.dest].start(0, requested.rid, np.zeros(1)).outgoing:
            if int(out.buffer[0]) == Kind.MASKED:
                nodes[0].receive(message.dest, out.buffer)
            else:
                tree_two.append((message.dest, out))
    assert nodes[0].awaited(0, rid) == {a: 1}
    assert nodes[a].awaited(0, rid) == {b: 0}
    assert nodes[0].awaited(0, rid + 1) == {}  # not started here
    assert [source for source, _ in tree_two] == [b]


def test_a_frame_whose_payload_never_comes_names_its_sender_and_a_polling_receive_gives_up() -> None:
    from mpi4py import MPI

    from protocols.transport import MpiTransport

    comm = MPI.COMM_SELF.Dup()
    try:
        transport = MpiTransport(comm, capacity_words=8, max_message_words=100,
                                 liveness=Liveness(0, 1, 0.2, stagger=0.0))
        frame = np.array([50], dtype=np.uint32)  # announces 50 words; none follow
        sends = [comm.Isend([frame, MPI.BYTE], 0, transport.tag)]
        with pytest.raises(PeerTimeout, match=r"party 0 has been silent .* for the payload of its frame"):
            transport.recv(lambda: None)

        def impatient() -> None:
            raise TimeoutError("given up")

        with pytest.raises(TimeoutError):  # nothing arrives: the caller's wait ends the receive
            transport.recv(impatient)
        words = np.arange(3, dtype=np.uint64)
        sends.append(comm.Isend([words, MPI.BYTE], 0, transport.tag))  # not into a dead receive
        assert transport.recv()[1].tolist() == [0, 1, 2]
        MPI.Request.Waitall(sends)
    finally:
        comm.Free()


# --------------------------------------------------------------------------- stalls in real jobs


@pytest.mark.mpi
@pytest.mark.parametrize(("scenario", "waited_for"), [
    ("tree", "its partial sum"),          # its comm thread ignores REQUESTs and tree sums
    ("fullpass", "its partial sum"),      # it skips the epoch-end evaluation's full pass
    ("barrier", "its barrier token"),     # it never reaches a control-plane barrier
    ("frame", "the payload of its frame"),  # a size frame, then never the payload
])
def test_a_party_that_heartbeats_but_stalls_is_named_within_the_timeout(scenario: str, waited_for: str):
    proc = run_mpi(3, ["tests/mpi_scripts/stall_runtime.py", scenario], check=False, timeout=90)
    stalled = _stalled_for(proc, time.time())
    assert proc.returncode != 0 and "NOT ENDED" not in proc.stdout, proc.stdout
    assert re.search(rf"stop \(failed\): party 2 has been silent for [\d.]+ s while party \d waited for "
                     rf"{waited_for}", proc.stderr), proc.stderr
    assert stalled < TIMEOUT + 2, f"the job took {stalled:.1f} s after the stall to end"


ALIGN_STALL = """
import time
from mpi4py import MPI
import parties.align as align
from protocols import psi
if MPI.COMM_WORLD.Get_rank() == 1:  # connects, announces its size, then never sends its list
    def stalled(self, ids, domain, chunk):
        print(f"STALL {time.time():.3f}", flush=True)
        time.sleep(60)
        yield from ()
    psi.Party.start_chunks = stalled
import sys
align.run_rank(["--bench", "50", "--peer-timeout", "3", "--out", sys.argv[-1]])
"""


@pytest.mark.mpi
def test_vfl_align_names_a_peer_that_connects_and_stalls(tmp_path: Path) -> None:
    """The naming line is read from the ranks' verdict files, as ``launch_alignment`` does: on standard
    error it was lost in some runs, when the abort killed the ranks before Hydra forwarded it."""
    from parties.outcomes import decisive_verdict, read_verdicts

    proc = run_mpi(3, ["-c", ALIGN_STALL, str(tmp_path)], check=False, timeout=90)
    stalled = _stalled_for(proc, time.time())
    assert proc.returncode != 0
    verdict = decisive_verdict(read_verdicts(tmp_path, 3)) or ""
    assert re.search(r"^\[party \d\] error: party 1 has been silent for [\d.]+ s while party \d waited "
                     r"for its blinded list \(round 1", verdict), (verdict, proc.stderr)
    assert stalled < TIMEOUT + 2, f"the job took {stalled:.1f} s after the stall to end"


def test_vfl_aligns_accusations_are_counted_like_vfl_trains(tmp_path: Path) -> None:
    """``vfl align``'s lines say ``error:``; a party accused by two is named over one accused by one."""
    from parties.outcomes import decisive_verdict, read_verdicts

    for rank, (at, line) in {0: (1, "[party 0] error: party 2 sent an invalid blinded list: x"),
                             1: (2, "[party 1] error: party 2 sent an invalid blinded list: y"),
                             2: (0, "[party 2] error: party 0 sent an invalid nonce: made up")}.items():
        (tmp_path / f"verdict-{rank}.txt").write_text(f"{at} {line}\n")
    assert decisive_verdict(read_verdicts(tmp_path, 3)).startswith("[party 0] error: party 2 sent")


# ------------------------------------------------------------------------------------ control words


LIES = {"done-low": "DONE message: count 5 is below the 10 (ϑ, i) messages received",
        "done-twice": "DONE message: for segment 1 where 2 was expected (a second or replayed DONE",
        "ack-replay": "ACK message: acknowledges (ϑ, i) #2 where #5 was expected (a replay"}
SHORT_REPLIES = {"short": "decrypted full gradient: 24 bytes, expected 32",
                 "long": "decrypted full gradient: longer than the 32 bytes expected",
                 "progress": "encrypted full pass: more than 3 progress words"}  # progress forever: bounded


@pytest.fixture(scope="module")
def lying_jobs():
    """The six jobs whose control words lie, three at a time (tests/test_label_he.py ``Jobs``): none waits
    on a clock (the default 30 s --peer-timeout), so a busier machine changes only how long they take."""
    from tests.test_label_he import Jobs

    def job(ranks: int, script: str, scenario: str, timeout: float):
        return lambda: run_mpi(ranks, [f"tests/mpi_scripts/{script}", scenario], check=False, timeout=timeout)

    started = Jobs({**{lie: job(3, "tamper_counts.py", lie, 90) for lie in LIES},
                    **{reply: job(2, "tamper_control.py", reply, 60) for reply in SHORT_REPLIES}})
    yield started
    started.close()


@pytest.mark.mpi
@pytest.mark.parametrize("scenario", list(LIES))
def test_a_lying_done_or_ack_ends_the_job_naming_its_sender(lying_jobs, scenario: str) -> None:
    proc = lying_jobs[scenario]
    assert proc.returncode != 0 and "NOT REJECTED" not in proc.stdout, proc.stdout + proc.stderr
    assert f"[party 0] party 1 sent an invalid {LIES[scenario]}" in proc.stderr, proc.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("scenario", list(SHORT_REPLIES))
def test_an_he_full_pass_reply_of_the_wrong_length_is_refused_before_unmasking(lying_jobs, scenario: str):
    proc = lying_jobs[scenario]
    assert "NOT REJECTED" not in proc.stdout, proc.stdout
    assert f"party 0 sent an invalid {SHORT_REPLIES[scenario]}" in proc.stdout, proc.stderr


@pytest.mark.mpi
def test_an_honest_party_in_a_long_he_full_pass_is_not_named() -> None:
    """Liveness is progress, and a long local step is progress too: the leader encrypting ϑ_0 of 100,000
    rows and each passive party's masked pass outlast a 2 s --peer-timeout. HEU holds the GIL for a
    whole call, so one call for all rows silenced even the heartbeats (the leader was named, measured);
    in pieces the heartbeats go on and each piece sends a progress word (a bounded number)."""
    proc = run_mpi(3, ["tests/mpi_scripts/slow_full_pass.py", "2"], check=False, timeout=90)
    took = [float(t) for t in re.findall(r"PASSED (\d+\.\d+)", proc.stdout)]
    assert proc.returncode == 0 and len(took) == 3, proc.stdout + proc.stderr
    if max(took) <= 2:
        pytest.skip(f"the pass took {max(took)} s here: not longer than the timeout, nothing shown")


# ------------------------------------------------------------------------ the launcher and the job


def _processes_with(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.mark.mpi
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_killing_the_launcher_leaves_no_mpiexec_proxy_or_rank_behind(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    launcher = subprocess.Popen([sys.executable, "-m", "vfl.cli", "train", "--out", str(out), "--no-progress",
                                 "-n", "3", "-m", "1", "--epochs", "1000", *CANCER], cwd=REPO_ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 90
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 2:
        assert time.monotonic() < deadline and launcher.poll() is None, "the job did not start training"
        time.sleep(0.2)
    marker = str(out / "config.json")  # on the command line of mpiexec and of every rank
    ranks = [int((out / f"party-{r}.pid").read_text()) for r in range(3)]
    proxies = {int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in ranks}
    assert len(_processes_with(marker)) == 4, _processes_with(marker)  # mpiexec and the 3 ranks
    launcher.kill()  # SIGKILL: the launcher runs no cleanup at all
    launcher.wait()

    def left() -> list[int]:
        return _processes_with(marker) + [p for p in proxies if p in _processes_with("hydra_pmi_proxy")]

    gone_by = time.monotonic() + 5
    while left() and time.monotonic() < gone_by:
        time.sleep(0.1)
    survivors = left()
    for pid in survivors:  # leave nothing behind for the next test, whatever the verdict
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"alive 5 s after the launcher's death: {survivors}"


@pytest.mark.mpi
def test_a_straggler_is_slow_not_stalled_and_its_job_completes(tmp_path: Path) -> None:
    """Party 2 takes 4x as long for every piece of work and waits 20 ms before each batch it applies:
    its messages keep coming, so a 3 s --peer-timeout never fires."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-m", "vfl.cli", "train", "--out", str(tmp_path), "--no-progress",
                           "-n", "3", "-m", "2", "--algorithm", "svrg", "--epochs", "3", "--straggler", "2",
                           "--slowdown", "3", "--apply-delay-ms", "20", "--peer-timeout", str(TIMEOUT),
                           *CANCER],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "silent" not in proc.stderr
    assert (tmp_path / "result.json").exists()


def test_resume_refuses_a_manifest_with_nan_epochs_in_one_line(tmp_path: Path, capsys) -> None:
    """A checkpoint.json holding "epochs": NaN once made --resume train forever: it is damage. ``vfl``'s
    own entry point in this process (the refusal comes before any rank or subprocess starts)."""
    from vfl.cli import main

    (tmp_path / "config.json").write_text("{}\n")
    (tmp_path / "checkpoint.json").write_text('{"epochs": NaN}')
    code = main(["train", "--out", str(tmp_path), "--resume", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert len(err.strip().splitlines()) == 1 and "checkpoint.json is damaged" in err
