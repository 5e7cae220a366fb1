"""How a VFB² job can end, and the exit code ``vfl train`` returns for each (one place for both).

The leader decides the outcome of training (:class:`Outcome`) and broadcasts it as one word; a rank
that finds the model has left the secure aggregation's fixed-point range aborts the job with
``EXIT_CODES["diverged"]``, so the launcher gives the same advice for both ways of diverging.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path


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


#: A verdict line of a rank that caught another one breaking the protocol (protocols/errors.py).
_ACCUSATION = re.compile(r"^\[party (\d+)\] (?:error: )?party (\d+) sent an invalid ")  # error: vfl align's
#: Most bytes of a verdict file read back: one line, written by a rank of this job.
_VERDICT_BYTES = 4096


@dataclass(frozen=True)
class Verdict:
    """What a rank wrote to ``<out>/verdict-<rank>.txt`` before it ended the job
    (:func:`parties.lifecycle.end_job`)."""

    at_ns: int
    rank: int
    line: str


def read_verdicts(out: Path, parties: int) -> list[Verdict]:
    """The ranks' verdicts, earliest first; a missing, oversized or malformed file is skipped (a rank
    killed while writing leaves half a line, and a verdict is evidence, not an instruction)."""
    found = []
    for rank in range(parties):
        try:
            with open(Path(out) / f"verdict-{rank}.txt", "rb") as fh:
                raw = fh.read(_VERDICT_BYTES + 1)
        except OSError:
            continue
        stamp, _, line = raw.decode(errors="replace").strip().partition(" ")
        if len(raw) <= _VERDICT_BYTES and stamp.isdigit() and line.startswith(f"[party {rank}]"):
            found.append(Verdict(int(stamp), rank, line))
    return sorted(found, key=lambda v: (v.at_ns, v.rank))


def decisive_verdict(verdicts: list[Verdict]) -> str | None:
    """The line that says why the job ended: the party accused by the most other parties (a hostile
    rank may accuse an honest one, but the honest ones that caught it outnumber it; ties go to the
    earliest accusation), else the earliest verdict; None without any."""
    accusers: dict[int, set[int]] = {}
    first: dict[int, str] = {}
    for verdict in verdicts:
        accusation = _ACCUSATION.match(verdict.line)
        if accusation and int(accusation.group(1)) != int(accusation.group(2)):
            accused = int(accusation.group(2))
            accusers.setdefault(accused, set()).add(verdict.rank)
            first.setdefault(accused, verdict.line)
    if accusers:
        order = list(first)  # insertion order: by time of the first accusation
        return first[max(order, key=lambda accused: (len(accusers[accused]), -order.index(accused)))]
    return verdicts[0].line if verdicts else None
