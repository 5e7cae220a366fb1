"""How a training job ends, as a user sees it: divergence, a missed target, Ctrl-C, a resume after an
interrupt, and mistakes caught before ``mpiexec`` starts. Real jobs through ``vfl train``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO_ROOT
from tests.test_runtime import CANCER, metrics, refused, train
from vertical.datasets import DatasetNotFoundError

pytestmark = pytest.mark.mpi

SMALL = ["-n", "3", "-m", "1", "--dataset", "breast-cancer"]


def test_a_diverging_run_ends_with_advice_on_gamma(tmp_path):
    proc = train(tmp_path, *SMALL, "--gamma", "200", "--epochs", "5", check=False)
    assert proc.returncode == 3, proc.stderr
    assert "diverged at epoch 1" in proc.stderr and "try a smaller --gamma (tried 200)" in proc.stderr
    assert len(metrics(tmp_path)) == 2  # stopped at the first evaluation that saw it


def test_scores_out_of_the_aggregation_range_give_the_same_advice(tmp_path):
    proc = train(tmp_path, *SMALL, "--gamma", "1e6", "--epochs", "5", check=False)
    assert proc.returncode == 3
    assert "try a smaller --gamma (tried 1e+06)" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "fraction bits" not in proc.stdout + proc.stderr


def test_a_missed_target_says_so_and_exits_4(tmp_path):
    proc = train(tmp_path, *SMALL, "--epochs", "1", "--target-suboptimality", "1e-12", check=False)
    assert proc.returncode == 4
    assert "--target-suboptimality 1e-12 not reached" in proc.stderr and "after 1 epochs" in proc.stderr


def test_resume_takes_the_newest_epoch_every_party_completed_even_after_two_crashes_before_the_mark(
        tmp_path):
    """An interrupt between the parties' writes leaves blocks of two epochs: resume must not mix them.
    Crash 1: epoch 3 written, never marked (and a half-written block of party 1 left behind); the
    resume from 2 writes epoch 3 again and is never marked either (crash 2, played by putting the
    manifest back): epoch 2 must still be on disk for the second resume."""
    train(tmp_path, *CANCER, "-n", "3", "-m", "1", "--epochs", "3")
    first = metrics(tmp_path)
    (tmp_path / "checkpoint.json").write_text(json.dumps({"epochs": 2.0}))
    (tmp_path / "party-1.ckpt.npz.tmp").write_bytes(b"half a block")
    proc = train(tmp_path, *CANCER, "-n", "3", "-m", "1", "--epochs", "3", "--resume")
    assert "resuming from epoch 2" in proc.stdout
    assert not (tmp_path / "party-1.ckpt.npz.tmp").exists()
    assert [r["epoch"] for r in metrics(tmp_path)] == [0, 1, 2, 3]  # epoch 3, never marked, trained again
    (tmp_path / "checkpoint.json").write_text(json.dumps({"epochs": 2.0}))
    proc = train(tmp_path, *CANCER, "-n", "3", "-m", "1", "--epochs", "4", "--resume")
    assert "resuming from epoch 2" in proc.stdout
    both = metrics(tmp_path)
    assert [r["epoch"] for r in both] == [0, 1, 2, 3, 4]  # each epoch logged once
    assert both[:2] == first[:2]
    resumed = both[2:]
    assert resumed[0]["epoch"] == 2 and resumed[0]["loss"] == pytest.approx(first[2]["loss"], rel=1e-12)
    assert resumed[0]["updates"] == first[2]["updates"]  # counters continue across a resume
    assert resumed[-1]["epoch"] == 4 and resumed[-1]["updates"] > first[-1]["updates"]
    assert resumed[-1]["time"] > first[2]["time"]


def test_ctrl_c_stops_the_job_at_once_and_says_how_to_resume(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "vfl.cli", "train", "--out", str(tmp_path), "--no-progress", *SMALL,
           "--epochs", "100000"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "checkpoint.json").exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    sent = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert time.monotonic() - sent < 15
    assert "interrupted; the last complete epoch is" in err and "resume with --resume" in err
    assert "Traceback" not in out + err and "died first" not in err


def test_mistakes_found_before_mpiexec_are_one_line_with_exit_2(tmp_path):
    proc = train(tmp_path / "empty", *SMALL, "--resume", check=False)
    assert proc.returncode == 2 and "no complete checkpoint to resume from" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "empty" / "config.json").exists()
    (tmp_path / "a-file").write_text("")
    proc = refused(tmp_path / "a-file" / "run", *SMALL)  # in this process: the command's exit code is main's
    assert proc.returncode == 2 and "cannot write there" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1



def test_experiments_without_their_data_say_so_in_plain_words(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "VFL_DATA_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "experiments", "hfl_quick", "--rounds", "1"], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("python -m experiments hfl_quick: ") and "Traceback" not in proc.stderr


@pytest.mark.parametrize("experiment", ["vfb2_table2", "vfb2_async", "vfb2_lr_sweep"])
def test_an_experiment_without_any_of_its_data_replaces_no_result(tmp_path, monkeypatch, experiment):
    """A run whose data files are all absent once overwrote the committed Table 2 with empty tables."""
    import importlib

    empty, out = tmp_path / "no-data", tmp_path / "results"
    empty.mkdir()
    out.mkdir()
    (out / "kept.md").write_text("committed result\n")
    monkeypatch.setenv("VFL_DATA_DIR", str(empty))
    monkeypatch.setenv("XDG_CACHE_HOME", str(empty))
    module = importlib.import_module(f"experiments.{experiment}")
    with pytest.raises(DatasetNotFoundError, match="no result was replaced"):
        module.main(["--datasets", "a9a", "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["kept.md"]


def test_horizontal_fl_without_torch_says_how_to_install_it(monkeypatch, capsys):
    import importlib.util

    from vfl import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    assert cli.main(["hfl-train", "--algorithm", "fedavg"]) == 2
    assert "pip install torch==2.13.0" in capsys.readouterr().err


def test_no_reference_skips_the_nonf_solve_and_reports_the_loss(tmp_path, monkeypatch):
    import parties.launch

    def refuse(config):
        raise AssertionError("the NonF reference was solved despite --no-reference")

    monkeypatch.setattr(parties.launch, "reference_f_star", refuse)
    from parties.config import RunConfig

    config = RunConfig(parties=3, active=1, dataset="breast-cancer", epochs=1, reference=False,
                       progress=False, out=str(tmp_path / "run"))
    assert parties.launch.launch(config, echo=False) == 0
    last = metrics(tmp_path / "run")[-1]
    assert "loss" in last and "suboptimality" not in last
    proc = refused(tmp_path / "refused", *SMALL, "--no-reference", "--target-suboptimality", "1e-3")
    assert proc.returncode == 2 and "--target-suboptimality needs f*" in proc.stderr
