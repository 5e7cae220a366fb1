"""``vfl party JOB --as NAME … --serve``: the command (``vfl.cli`` hands it ``--serve``).

The leader runs its endpoint and one federation after another (:mod:`parties.serving.supervisor`); a
passive party joins one federation after another (:func:`rejoin`) until the leader stops the service.
What a federation is, and why it ends, is :mod:`parties.serving.organisation`'s docstring.
"""

from __future__ import annotations

import argparse
import time

from parties.serving.organisation import (
    FEDERATION_ENDED,
    PROTOCOL_BROKEN,
    REJOIN_AFTER_END_S,
    REJOIN_CAP_S,
    REJOIN_FIRST_S,
    Serving,
    checked_serving,
    federation_argv,
    mpi_env,
)


def serve_command(args: argparse.Namespace) -> int:
    """``vfl party … --serve``: the leader's endpoint and federations, or a passive party's joins.
    This process does no MPI itself (each federation is a process of its own): the modules it shares
    with the federation's process must not initialize MPI here."""
    import mpi4py

    mpi4py.rc.initialize = mpi4py.rc.finalize = False
    serving = checked_serving(args)
    if serving.rank == 0:
        from parties.serving.supervisor import supervise

        return supervise(args, serving)
    return rejoin(args, serving)


def rejoin(args: argparse.Namespace, serving: Serving) -> int:
    """A passive party: one federation after another until the leader stops the service, this party
    is stopped, or a protocol is broken (then the verdict's line, and no new attempt)."""
    from parties.launch import run_mpi_module

    def say(line: str) -> None:
        print(f"vfl party {args.name}: {line}", flush=True)

    argv, delay, attempt = federation_argv(args, serving), REJOIN_FIRST_S, 0
    while True:
        attempt += 1
        say(f"serving: federation attempt {attempt}")
        try:
            code, _ = run_mpi_module(1, "parties.serving.federated", argv, extra_env=mpi_env(),
                                     keep="stderr")
        except KeyboardInterrupt:
            say("serving: stopped")
            return 0
        if code in (0, 2, PROTOCOL_BROKEN):
            return code
        if code == FEDERATION_ENDED:
            delay = REJOIN_AFTER_END_S
        say(f"serving: attempt {attempt} ended (exit code {code}); joining again in {delay:g} s")
        try:
            time.sleep(delay)
        except KeyboardInterrupt:
            say("serving: stopped")
            return 0
        delay = REJOIN_FIRST_S if code == FEDERATION_ENDED else min(2 * delay, REJOIN_CAP_S)
