"""A dominator held to its schedule (issue 26, finding 3, "only at the rate its schedule allows").

Only a dominator roots a request (``tests/test_hardening.py``); here one that does so beyond its schedule:
requests running ahead of its broadcasts (a flood makes every party compute for it at its rate), a
(ϑ, i) for a step it never had aggregated, for other rows than its request's, or a second one for one
step. Unit checks of :class:`~protocols.schedule.DominatorSchedule`, then real jobs with a hostile
dominator, which must end within ``--peer-timeout`` + 2 s naming it.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest

from protocols.errors import ProtocolViolation
from protocols.schedule import DominatorSchedule
from tests.conftest import run_mpi

TIMEOUT = 3.0  # hostile_schedule.py's --peer-timeout


def _named(root: int, what: str) -> str:
    return "^" + re.escape(f"party {root} sent an invalid {what}: ")


def test_an_honest_schedule_passes_with_inflight_requests_ahead_of_the_broadcasts() -> None:
    schedule = DominatorSchedule(3, inflight=2, dispatch=True)
    schedule.request(1, 0, np.array([3, 5]))
    schedule.request(1, 1, np.array([4, 6]))
    assert schedule.due(1) == 2
    with pytest.raises(ProtocolViolation, match=_named(1, "REQUEST") + "request id 2 before its "
                       r"\(ϑ, i\) #0 arrived: no more than --inflight \(2\)"):
        schedule.request(1, 2, np.array([1, 2]))
    schedule.broadcast(1, 0, np.array([3, 5]), finished=True)
    schedule.request(1, 2, np.array([1, 2]))
    assert schedule.due(1) == 2 and schedule.due(0) == 0  # bounded by --inflight, per dominator


@pytest.mark.parametrize(("seq", "rows", "finished", "detail"), [
    (1, [3, 5], True, "#1 is for a step it never requested"),
    (0, [5, 3], True, "#0 is for rows [5, 3] where its request aggregated rows [3, 5]"),
    (0, [3, 5], False, "#0 came before its request was aggregated"),
])
def test_a_broadcast_must_be_for_an_aggregated_request_and_its_rows(seq, rows, finished, detail) -> None:
    schedule = DominatorSchedule(3, inflight=1, dispatch=True)
    schedule.request(0, 0, np.array([3, 5]))
    with pytest.raises(ProtocolViolation, match=_named(0, "(ϑ, i) message") + re.escape(detail)):
        schedule.broadcast(0, seq, np.array(rows), finished=finished)


def test_a_second_broadcast_for_one_step_and_any_broadcast_without_dispatch_are_refused() -> None:
    schedule = DominatorSchedule(2, inflight=1, dispatch=True)
    schedule.request(0, 0, np.array([3]))
    schedule.broadcast(0, 0, np.array([3]), finished=True)
    with pytest.raises(ProtocolViolation, match="#0 is for a step it never requested"):
        schedule.broadcast(0, 0, np.array([3]), finished=True)
    silent = DominatorSchedule(2, inflight=1, dispatch=False)  # AFSVRG-VP: requests only
    for rid in range(5):
        silent.request(0, rid, np.array([3]))
    assert silent.due(0) == 0
    with pytest.raises(ProtocolViolation, match="this job's algorithm broadcasts no"):
        silent.broadcast(0, 0, np.array([3]), finished=True)


@pytest.mark.mpi
@pytest.mark.parametrize(("scenario", "detail"), [
    ("flood", "REQUEST: request id 11 "),
    ("unrequested", "(ϑ, i) message: #10 is for a step it never requested"),
    ("rows", "(ϑ, i) message: #10 is for rows [7, 9] where its request aggregated rows [3, 5]"),
    ("twice", "(ϑ, i) message: #11 is for a step it never requested"),
])
def test_a_dominator_beyond_its_schedule_ends_the_job_named(tmp_path: Path, scenario: str, detail: str):
    from parties.outcomes import decisive_verdict, read_verdicts

    proc = run_mpi(3, ["tests/mpi_scripts/hostile_schedule.py", scenario, str(tmp_path)], check=False,
                   timeout=90)
    ended = time.time()
    output = proc.stdout + proc.stderr
    found = re.search(r"ATTACK (\d+\.\d+)", proc.stdout)
    assert found and proc.returncode != 0 and "NOT REJECTED" not in output, output
    assert ended - float(found.group(1)) < TIMEOUT + 2, output
    verdict = decisive_verdict(read_verdicts(tmp_path, 3))
    assert verdict is not None and f"party 1 sent an invalid {detail}" in verdict, (verdict, output)


def test_the_largest_inflight_is_what_every_party_holds_per_dominator() -> None:
    from parties.config import MAX_INFLIGHT
    from parties.data_plane import MAX_OPEN_REQUESTS

    assert MAX_INFLIGHT == MAX_OPEN_REQUESTS  # --inflight past the receivers' bound would be refused
