"""No orphans: when the launcher dies, even by SIGKILL, ``mpiexec`` and the ranks die too (Linux).

``vfl train`` (``mpirun.sh``) and ``vfl align`` start ``mpiexec``, which starts Hydra's proxy, which
starts the ranks. A launcher killed outright (SIGKILL, the OOM killer, a closed terminal's SIGHUP
where nothing handles it) runs no cleanup, and its ``mpiexec`` would go on as an orphan with every
rank of the job. Two links of the chain are tied with the kernel's parent-death signal
(``prctl(PR_SET_PDEATHSIG, SIGKILL)``), which needs no cooperation from the dying process:

* ``mpiexec`` is started through this module (:func:`tied_command`): ``python -m parties.orphans
  <launcher pid> mpiexec ...`` asks for the signal, checks that its parent is still the launcher (it
  may have died before the request), and ``exec``\\ s ``mpiexec``, which keeps it. Hydra's proxy ends
  its ranks when it loses ``mpiexec`` (measured here: within a second of a SIGKILL to ``mpiexec``).
* each rank asks for the signal too (:func:`die_with_parent`, from ``parties/rank.py`` and
  ``parties/align.py``), so it ends with its proxy even if the proxy itself was killed.

Not ``preexec_fn``: it runs Python in the forked child of a process with threads (the launcher's
first-death watcher), which may deadlock. The signal follows the parent *thread* that started the
child: the launcher starts ``mpiexec`` from the thread that then waits for it. Elsewhere than Linux
there is no such signal and the commands run as they are.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

#: prctl(2) option: the signal this process gets when its parent dies
PR_SET_PDEATHSIG = 1


def die_with_parent() -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux); end now if the parent is
    already gone (re-parented while asking). Whether the request was made."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before the request: nobody would signal us
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def tied_command(command: list[str]) -> list[str]:
    """``command`` started so that it dies with this process (see the module docstring)."""
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-m", "parties.orphans", str(os.getpid()), *command]


def main(argv: list[str]) -> None:
    """``python -m parties.orphans <parent pid> <command ...>``: tie, check, exec."""
    parent, command = int(argv[0]), argv[1:]
    die_with_parent()
    if os.getppid() != parent:  # the launcher died before we asked
        sys.exit(1)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
