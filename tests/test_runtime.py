"""The VFB² runtime end to end: real ``mpiexec`` jobs started through the user's own command.

Each job is small (breast-cancer or a 300-row synthetic problem) so the whole file stays well under
two minutes on two cores. Module-scoped fixtures share one job between several assertions.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from parties.launch import FirstDeath, died_first
from parties.outcomes import find_stop
from parties.runtime import AUDIT_FULL_THETA, AUDIT_LABELS, TAG_DONE, TAG_HEARTBEAT, TAG_STOP, TAG_THETA
from protocols.aggregation import HEADER_WORDS, Kind
from protocols.transport import AGGREGATION_TAG
from tests.conftest import REPO_ROOT, run_mpi, says_died_first
from vertical.datasets import Dataset, load, split_to_party_files
from vertical.partition import random_blocks
from vertical.problems import get_problem
from vertical.reference import evaluate, solve_reference

pytestmark = pytest.mark.mpi


def train(out: Path, *args: str, timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess:
    """``vfl train --out <out> <args>`` exactly as a user runs it."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "vfl.cli", "train", "--out", str(out), "--no-progress", *args]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)
    if check and proc.returncode != 0:
        pytest.fail(f"vfl train failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def refused(out: Path, *args: str) -> subprocess.CompletedProcess:
    """``vfl train --out <out> <args>`` in this process, for a mistake the launcher refuses before
    ``mpiexec`` (the same ``vfl.cli.main``, without an interpreter's start-up;
    ``test_bad_configuration_is_refused_before_any_rank_starts`` runs such a refusal as a command)."""
    import contextlib
    import io

    from vfl.cli import main

    out_text, err_text = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out_text), contextlib.redirect_stderr(err_text):
        code = main(["train", "--out", str(out), "--no-progress", *args])
    return subprocess.CompletedProcess(args, code, out_text.getvalue(), err_text.getvalue())


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------ breast-cancer, logistic

LAM = 0.1
CANCER = ["--dataset", "breast-cancer", "--problem", "logistic", "--lam", str(LAM), "--gamma", "0.02"]


@pytest.fixture(scope="module")
def nonf():
    ds = load("breast-cancer", seed=0)
    problem = get_problem("logistic", lam=LAM)
    sol = solve_reference(problem, ds.X_train, ds.y_train)
    return sol.f_star, evaluate(problem, sol.w, ds.X_test, ds.y_test)["accuracy"]


@pytest.fixture(scope="module")
def svrg_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("svrg")
    train(out, "-n", "3", "-m", "2", "--algorithm", "svrg", "--epochs", "6", "--eval-every", "0.5", "--audit",
          *CANCER)
    return out


def test_svrg_is_lossless_against_nonf(svrg_run, nonf):
    f_star, nonf_accuracy = nonf
    last = metrics(svrg_run)[-1]
    print(f"VFB²-SVRG test accuracy {100 * last['test_accuracy']:.2f} %, NonF {100 * nonf_accuracy:.2f} %")
    assert last["suboptimality"] < 1e-5
    assert abs(last["loss"] - f_star) < 1e-5
    assert abs(last["test_accuracy"] - nonf_accuracy) <= 0.001


def _transcript(out: Path, rank: int) -> dict:
    with np.load(out / f"audit-{rank}.npz") as z:
        return {k: z[k] for k in z.files}


def test_every_theta_is_applied_exactly_once_per_collaborator(svrg_run):
    q, active = 3, (0, 1)
    records = [_transcript(svrg_run, r) for r in range(q)]
    for collaborator in range(q):
        rec = records[collaborator]
        for dominator in active:
            if dominator == collaborator:
                continue
            received = int(np.sum((rec["sources"] == dominator) & (rec["tags"] == TAG_THETA)))
            sent = int(records[dominator]["sent"])
            assert sent > 1000
            assert received == sent == rec["applied"][dominator]
        assert rec["applied"][collaborator] == 0  # a dominator never re-applies its own ϑ


def test_messages_carry_only_what_the_protocol_allows(svrg_run):
    """VFB² never sends x, w_l, y_i or gradients: the hot path carries sample indices, masked tree sums
    and (ϑ, i), nothing that could hold a label vector or a feature row (a few words each for B = 1)."""
    y = load("breast-cancer", seed=0).y_train
    allowed = {(AGGREGATION_TAG, HEADER_WORDS + 1), (TAG_THETA, 4), (TAG_DONE, 2), (TAG_STOP, 1),
               (TAG_HEARTBEAT, 1)}
    top_bytes = []
    for rank in range(3):
        rec = _transcript(svrg_run, rank)
        data_plane = ~np.isin(rec["tags"], AUDIT_LABELS)  # the control plane's collectives
        kinds = set(zip(rec["tags"][data_plane].tolist(), rec["lengths"][data_plane].tolist(), strict=True))
        assert kinds <= allowed, kinds - allowed
        offsets = np.concatenate([[0], np.cumsum(rec["lengths"])])
        for k in np.flatnonzero(rec["tags"] == TAG_HEARTBEAT):
            assert rec["words"][offsets[k]] == 0  # a heartbeat says nothing but "alive"
        for k in np.flatnonzero(rec["tags"] == TAG_THETA):
            _, b, i, theta = rec["words"][offsets[k]:offsets[k + 1]].view(np.float64)
            assert b == 1 and 0 <= i < y.size and abs(theta) < 1.0  # ϑ, not the label ±1
        for k in np.flatnonzero(rec["tags"] == AGGREGATION_TAG):
            words = rec["words"][offsets[k]:offsets[k + 1]]
            if words[0] in (Kind.MASKED, Kind.MASKS):
                top_bytes.append(int(words[HEADER_WORDS]) >> 56)
    # masked sums are uniform on the ring: their top byte takes (almost) every value
    assert len(top_bytes) > 2000
    assert len(set(top_bytes)) > 240


def test_snapshots_follow_snapshot_every_not_the_evaluation_period(svrg_run):
    """Evaluated every half epoch, SVRG still takes one snapshot per pass (--snapshot-every 1): a
    passive party receives the full ϑ_0 vector 6 times in 6 epochs, not 12."""
    assert [r["epoch"] for r in metrics(svrg_run)] == [0.5 * k for k in range(13)]
    assert int(np.sum(_transcript(svrg_run, 2)["tags"] == AUDIT_FULL_THETA)) == 6


def test_gamma_decay_changes_the_step_at_whole_epochs(tmp_path):
    """--gamma-decay 1: γ, γ/2, γ/3 in epochs 0, 1, 2, even when one evaluation period spans all three
    (segments are cut at whole epochs), and each record says the step of the epoch it closes."""
    train(tmp_path, "-n", "3", "-m", "2", "--algorithm", "sgd", *CANCER, "--gamma", "0.3",
          "--gamma-decay", "1", "--epochs", "3", "--eval-every", "3")
    records = metrics(tmp_path)
    assert [r["epoch"] for r in records] == [0, 1, 2, 3]
    assert [r.get("gamma") for r in records[1:]] == pytest.approx([0.3, 0.15, 0.1], rel=1e-15)
    assert records[-1]["loss"] < records[0]["loss"]


def test_variance_reduction_beats_sgd_per_epoch(svrg_run, tmp_path):
    train(tmp_path, "-n", "3", "-m", "2", "--algorithm", "sgd", "--epochs", "6", *CANCER)
    sgd, svrg = metrics(tmp_path)[-1], metrics(svrg_run)[-1]
    assert sgd["epoch"] == svrg["epoch"] == 6
    assert sgd["suboptimality"] > 20 * svrg["suboptimality"]


# --------------------------------------------------------------- noise-free least squares, all rules


@pytest.fixture(scope="module")
def least_squares_files(tmp_path_factory):
    """A well-conditioned 300 x 12 least-squares problem with an exact linear target, split into
    per-party files: the deployment path (each party reads only its own file)."""
    rng = np.random.default_rng(7)
    X = rng.normal(size=(375, 12))
    y = X @ rng.normal(size=12)
    ds = Dataset("synthetic-ls", "regression", X[:300], y[:300], X[300:], y[300:],
                 np.arange(300), np.arange(300, 375), seed=None)
    folder = tmp_path_factory.mktemp("ls-files")
    split_to_party_files(ds, random_blocks(12, 3, seed=1), [0], folder)
    f_star = solve_reference(get_problem("least-squares", lam=1e-4), ds.X_train, ds.y_train).f_star
    return folder, f_star


#: Epochs each rule needs, with margin: on this noise-free target SGD is at 2e-3 after 1 epoch and at the
#: floor (f* to 1e-5) from epoch 2 on; the SAGAs are at 1e-4 only from epoch 11 to 14 and 2e-6 at 15.
@pytest.mark.parametrize(("algorithm", "epochs"), [("sgd", 4), ("saga", 15), ("saga-scalar", 15)])
def test_each_algorithm_reaches_the_nonf_optimum(algorithm, epochs, least_squares_files, tmp_path):
    folder, f_star = least_squares_files
    train(tmp_path, "-n", "3", "-m", "1", "--party-files", str(folder), "--problem", "least-squares",
          "--algorithm", algorithm, "--gamma", "0.01", "--epochs", str(epochs), "--f-star", repr(f_star))
    assert metrics(tmp_path)[-1]["suboptimality"] <= 1e-4


def test_synchronous_baseline_with_straggler_converges(least_squares_files, tmp_path):
    folder, f_star = least_squares_files
    train(tmp_path, "-n", "3", "-m", "1", "--party-files", str(folder), "--problem", "least-squares",
          "--algorithm", "svrg", "--mode", "sync", "--straggler", "2", "--gamma", "0.01", "--epochs", "6",
          "--f-star", repr(f_star))
    assert metrics(tmp_path)[-1]["suboptimality"] <= 1e-4


def test_afsvrg_vp_never_updates_passive_parties(tmp_path):
    train(tmp_path, "-n", "4", "-m", "2", "--algorithm", "afsvrg-vp", "--epochs", "1", *CANCER)
    blocks = [np.load(tmp_path / f"party-{r}.ckpt.npz")["w"] for r in range(4)]
    assert np.all(blocks[2] == 0) and np.all(blocks[3] == 0)
    assert np.any(blocks[0] != 0) and np.any(blocks[1] != 0)


# ----------------------------------------------------------------------------------------- failures


def test_bad_configuration_is_refused_before_any_rank_starts(tmp_path):
    proc = train(tmp_path, "-n", "3", "-m", "5", *CANCER, check=False)
    assert proc.returncode == 2
    assert "--active must be between 1 and --parties=3" in proc.stderr
    assert not (tmp_path / "config.json").exists()
    proc = train(tmp_path, "-n", "2", *CANCER, check=False)
    assert proc.returncode == 2 and "--allow-two-parties" in proc.stderr


def test_a_party_without_its_labels_is_refused_before_mpiexec(least_squares_files, tmp_path):
    folder, f_star = least_squares_files  # labels are only in party 0's file
    proc = refused(tmp_path, "-n", "3", "-m", "2", "--party-files", str(folder), "--problem", "least-squares",
                   "--f-star", repr(f_star))
    assert proc.returncode == 2
    assert "party-1.npz: the file has no labels, but an active party needs them" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "config.json").exists()


def test_misaligned_party_files_are_refused_naming_the_first_mismatch(least_squares_files, tmp_path):
    """Two files from different splits of the same data: the rows are other samples."""
    folder, f_star = least_squares_files
    rng = np.random.default_rng(8)
    X = rng.normal(size=(375, 12))
    y = X @ rng.normal(size=12)
    other = tmp_path / "other-split"
    order = rng.permutation(375)
    ds = Dataset("synthetic-ls", "regression", X[order[:300]], y[order[:300]], X[order[300:]],
                 y[order[300:]], order[:300], order[300:], seed=None)
    split_to_party_files(ds, random_blocks(12, 3, seed=1), [0], other)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for p, source in enumerate((folder, other, folder)):
        (mixed / f"party-{p}.npz").write_bytes((source / f"party-{p}.npz").read_bytes())
    proc = refused(tmp_path / "run", "-n", "3", "-m", "1", "--party-files", str(mixed), "--problem",
                   "least-squares", "--f-star", repr(f_star))
    assert proc.returncode == 2
    assert "rows are not aligned" in proc.stderr and "party-1.npz has id" in proc.stderr


def test_each_rank_refuses_rows_that_differ_from_the_leaders(tmp_path):
    """Across hosts the launcher cannot read the files: the ranks compare digests of their ids."""
    script = REPO_ROOT / "tests" / "mpi_scripts" / "alignment_check.py"
    from parties.outcomes import read_verdicts

    proc = run_mpi(3, [str(script), str(tmp_path)], check=False, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    said = [proc.stderr] + [v.line for v in read_verdicts(tmp_path, 3)]  # stderr may lose the line
    assert any("the rows of parties [2] are not the same samples as party 0's" in s for s in said), said


def test_a_closed_runtime_leaves_no_communicator_behind(tmp_path):
    """``train`` is a library call: a process may run it many times, so a runtime must free every
    communicator it duplicated (data, control, the aggregator's, the sync-global lockstep) on close;
    and ``train`` called twice in one process leaves none behind."""
    proc = run_mpi(3, ["tests/mpi_scripts/runtime_leak.py", "20", str(tmp_path)], check=False, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(f"NO LEAK {rank}" in proc.stdout for rank in range(3)), proc.stdout + proc.stderr


def _long_job_under_way(out: Path, *options: str) -> tuple[subprocess.Popen, int]:
    """A q = 3 job of 1,000 epochs, once it has recorded an evaluation; and party 2's pid."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "vfl.cli", "train", "--out", str(out), "--no-progress", "-n", "3",
           "-m", "1", "--algorithm", "sgd", "--epochs", "1000", *options, *CANCER]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 60
    log = out / "metrics.jsonl"
    while not (log.exists() and len(log.read_text().splitlines()) >= 2):  # training is under way
        assert time.monotonic() < deadline and proc.poll() is None, "the job did not start training"
        time.sleep(0.2)
    return proc, int((out / "party-2.pid").read_text())


def test_killing_a_party_ends_the_job_naming_it(tmp_path):
    proc, victim = _long_job_under_way(tmp_path)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert time.monotonic() - killed < 10
    assert says_died_first(stderr, "party 2"), stderr


def test_a_stopped_party_ends_the_job_naming_it_within_the_peer_timeout(tmp_path):
    """SIGSTOP: the party neither dies nor answers (like a frozen host or a cut cable)."""
    proc, victim = _long_job_under_way(tmp_path, "--peer-timeout", "3")
    os.kill(victim, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        _, stderr = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.kill(victim, signal.SIGKILL)
        proc.kill()
        raise
    ended = time.monotonic() - stopped
    assert proc.returncode != 0
    assert ended < 3 + 2, f"the job took {ended:.1f} s to end"  # the bound: timeout + 2 s
    assert "party 2 has been silent for" in stderr


def test_predict_reproduces_the_trained_model_through_secure_aggregation(svrg_run):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-m", "vfl.cli", "predict", str(svrg_run)], cwd=REPO_ROOT, env=env,
                   check=True, capture_output=True, timeout=120)
    ds = load("breast-cancer", seed=0)
    w = np.zeros(ds.n_features)
    for rank, cols in enumerate(random_blocks(ds.n_features, 3, seed=0)):
        w[cols] = np.load(svrg_run / f"party-{rank}.ckpt.npz")["w"]
    path = svrg_run / "predictions-test.csv"
    assert path.read_text().splitlines()[0] == "id,score,probability,predicted_label"
    table = np.loadtxt(path, delimiter=",", skiprows=1)
    np.testing.assert_array_equal(table[:, 0], ds.test_ids)  # keyed by the samples' ids, not row numbers
    np.testing.assert_allclose(table[:, 1], ds.X_test @ w, atol=1e-6)
    np.testing.assert_allclose(table[:, 2], 1 / (1 + np.exp(-table[:, 1])), rtol=1e-8)
    assert np.mean(table[:, 3] == ds.y_test) == pytest.approx(metrics(svrg_run)[-1]["test_accuracy"])


def test_each_party_keeps_its_block_in_its_own_folder_predicts_and_resumes_from_it(tmp_path):
    """No folder holds the whole model: training writes, and predict reads, each block only at its party;
    --resume continues from those checkpoints (the resumed epoch logged once, its loss the one saved)."""
    out = tmp_path / "run"
    template = str(tmp_path / "org{rank}" / "model")
    train(out, "-n", "3", "-m", "1", "--algorithm", "svrg", "--epochs", "2", "--party-dir", template,
          "--audit", *CANCER)
    assert not list(out.glob("*.ckpt.npz")) and not list(out.glob("audit-*"))  # what each received is its own
    for rank in range(3):
        assert sorted(p.name for p in (tmp_path / f"org{rank}" / "model").iterdir()) == [
            f"audit-{rank}.npz", f"party-{rank}.ckpt.npz", f"party-{rank}.prev.ckpt.npz",
            f"standardize-{rank}.npz"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-m", "vfl.cli", "predict", str(out)], cwd=REPO_ROOT, env=env,
                   check=True, capture_output=True, timeout=120)
    ds = load("breast-cancer", seed=0)
    w = np.zeros(ds.n_features)
    for rank, cols in enumerate(random_blocks(ds.n_features, 3, seed=0)):
        w[cols] = np.load(tmp_path / f"org{rank}" / "model" / f"party-{rank}.ckpt.npz")["w"]
    table = np.loadtxt(out / "predictions-test.csv", delimiter=",", skiprows=1)
    np.testing.assert_allclose(table[:, 1], ds.X_test @ w, atol=1e-6)
    first = metrics(out)
    train(out, "-n", "3", "-m", "1", "--algorithm", "svrg", "--epochs", "4", "--party-dir", template,
          "--resume", *CANCER)
    both = metrics(out)
    assert [r["epoch"] for r in both] == [0, 1, 2, 3, 4]  # the resumed epoch logged once
    assert both[2]["loss"] == pytest.approx(first[-1]["loss"], rel=1e-9)
    assert both[-1]["loss"] < both[2]["loss"]


def _sleepers(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(["sleep", "60"]) for _ in range(count)]


def _write_pids(out: Path, procs: list[subprocess.Popen]) -> None:
    for rank, proc in enumerate(procs):
        (out / f"party-{rank}.pid").write_text(str(proc.pid))


def test_the_first_death_is_the_one_process_the_watcher_saw_end(tmp_path):
    """Outside MPI, with no cleanup racing it, the watcher names exactly the process that was killed."""
    procs = _sleepers(3)
    try:
        watch = FirstDeath(tmp_path, 3)
        _write_pids(tmp_path, procs)
        time.sleep(0.5)  # the watcher has opened its pidfds
        procs[1].kill()
        procs[1].wait()
        assert watch.first() == (1,)
        assert died_first(watch.first()) == "party 1 died first"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_ranks_gone_together_are_all_named_as_a_tie_never_one_of_them_alone(tmp_path):
    """Two processes already gone when the watcher looks: the launcher cannot tell which died first, and
    says so; Hydra's banner is no tie-breaker (it names a rank it killed itself about a third of the time)."""
    procs = _sleepers(3)
    try:
        for proc in (procs[0], procs[2]):
            proc.kill()
            proc.wait()
        watch = FirstDeath(tmp_path, 3)
        _write_pids(tmp_path, procs)
        assert watch.first() == (0, 2)
        said = died_first(watch.first())
        assert said.startswith("party 0 or party 2 died first (all were gone")
        verdict = f"the job failed: {said}"
        assert says_died_first(verdict, "party 2") and not says_died_first(verdict, "party 1")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert died_first(()) is None


def test_a_stop_line_decides_the_outcome_whatever_code_mpiexec_reports():
    # Hydra may report the status of a rank it killed (9 for a SIGSTOPped one), not the abort code.
    output = "progress ...\n[party 1] stop (failed): party 2 has been silent for 3.1 s\n"
    assert find_stop(output) == ("failed", "party 2 has been silent for 3.1 s")
    assert find_stop("[party 0] stop (diverged): the model diverged") == ("diverged", "the model diverged")
    assert find_stop("[party 0] stop (no-such-outcome): x") is None
    assert find_stop("[party 0] error: x") is None
