"""What a small job's start-up must not pay for (``python -m experiments startup`` measures it).

The launcher of ``vfl train`` validates the options, solves the NonF reference and writes the party
files; it never runs a kernel or a model, so numba, torch and scikit-learn must stay out of it (numba
alone costs a process a large part of a second, scikit-learn half a second), and so must ``mpi4py.MPI``,
which would initialise MPI in a process that is not a rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO_ROOT

NEVER_IN_THE_LAUNCHER = ("numba", "llvmlite", "torch", "sklearn", "mpi4py.MPI", "vertical.kernels")

LAUNCHER = """
import json, sys
from vfl.cli import build_parser
from parties.config import from_args
from parties.launch import prepare
args = build_parser().parse_args(["train", "-n", "4", "--dataset", "breast-cancer", "--out", sys.argv[1]])
plan = prepare(from_args(args))
print(json.dumps({"f_star": plan.f_star, "loaded": sorted(set(sys.modules) & set(sys.argv[2:]))}))
"""


def test_the_launcher_prepares_a_job_without_numba_torch_sklearn_or_mpi(tmp_path):
    """Everything ``vfl train`` does before ``mpiexec`` (options, data checks, f*, the party files), in a
    fresh interpreter: none of those modules is loaded, and the job was really prepared."""
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, str(tmp_path / "run"), *NEVER_IN_THE_LAUNCHER],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True,
                          text=True, timeout=120, check=True)
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["loaded"] == []
    assert report["f_star"] > 0 and (tmp_path / "run" / "parties" / "party-3").is_dir()


def test_the_update_rules_are_defined_without_numba():
    """The algorithm table (and with it ``vfl train --help``) comes from the rules; numba comes only with
    the first kernel a rule runs."""
    code = ("import sys; from vertical.algorithms.registry import ALGORITHMS; import vfl.cli; "
            "vfl.cli.build_parser(); print('numba' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                          capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.strip() == "False"
