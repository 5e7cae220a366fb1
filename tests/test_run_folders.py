"""Where a run's files go and which defaults it uses: the same whatever options are given, shown in
``--help``, and a finished run is never overwritten silently."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from parties.config import ConfigError, RunConfig, build_parser, from_args
from parties.launch import run_folder
from parties.plan import JobPlan
from tests.conftest import REPO_ROOT
from vertical.algorithms.registry import ALGORITHMS


@pytest.fixture(scope="module")
def quickstart_runs(tmp_path_factory):
    """The quickstart as written, then a second (one-epoch) job, from one folder: the two runs' folders
    (oldest first) and that folder."""
    here = tmp_path_factory.mktemp("quickstart")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    for extra in ([], ["--epochs", "1"]):
        proc = subprocess.run([str(REPO_ROOT / "mpirun.sh"), "--no-progress", *extra], cwd=here, env=env,
                              capture_output=True, text=True, timeout=240, check=False)
        assert proc.returncode == 0, proc.stderr
    return sorted(p for p in (here / "runs").iterdir() if not p.is_symlink()), here


@pytest.mark.mpi
def test_the_quickstart_job_gets_its_own_folder_and_the_documented_defaults(quickstart_runs):
    """Each job gets its own folder, latest is the newest, and the quickstart ran with the documented
    defaults."""
    runs, here = quickstart_runs
    assert len(runs) == 2 and all(p.name.endswith("breast-cancer") for p in runs)
    assert (here / "runs" / "latest").resolve() == runs[-1].resolve()
    assert json.loads((runs[-1] / "config.json").read_text())["epochs"] == 1
    used = json.loads((runs[0] / "config.json").read_text())
    assert (used["lam"], used["gamma"], used["epochs"]) == (RunConfig().lam, RunConfig().gamma,
                                                            RunConfig().epochs)


def test_options_do_not_change_the_defaults_of_other_options():
    plain = from_args(build_parser().parse_args([]))
    with_out = from_args(build_parser().parse_args(["--out", "somewhere", "--epochs", "3"]))
    assert (plain.lam, plain.gamma, plain.algorithm) == (with_out.lam, with_out.gamma, with_out.algorithm)


def test_help_shows_every_default_and_every_registered_algorithm():
    text = subprocess.run([sys.executable, "-m", "vfl.cli", "train", "--help"], cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True,
                          check=True).stdout
    assert "(default: auto)" in text and f"(default: {RunConfig().lam})" in text
    for name in ALGORITHMS:
        assert name in text


def test_a_finished_run_is_not_overwritten_silently(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"holds another run: pass --resume .* --overwrite"):
        run_folder(RunConfig(out=str(tmp_path)))
    assert run_folder(RunConfig(out=str(tmp_path), overwrite=True)) == tmp_path
    assert run_folder(RunConfig(out=str(tmp_path), resume=True)) == tmp_path


@pytest.mark.mpi
def test_with_a_named_dataset_each_rank_reads_only_its_own_block(quickstart_runs, monkeypatch):
    """The launcher loads the dataset once and writes one file per party; the ranks read only those
    (the quickstart's one-epoch job: q = 4, m = 2)."""
    import numpy as np
    import scipy.sparse as sp

    from parties.loading import load_party
    from vertical.datasets import load, load_party_file
    from vertical.datasets.party_files import find_party_file
    from vertical.partition import random_blocks

    runs, here = quickstart_runs
    run = runs[-1]
    monkeypatch.chdir(here)  # the quickstart's folders are relative to where it ran
    config = json.loads((run / "config.json").read_text())
    assert config["party_files"] == str((run / "parties").relative_to(here))
    assert (config["parties"], config["active"], config["seed"]) == (4, 2, 0)
    ds = load("breast-cancer", seed=0)
    for rank, cols in enumerate(random_blocks(ds.n_features, 4, seed=0)):
        mine = load_party_file(find_party_file(run / "parties", rank))
        assert mine.source.is_dir()  # the memory-mappable layout: the rank maps its block
        assert list(mine.columns) == list(cols) and mine.X_train.shape == (ds.n_train, len(cols))
        assert mine.has_labels == (rank < 2)
        # what the rank itself builds from its file (parties.loading, the rank's own code path): its
        # columns only, its labels only if active; and the block it trained and saved is that wide
        party = load_party(JobPlan.from_json((run / "config.json").read_text()), rank)
        assert party.block.n_cols == party.w.size == len(cols)
        assert (party.y is not None) == (rank < 2)
        held = sp.csr_matrix((party.block.data, party.block.indices, party.block.indptr),
                             shape=(party.block.n_rows, party.block.n_cols))
        assert abs(held - ds.X_train[:, cols]).max() == 0
        assert np.load(run / f"party-{rank}.ckpt.npz")["w"].size == len(cols)


# ------------------------------------------------------------------- --resume: the run folder is the run

#: A run whose options are far from the defaults: a resume that took them from the defaults (breast-cancer,
#: logistic, svrg, 4 parties, 10 epochs) could not pass for it.
DIABETES = ["-n", "3", "-m", "1", "--dataset", "diabetes", "--problem", "least-squares", "--lam", "0.1",
            "--gamma", "0.01", "--algorithm", "sgd", "--epochs", "2"]


@pytest.fixture(scope="module")
def resumable(tmp_path_factory):
    from tests.test_runtime import train

    out = tmp_path_factory.mktemp("diabetes-run")
    train(out, *DIABETES)
    return out


def folder_bytes(folder) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.mpi
@pytest.mark.parametrize("given, message", [
    (["-n", "4"], "--parties is 3 in {out}, not 4"),
    (["-m", "2"], "--active is 1 in {out}, not 2"),
    (["--dataset", "w8a"], "--dataset is diabetes in {out}, not w8a"),
    (["--party-files", "elsewhere"], "--party-files is not set in {out}, not elsewhere"),
    (["--problem", "robust"], "--problem is least-squares in {out}, not robust"),
    (["--algorithm", "svrg"], "--algorithm is sgd in {out}, not svrg"),
    (["--lam", "1e-4"], "--lam is 0.1 in {out}, not 0.0001"),
    (["--gamma", "0.05"], "--gamma is 0.01 in {out}, not 0.05"),
    (["-B", "8"], "--batch-size is 1 in {out}, not 8"),
    (["--seed", "1"], "--seed is 0 in {out}, not 1"),
    (["--mode", "sync"], "--mode is async in {out}, not sync"),
    (["--label-privacy", "dp", "--epsilon", "1"], "--label-privacy is none in {out}, not dp"),
    (["--f-star", "1.5"], "--f-star is not set in {out}, not 1.5"),
    (["--epochs", "1"], "{out} has 2 epochs complete already; --epochs 1 would end before them"),
])
def test_resume_refuses_an_option_that_would_change_the_model_and_leaves_the_folder_as_it_was(
        resumable, given, message, capsys):
    from vfl.cli import main

    before = folder_bytes(resumable)
    code = main(["train", "--resume", "--out", str(resumable), "--no-progress", *given])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("vfl train: error: ") and err.count("\n") == 1, err
    assert message.format(out=resumable) in err
    assert folder_bytes(resumable) == before  # still the same run, still resumable


@pytest.mark.mpi
def test_resume_restores_the_runs_options_and_takes_only_budget_changes(resumable, tmp_path):
    """``--resume --out RUN`` alone continues the run as it was (dataset, f*, epochs); a moved folder
    takes its party files along; more --epochs (and an option repeated at the run's own value) is a
    budget change."""
    from tests.test_runtime import metrics, train

    run = tmp_path / "moved"
    shutil.copytree(resumable, run)
    saved = json.loads((run / "config.json").read_text())
    (run / "checkpoint.json").write_text(json.dumps({"epochs": 1.0}))  # as if interrupted after epoch 1
    proc = train(run, "--resume")
    assert "resuming " + str(run) + ": diabetes, sgd (async), q=3/m=1, from epoch 1 to 2" in proc.stdout
    result = json.loads((run / "result.json").read_text())
    assert (result["data"], result["epochs"]) == ("diabetes", 2.0)
    last = metrics(run)[-1]
    assert last["suboptimality"] == pytest.approx(last["loss"] - saved["f_star"], rel=1e-12)
    now = json.loads((run / "config.json").read_text())
    assert now["f_star"] == saved["f_star"] and now["party_files"] == str(run / "parties")
    assert {k: v for k, v in now["options"].items() if k not in ("out", "resume")} == \
        {k: v for k, v in saved["options"].items() if k not in ("out", "resume")}

    train(run, "--resume", "--epochs", "3", "--dataset", "diabetes", "-n", "3")
    result = json.loads((run / "result.json").read_text())
    assert (result["data"], result["epochs"]) == ("diabetes", 3.0)
    assert metrics(run)[-1]["suboptimality"] == pytest.approx(metrics(run)[-1]["loss"] - saved["f_star"])
    assert json.loads((run / "config.json").read_text())["options"]["epochs"] == 3.0


def test_only_the_options_on_the_command_line_count_as_given():
    from parties.config import given_options
    from parties.hosts import add_arguments

    assert given_options(["--epochs", "10", "-n", "4", "--no-progress"], add_arguments) == \
        {"epochs", "parties", "progress"}  # 10 and 4 are the defaults: given all the same
    assert given_options(["--hostfile", "h", "--out", "x"], add_arguments) == {"out"}


def test_the_options_a_resume_may_change_are_the_budget_and_where_the_output_goes():
    from parties.config import budget_options

    assert budget_options() == {"epochs", "time_limit", "target_suboptimality", "progress", "peer_timeout",
                                "audit", "out", "resume", "overwrite", "data_dir", "compute_threads"}
