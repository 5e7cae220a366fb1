"""What every benchmark records beside its numbers: the CPU model and the load average.

One place, so that every result on this shared machine says the same thing the same way."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name and the number of cores this process may use, e.g. "AMD EPYC x2"."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x{cores}"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} x{cores}"
