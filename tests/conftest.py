"""Shared test helpers: running real ``mpiexec`` jobs from pytest."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from parties.launch import mpiexec_path

REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """A suite started in the background (``python -m pytest … &``) inherits SIGINT ignored, as POSIX
    shells give background jobs, and so would every process the tests start: the Ctrl-C tests (a
    launcher interrupted, a service stopped) then fail although vfl is right. Restore the default."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def requires_dataset(name: str) -> pytest.MarkDecorator:
    """Mark a test that reads the registered dataset ``name``: it is skipped, with the folders that
    were searched as the reason, when the files are absent (``$VFL_DATA_DIR``, ``../shared/data``)."""
    from vertical.datasets import data_dir_candidates, list_datasets

    present = {info.name: info.present for info in list_datasets()}
    folders = ", ".join(map(str, data_dir_candidates()))
    return pytest.mark.skipif(not present[name], reason=f"dataset {name} not found in {folders}")


def says_died_first(text: str, who: str) -> bool:
    """The launcher's verdict names ``who`` as the party that died first, or, when the ranks were all gone
    by the time it looked (a loaded machine), among those it names; never another party alone."""
    if f"{who} died first" in text:
        return True
    tie = re.search(r": ([^:]*?) died first \(all were gone", text)
    return bool(tie) and who in re.split(r", | or ", tie.group(1))


def run_mpi(n: int, args: list[str], *, timeout: float = 120.0, env: dict[str, str] | None = None,
            check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``mpiexec -n n python -m mpi4py <args>`` from the repository root and return the result.

    ``python -m mpi4py`` makes an uncaught exception in one rank abort the whole job instead of
    hanging it (see ../shared/notes/mpi-on-this-machine.md).
    """
    cmd = [mpiexec_path(), "-n", str(n), sys.executable, "-m", "mpi4py", *args]
    full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    if check and proc.returncode != 0:
        pytest.fail(f"mpiexec failed with code {proc.returncode}\nstdout:\n{proc.stdout}\n"
                    f"stderr:\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session")
def ou_key():
    """One OU 2048-bit key pair for every module that needs one (each generation takes 1-2 s, more on a
    loaded machine); the tests only encrypt and decrypt with it, none changes it."""
    from protocols import label_he

    return label_he.LabelKey("ou", 2048)


@pytest.fixture(scope="session")
def paillier_2048_key():
    """One Paillier 2048-bit key pair, shared like :func:`ou_key`."""
    from protocols import label_he

    return label_he.LabelKey("paillier", 2048)
