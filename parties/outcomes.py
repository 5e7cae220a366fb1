"""How a VFB² job can end, and the exit code ``vfl train`` returns for each (one place for both).

The leader decides the outcome of training (:class:`Outcome`) and broadcasts it as one word; a rank
that finds the model has left the secure aggregation's fixed-point range aborts the job with
``EXIT_CODES["diverged"]``, so the launcher gives the same advice for both ways of diverging.
"""

from __future__ import annotations

import re
from enum import IntEnum


class Outcome(IntEnum):
    """Why training stopped (or that it goes on), as the leader broadcasts it."""

    CONTINUE = 0
    BUDGET = 1  # --epochs or --time-limit used up
    TARGET = 2  # --target-suboptimality reached
    DIVERGED = 3  # loss non-finite or far above the initial loss


#: Exit codes of ``vfl train``; 2 is a user mistake found before any rank starts, as for every command.
EXIT_CODES = {"ok": 0, "failed": 1, "usage": 2, "diverged": 3, "target_missed": 4, "interrupted": 130}


#: The one line a rank prints before it ends the job for a reason the user must read (not a crash).
STOP_LINE = "[party {rank}] stop ({outcome}): {reason}"
_STOP = re.compile(r"\[party \d+\] stop \((\w+)\): (.*)")


def find_stop(output: str) -> tuple[str, str] | None:
    """The (outcome, reason) of the first stop line in a job's output, else None.

    The outcome travels in the line because ``mpiexec``'s own exit code cannot carry it reliably: when
    one rank aborts, Hydra kills the rest, and it may report a killed rank's status (e.g. 9 for a
    SIGSTOPped party it had to SIGKILL) instead of the abort code.
    """
    found = _STOP.search(output)
    if found is None or found.group(1) not in EXIT_CODES:
        return None
    return found.group(1), found.group(2)


def divergence_advice(gamma: float | None) -> str:
    """One line for a run that diverged; ``gamma``: the step it tried (None: derived, not known here)."""
    if gamma is None:
        return "try a smaller --gamma than the one derived from the data (the run's first line says it)"
    return f"try a smaller --gamma (tried {gamma:g}), or --gamma auto (a step derived from the data)"


def worse_than_start_warning(final: float, start: float, gamma: float) -> str:
    """One line for a run that ended above the loss of w = 0: training made the model worse."""
    return (f"warning: the final training loss {final:.6g} is above the loss at w = 0 ({start:.6g}): the "
            f"step γ = {gamma:.4g} is too long for this data; try a smaller --gamma (e.g. {gamma / 10:.3g})")
