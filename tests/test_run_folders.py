"""Where a run's files go and which defaults it uses: the same whatever options are given, shown in
``--help``, and a finished run is never overwritten silently."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from parties.config import ConfigError, RunConfig, build_parser, from_args
from parties.launch import run_folder
from parties.plan import JobPlan
from tests.conftest import REPO_ROOT
from vertical.algorithms.registry import ALGORITHMS


@pytest.mark.mpi
def test_the_quickstart_job_gets_its_own_folder_and_the_documented_defaults(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    for _ in range(2):
        proc = subprocess.run([str(REPO_ROOT / "mpirun.sh"), "--no-progress"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=240, check=False)
        assert proc.returncode == 0, proc.stderr
    runs = sorted(p for p in (tmp_path / "runs").iterdir() if not p.is_symlink())
    assert len(runs) == 2 and all(p.name.endswith("breast-cancer") for p in runs)
    assert (tmp_path / "runs" / "latest").resolve() == runs[-1].resolve()
    used = json.loads((runs[-1] / "config.json").read_text())
    assert (used["lam"], used["gamma"]) == (RunConfig().lam, RunConfig().gamma)


def test_options_do_not_change_the_defaults_of_other_options():
    plain = from_args(build_parser().parse_args([]))
    with_out = from_args(build_parser().parse_args(["--out", "somewhere", "--epochs", "3"]))
    assert (plain.lam, plain.gamma, plain.algorithm) == (with_out.lam, with_out.gamma, with_out.algorithm)


def test_help_shows_every_default_and_every_registered_algorithm():
    text = subprocess.run([sys.executable, "-m", "vfl.cli", "train", "--help"], cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True,
                          check=True).stdout
    assert f"(default: {RunConfig().gamma})" in text and f"(default: {RunConfig().lam})" in text
    for name in ALGORITHMS:
        assert name in text


def test_a_finished_run_is_not_overwritten_silently(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"holds another run: pass --resume .* --overwrite"):
        run_folder(RunConfig(out=str(tmp_path)))
    assert run_folder(RunConfig(out=str(tmp_path), overwrite=True)) == tmp_path
    assert run_folder(RunConfig(out=str(tmp_path), resume=True)) == tmp_path


@pytest.mark.mpi
def test_with_a_named_dataset_each_rank_reads_only_its_own_block(tmp_path):
    """The launcher loads the dataset once and writes one file per party; the ranks read only those."""
    import numpy as np
    import scipy.sparse as sp

    from parties.loading import load_party
    from tests.test_runtime import CANCER, train
    from vertical.datasets import load, load_party_file
    from vertical.datasets.party_files import find_party_file
    from vertical.partition import random_blocks

    train(tmp_path, "-n", "3", "-m", "1", "--epochs", "1", *CANCER)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["party_files"] == str(tmp_path / "parties")
    ds = load("breast-cancer", seed=0)
    for rank, cols in enumerate(random_blocks(ds.n_features, 3, seed=0)):
        mine = load_party_file(find_party_file(tmp_path / "parties", rank))
        assert mine.source.is_dir()  # the memory-mappable layout: the rank maps its block
        assert list(mine.columns) == list(cols) and mine.X_train.shape == (ds.n_train, len(cols))
        assert mine.has_labels == (rank == 0)
        # what the rank itself builds from its file (parties.loading, the rank's own code path): its
        # columns only, its labels only if active; and the block it trained and saved is that wide
        party = load_party(JobPlan.from_json((tmp_path / "config.json").read_text()), rank)
        assert party.block.n_cols == party.w.size == len(cols)
        assert (party.y is not None) == (rank == 0)
        held = sp.csr_matrix((party.block.data, party.block.indices, party.block.indptr),
                             shape=(party.block.n_rows, party.block.n_cols))
        assert abs(held - ds.X_train[:, cols]).max() == 0
        assert np.load(tmp_path / f"party-{rank}.ckpt.npz")["w"].size == len(cols)
