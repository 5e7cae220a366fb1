"""One party of ``vfl serve`` under ``mpiexec`` (``python -m mpi4py -m parties.serving.rank …``).

Every rank loads its own block and rows (:mod:`parties.serving.store`) and joins two communicators
of its own: the service's (ids and answers, :mod:`parties.serving.wire`) and the secure aggregation's.
A run trained with ``--secure-channels`` is served sealed on both, under the run's keys and a fresh
session (:mod:`parties.serving.sealing`).
The leader then serves HTTP until SIGINT/SIGTERM and tells the others to stop; a passive party ignores
those signals (``mpiexec`` forwards them to every rank) and ends when the leader says so, so that no
rank leaves in the middle of an aggregation. A party that breaks the protocol ends the service with a
verdict naming it, as in training (:mod:`parties.lifecycle`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    from mpi4py import MPI

    from parties.lifecycle import end_job, exit_now, report_verdicts_to, write_verdict
    from parties.orphans import die_with_parent
    from parties.outcomes import EXIT_CODES
    from parties.threads import configure_rank
    from protocols.errors import ProtocolViolation
    from protocols.masking import PrecisionWarning

    warnings.filterwarnings("ignore", category=PrecisionWarning)  # as in training (parties/rank.py)
    configure_rank()
    die_with_parent()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    state = Path(args.state)
    (state / f"party-{rank}.pid").write_text(str(os.getpid()))
    report_verdicts_to(state / f"verdict-{rank}.txt")
    if rank != 0:  # the leader decides when the service ends (module docstring)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        model, service, aggregator, channels = _join(comm, rank, args)
    except Exception as err:
        line = f"[party {rank}] cannot load its block, rows or channel key: {err}"
        if not isinstance(err, OSError | ValueError):  # not a missing or damaged file: keep the traceback
            write_verdict(line)
            print(line, file=sys.stderr, flush=True)
            raise
        end_job(comm, line, EXIT_CODES["failed"])  # a file the user must fix: one line
        return
    try:
        _run(comm, rank, model, service, aggregator, channels, args)
    except ProtocolViolation as err:
        end_job(comm, f"[party {rank}] {err}", EXIT_CODES["failed"])
    aggregator.close()
    service.Free()
    exit_now()


def _join(comm, rank: int, args: argparse.Namespace):
    """This party's model, the service communicator, the aggregator and the sealed links (None in
    clear; collective). The sums have no deadlines of their own: the leader gives each round
    ``--peer-timeout`` seconds and names a silent party from its acknowledgements
    (:mod:`parties.serving.federation`)."""
    from parties.checkpoint import complete_epochs
    from parties.resume import load_run
    from parties.serving.sealing import open_session
    from parties.serving.store import load_model
    from protocols.secure_aggregation import SecureAggregator

    config = load_run(Path(args.run))
    epochs = np.zeros(1)
    if rank == 0:
        epochs[0] = complete_epochs(Path(args.run))
    comm.Bcast(epochs, root=0)
    model = load_model(config, rank, float(epochs[0]))
    keys = config.sealing_keys(rank)
    channels = open_session(comm, keys)
    service = comm.Dup()
    aggregator = SecureAggregator.over_mpi(comm, seed=config.seed, allow_leaky_q2=config.allow_two_parties,
                                           max_batch=model.round_values(args.max_batch),
                                           channels=None if channels is None else channels.passes)
    return model, service, aggregator, channels


def _run(comm, rank: int, model, service, aggregator, channels, args: argparse.Namespace) -> None:
    from parties.serving.federation import Federation, serve_passive

    requests = None if channels is None else channels.requests
    if rank != 0:
        serve_passive(service, aggregator, model, max_batch=args.max_batch, channels=requests)
        return
    import asyncio

    from parties.serving.leader import serve_http

    federation = Federation(service, aggregator, model, peer_timeout=args.peer_timeout, channels=requests)
    asyncio.run(serve_http(comm, federation, args))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="one party of `vfl serve` (run under mpiexec)")
    parser.add_argument("--run", required=True)
    parser.add_argument("--state", required=True, help="folder for the pid and verdict files")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--window-ms", type=float, default=1.0)
    parser.add_argument("--max-batch", type=int, default=1024)
    parser.add_argument("--peer-timeout", type=float, default=10.0)
    return parser


if __name__ == "__main__":
    main()
