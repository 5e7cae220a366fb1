"""The HE key process's entry: ``python -m protocols.label_he_key_child READ_FD WRITE_FD SCHEME KEY_BITS
PARENT`` (started by protocols/label_he_key_spawn.py). It ties its life to the rank's first, before it
imports numpy and HEU, then runs :func:`protocols.label_he_key_process.main`."""

from __future__ import annotations

import os
import signal
import sys


def die_with(parent: int) -> None:
    """The child: SIGKILL when ``parent`` ends (Linux's parent-death signal; parties/orphans.py ties
    the ranks the same way), and end now if it already has. Why: the child holds the rank's standard
    error, and ``mpiexec`` waits for every holder of a rank's output, so a rank that ended while its
    child still generated a key would hold its job's end for seconds."""
    if sys.platform.startswith("linux"):
        import contextlib
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)


if __name__ == "__main__":
    if int(sys.argv[5]):
        die_with(int(sys.argv[5]))
    from protocols.label_he_key_process import main

    main(sys.argv[1:5])
