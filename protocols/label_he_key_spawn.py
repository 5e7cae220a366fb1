"""Starting the dominator's HE key process (protocols/label_he_key_process.py) as early as a rank can.

Why: the child's start (an interpreter, numpy and HEU) and its key generation (1-5 s for a 2,048-bit
key on a loaded 2-core machine) are on a job's serial path when the label plane starts the child:
every other party waits for the public key. A rank that knows from its plan that it will dominate
under ``--label-privacy he`` calls :func:`start_early` first thing (``parties/rank.py``,
``parties/federation/member.py``), so the key is made while the rank imports, loads its data and
joins the others; :class:`~protocols.label_he_key_process.KeyProcess` then :func:`take`\\ s that child.

This module imports only the standard library, so that starting the child costs the rank nothing
before its own imports. The child's entry is protocols/label_he_key_child.py, which ties the child's
life to the rank's before its own imports. Nothing here is secret: the key pair is generated in the
child, and only its public half ever comes back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import NamedTuple


class Child(NamedTuple):
    """A started key process and the parent's ends of its two pipes."""
    process: subprocess.Popen
    to_child: int
    from_child: int


#: children started ahead of their :class:`KeyProcess`, by (scheme, key bits); each is taken once
_early: dict[tuple[str, int], Child] = {}


def _child_environment(root: str) -> dict[str, str]:
    """The rank's environment without what would make the child an MPI process: were mpi4py imported
    there, it would initialise MPI from the launcher's PMI variables and fail (or join the job); the
    child neither initialises MPI nor sees those variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_"))}
    env["MPI4PY_RC_INITIALIZE"] = "false"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return env


def spawn(scheme: str, key_bits: int) -> Child:
    """Start a key process for a ``scheme`` key of ``key_bits`` bits (a plain ``subprocess`` with two
    pipes: nothing is forked from the MPI rank); it generates the key pair at once and writes its public
    half, which :class:`KeyProcess` reads. Started from the main thread, the child dies with this
    process (label_he_key_child.py); from another thread it would die with that thread, so it is not tied
    and ends when its input closes."""
    to_child, parent_writes = os.pipe()
    parent_reads, from_child = os.pipe()
    root = str(Path(__file__).resolve().parents[1])
    tie = os.getpid() if threading.current_thread() is threading.main_thread() else 0
    process = subprocess.Popen(
        [sys.executable, "-m", "protocols.label_he_key_child", str(to_child), str(from_child), scheme,
         str(key_bits), str(tie)], pass_fds=(to_child, from_child), env=_child_environment(root), cwd=root,
        stdin=subprocess.DEVNULL)
    os.close(to_child)
    os.close(from_child)
    return Child(process, parent_writes, parent_reads)


def start_early(scheme: str, key_bits: int) -> bool:
    """Start the key process this rank's label plane will take (module doc). Never fails the rank: a
    child that cannot start now is started again, and its error reported, by the label plane. Whether
    one was started."""
    if (scheme, key_bits) in _early:
        return False
    try:
        _early[(scheme, key_bits)] = spawn(scheme, key_bits)
    except OSError:
        return False
    return True


def take(scheme: str, key_bits: int) -> Child:
    """The child :func:`start_early` started for this scheme and size, else a new one."""
    early = _early.pop((scheme, key_bits), None)
    return early if early is not None else spawn(scheme, key_bits)

