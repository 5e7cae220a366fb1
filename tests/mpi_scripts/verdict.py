"""What the tamper scripts share: how party 0 awaits its own verdict on the bad message party 1 sent.

A correct receiver rejects the message on its communication thread and ends the whole job (this process
included); a broken one accepts it and applies it like any other (ϑ, i). Waiting on the data plane's
``applied`` counter is therefore an exact synchronisation, where a fixed sleep was only a guess that
failed under load. The deadline only turns a lost message into a failed test instead of a hung one.
"""

from __future__ import annotations

from parties.runtime import PartyRuntime

DEADLINE_S = 60.0


def await_verdict(runtime: PartyRuntime, source: int, accepted_after: int) -> None:
    """Return once ``accepted_after`` (ϑ, i) messages from ``source`` have been applied here (the bad
    one was accepted), or after :data:`DEADLINE_S` saying so; never returns if the bad one is rejected."""
    plane = runtime.plane
    with plane.applied_cond:
        applied = plane.applied_cond.wait_for(lambda: plane.applied[source] >= accepted_after,
                                              timeout=DEADLINE_S)
    if not applied:
        print(f"no verdict on party {source}'s message within {DEADLINE_S:.0f} s", flush=True)
