"""The entry point of one rank under ``mpiexec`` (``python -m mpi4py -m parties.rank --config …``).

It is the only place of a VFB² job that touches ``MPI.COMM_WORLD``: it loads this rank's own data and
hands the world communicator to :func:`parties.training.train`. ``python -m mpi4py`` turns an uncaught
exception in any rank into an abort of the whole job instead of a hang.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parties.plan import JobPlan


def run_party(config: JobPlan) -> None:
    """Load this rank's block and train it with the other ranks."""
    from mpi4py import MPI

    from parties.lifecycle import report_verdicts_to, write_verdict
    from parties.loading import load_party
    from parties.orphans import die_with_parent
    from parties.plan import leader_view
    from parties.runtime import name_os_thread
    from parties.threads import configure_rank
    from protocols.masking import PrecisionWarning

    # A score z = Σ w_l·x_l near 0 (w starts at 0) may hold partial products below the ring's resolution
    # 2**-32; they encode as 0, an absolute error of at most q·2**-33 in z, which ϑ(z) cannot notice.
    # The library call keeps the warning (a user summing tiny values of their own needs it); a
    # training job's output does not.
    warnings.filterwarnings("ignore", category=PrecisionWarning)
    configure_rank()  # the pools' threads: this host's share (parties/threads.py)
    die_with_parent()  # no orphan rank if its proxy is killed (parties/orphans.py)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    name_os_thread(f"p{rank}-main")
    if size != config.parties:
        raise SystemExit(f"config says {config.parties} parties but mpiexec started {size} ranks")
    config = leader_view(config, rank)  # the leader adds what only it may read (f* under label privacy)
    Path(config.out).mkdir(parents=True, exist_ok=True)
    (Path(config.out) / f"party-{rank}.pid").write_text(str(os.getpid()))
    report_verdicts_to(Path(config.out) / f"verdict-{rank}.txt")
    try:
        party = load_party(config, rank)
    except Exception as err:
        write_verdict(line := f"[party {rank}] cannot load its data: {err}")
        print(line, file=sys.stderr, flush=True)
        raise
    train_guarded(comm, party, config, rank)


def train_guarded(comm, party, config: JobPlan, rank: int, *, abort_on_error: bool = False):
    """:func:`parties.training.train`, ending the whole job with one line naming this party when it
    fails; returns its result. An unexpected error is re-raised (``python -m mpi4py`` aborts the
    world), or with ``abort_on_error`` aborts ``comm`` itself after the traceback: a communicator joined
    from separately started parties (:mod:`parties.federation`) spans several worlds."""
    import traceback

    from parties.lifecycle import end_job, write_verdict
    from parties.outcomes import EXIT_CODES
    from parties.runtime import OUT_OF_RANGE, stop_job
    from parties.training import MisalignedError, train
    from protocols.errors import ProtocolViolation
    from protocols.liveness import PeerTimeout
    from protocols.masking import AggregationOverflowError

    try:
        return train(comm, party, config)
    except AggregationOverflowError:
        stop_job(comm, rank, "diverged", OUT_OF_RANGE)
    except MisalignedError as err:
        stop_job(comm, rank, "usage", str(err))
    except PeerTimeout as err:  # a peer did not deliver its part of a barrier-time exchange in time
        stop_job(comm, rank, "failed", str(err))
    except ProtocolViolation as err:  # the sender's fault (the main thread's full passes): name it
        end_job(comm, f"[party {rank}] {err}", EXIT_CODES["failed"])
    except Exception as err:  # python -m mpi4py then aborts the whole job
        write_verdict(line := f"[party {rank}] fatal error: {err!r}")
        print(line, file=sys.stderr, flush=True)
        if not abort_on_error:
            raise
        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(EXIT_CODES["failed"])
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one VFB² party (run under mpiexec by `vfl train`)")
    parser.add_argument("--config", required=True, help="config.json, the job plan written by `vfl train`")
    args = parser.parse_args(argv)
    text = Path(args.config).read_text()
    start_he_key_early(text)
    from parties.plan import JobPlan  # after the key process's start: the import takes ~0.3 s

    run_party(JobPlan.from_json(text))


def start_he_key_early(plan_text: str) -> bool:
    """A rank that will dominate under ``--label-privacy he`` starts its key process before anything
    else, so that the key is generated while it imports, loads and joins (protocols/label_he_key_spawn.py
    says why); the plan is read raw, its checks left to :class:`~parties.plan.JobPlan`. Whether a process
    was started."""
    from mpi4py import MPI

    from protocols.label_he_key_spawn import start_early

    try:
        plan = json.loads(plan_text)
        he, scheme, bits = plan["label_privacy"] == "he", plan["he_scheme"], plan["he_key_bits"]
        dominates = MPI.COMM_WORLD.Get_rank() < plan["active"]
    except (ValueError, KeyError, TypeError):
        return False  # JobPlan.from_json says what is wrong
    if not (he and dominates and isinstance(scheme, str) and isinstance(bits, int)):
        return False
    return start_early(scheme, bits)


def exit_now() -> None:
    """End this rank at once after a job that finished (:func:`parties.lifecycle.exit_now`)."""
    from parties.lifecycle import exit_now as finalize_and_exit

    finalize_and_exit()


if __name__ == "__main__":
    main()
    exit_now()
