"""One ``vfl train`` with timestamps, for ``python -m experiments startup`` (``bench_startup.py``).

Run as a script, ``python _startup_probe.py T0 MARKS -- <vfl arguments>``, with the tree under test first on
``PYTHONPATH``: it imports that tree's ``vfl.cli`` and ``parties.launch``, wraps the launcher's steps with
clocks (the same names in every tree measured), starts the ranks through :mod:`_startup_rank` (this
folder is on the ranks' path) instead of ``parties.rank``, and writes the launcher's marks to MARKS as
JSON: seconds since T0, the parent's ``time.time()`` just before it started this process.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    t0, marks_path, argv = float(sys.argv[1]), Path(sys.argv[2]), sys.argv[4:]
    marks: dict[str, float] = {"exec": time.time() - t0}
    import parties.launch as launch
    import vfl.cli

    marks["imported"] = time.time() - t0
    durations: dict[str, float] = {}

    def clocked(name: str, func):
        def run(*args, **kwargs):
            started = time.time()
            try:
                return func(*args, **kwargs)
            finally:
                durations[name] = durations.get(name, 0.0) + time.time() - started
        return run

    for name in ("resolve", "reference_f_star", "write_party_files"):
        setattr(launch, name, clocked(name, getattr(launch, name)))
    run_module = launch.run_mpi_module

    def run_ranks(ranks, module, args, **kwargs):
        marks["mpiexec"] = time.time() - t0
        env = dict(kwargs.pop("extra_env", None) or {})
        env["VFL_STARTUP_MARKS"] = str(marks_path.with_suffix(""))
        env["VFL_STARTUP_T0"] = repr(t0)
        env["PYTHONPATH"] = os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(HERE)])
        try:
            return run_module(ranks, "_startup_rank", args, extra_env=env, **kwargs)
        finally:
            marks["job_end"] = time.time() - t0

    launch.run_mpi_module = run_ranks
    code = vfl.cli.main(argv)
    marks["main_end"] = time.time() - t0
    marks_path.write_text(json.dumps({"marks": marks, "durations": durations}))
    return code


if __name__ == "__main__":
    sys.exit(main())
