"""One federation of a served ``vfl party`` organisation, in its own MPI world (``mpiexec -n 1 python -m
mpi4py -m parties.serving.federated``, started by :mod:`parties.serving.organisation` at a passive
party and by :mod:`parties.serving.supervisor` at the leader).

In order: the checks and this party's own block and rows (before anyone waits on it), the join of
training (hello with the keys of the job file, then the MPI join, :mod:`parties.federation.join`), the
leader's word that it serves (a training party that joined a serving leader ends at that word, and a
serving party that joined a training leader ends without it), the run line that names a party whose
process ends (:mod:`parties.federation.runline`), a fresh sealed session for a ``secure_channels`` job
(the job id the leader drew for this join, and fresh bytes from every party), then the rounds of
:mod:`parties.serving.federation` until the leader says STOP.

This process ends with the federation: MPI cannot repair a communicator that lost a process, and
MPICH's OFI/tcp netmod can block for good in a send to a process that is gone. Its exit code says what
comes next (:data:`parties.serving.organisation.FEDERATION_ENDED`: join again). The leader's process
gives its scores and its last line to the front over the local link (:mod:`parties.serving.link`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import threading
from typing import Any

import numpy as np

from parties.serving import link as wire_link
from parties.serving.organisation import FEDERATION_ENDED, JOIN_FAILED, PROTOCOL_BROKEN

#: what the leader says on every hello session once the join is done: this federation serves
SERVE_STATUS = "serve"


def main(argv: list[str] | None = None) -> None:
    import warnings

    from parties.config import ConfigError
    from parties.federation.command import add_arguments
    from parties.federation.join import end_now
    from parties.orphans import die_with_parent
    from parties.serving.organisation import checked_serving, serving_plan
    from parties.serving.store import load_model
    from parties.threads import configure_rank
    from protocols.masking import PrecisionWarning

    parser = add_arguments(argparse.ArgumentParser(prog="vfl party --serve (one federation)"))
    parser.add_argument("--link", default=None, help="the leader only: its front's local socket")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=PrecisionWarning)  # as in training (parties/rank.py)
    configure_rank()
    die_with_parent()
    try:
        serving = checked_serving(args)
        plan = serving_plan(serving, args)
        model = load_model(plan, serving.rank, serving.epochs)
    except (ConfigError, ValueError, OSError) as err:
        end_now(f"vfl party {args.name}: error: cannot serve this party's block and rows: {err}", 2)
        return
    link = wire_link.ProcessEnd(args.link, serving.max_batch) if serving.rank == 0 else None
    Federated(args, serving, plan, model, link).run()


class Federated:
    """This party in one federation: joins, serves, and ends (every ending through :meth:`end`)."""

    def __init__(self, args: argparse.Namespace, serving, plan, model, link) -> None:
        self.args, self.serving, self.plan, self.model, self.link = args, serving, plan, model, link
        self.names = [p.name for p in serving.job.parties]
        self.rank = serving.rank
        self.sessions: list = []  # the leader's hello sessions, once joined

    def say(self, line: str) -> None:
        print(f"vfl party {self.args.name}: {line}", flush=True)

    def end(self, line: str, code: int = FEDERATION_ENDED, kind: int = wire_link.DOWN) -> None:
        """Give the front the line (the leader), print it, and leave at once: an MPI call may be stuck
        on a process that is gone."""
        from parties.federation.hello import FrameError
        from parties.federation.join import end_now

        if self.link is not None:
            self.link.tell(kind, line)
        for session in self.sessions:  # the leader: every party hears why (the run line's "abort")
            with contextlib.suppress(FrameError, OSError):
                session.send({"status": "abort", "reason": line})
        end_now(f"vfl party {self.args.name}: {line}", code)

    def who(self, rank: int) -> str:
        return f"{self.names[rank]} (party {rank})"

    def run(self) -> None:
        from parties.federation.runline import LeaderLine, PartyLine
        from parties.lifecycle import exit_now

        joined = self.join()

        def ended(line: str) -> None:  # the run line's words, for a federation
            self.end(line.replace("the run ended: ", "the federation ended: ", 1))

        if self.rank == 0:
            line: Any = LeaderLine(joined.sessions, {n: r for r, n in enumerate(self.names)}, ended)
        else:
            line = PartyLine(joined.sessions[0], ended)
        comm = joined.comm
        service, aggregator, channels = self.open(comm, joined.job_id)
        sealed = ", sealed channels" if channels is not None else ""
        self.say(f"serving: federation formed, {len(self.names)} parties{sealed}")
        if self.rank == 0:
            self.lead_rounds(service, aggregator, channels)
        else:
            self.follow_rounds(service, aggregator, channels)
        comm.Barrier()
        line.finish()
        self.say("serving: the leader stopped the service")
        exit_now()

    def join(self):
        """The join of training, then the leader's word that this federation serves."""
        from parties.federation.hello import HANDSHAKE_SECONDS, FrameError, HelloRefused, field
        from parties.federation.jobfile import split_address
        from parties.federation.join import follow, lead
        from parties.federation.leader import JoinFailed

        job, private, timeout = self.serving.job, self.serving.private, self.args.join_timeout

        def failed(line: str) -> None:
            self.end(line, JOIN_FAILED)

        try:
            if self.rank == 0:
                bind = split_address(self.args.listen or job.leader.address)
                self.say(f"serving: the hello listens on {bind[0]}:{bind[1]}; waiting for every party")
                joined = lead(job, private, bind, resume=False, timeout=timeout, log=self.say, fail=failed)
                self.sessions = joined.sessions
                for session in joined.sessions:
                    session.send({"status": SERVE_STATUS})
                return joined
            self.say(f"serving: joining the leader {job.leader.name} at {job.leader.address}")
            joined = follow(job, self.rank, private, resume=False, timeout=timeout, log=self.say, fail=failed)
            said = field(joined.sessions[0].recv(HANDSHAKE_SECONDS), "status", str)
        except (HelloRefused, JoinFailed, FrameError) as err:
            failed(f"the join ended: {err}")
            raise AssertionError("not reached") from err
        if said != SERVE_STATUS:
            failed(f"the leader {job.leader.name} does not serve this job (is it training it?)")
        return joined

    def open(self, comm, job_id: bytes):
        """The service's communicator, the secure aggregation, and the sealed links of a fresh session
        (None in clear); collective."""
        from parties.serving.sealing import open_session
        from protocols.secure_aggregation import SecureAggregator

        keys = dataclasses.replace(self.plan, job_id=job_id.hex()).sealing_keys(self.rank)
        channels = open_session(comm, keys)
        service = comm.Dup()
        aggregator = SecureAggregator.over_mpi(comm, seed=self.plan.seed,
                                               allow_leaky_q2=self.plan.allow_two_parties,
                                               max_batch=self.model.round_values(self.serving.max_batch),
                                               channels=None if channels is None else channels.passes)
        return service, aggregator, channels

    def follow_rounds(self, service, aggregator, channels) -> None:
        from parties.serving.federation import serve_passive
        from protocols.errors import ProtocolViolation

        try:
            serve_passive(service, aggregator, self.model, max_batch=self.serving.max_batch,
                          channels=None if channels is None else channels.requests)
        except ProtocolViolation as err:
            self.end(f"[party {self.rank}] {err} (the leader {self.names[0]}): this party serves no more",
                     PROTOCOL_BROKEN)

    def lead_rounds(self, service, aggregator, channels) -> None:
        """The front's requests, one round each, until its STOP (or its link closes)."""
        from parties.serving.federation import Federation

        federation = Federation(service, aggregator, self.model, peer_timeout=self.serving.peer_timeout,
                                channels=None if channels is None else channels.requests)
        self.link.send(wire_link.ready_frame(self.model.classes))
        while True:
            try:
                kind, payload = self.link.receive()
            except (wire_link.LinkError, OSError):
                kind = wire_link.STOP  # the front is gone: end the service cleanly for every party
            if kind == wire_link.STOP:
                federation.stop()
                return
            if kind != wire_link.SCORE:
                self.end(f"the front sent a frame of kind {kind} where a request belongs", PROTOCOL_BROKEN)
            scores = self.timed_round(federation, wire_link.ids_of(payload, self.serving.max_batch))
            if scores.probabilities is not None:  # a network of more than two classes
                self.link.send(wire_link.classes_frame(scores.probabilities, scores.held))
            else:
                self.link.send(wire_link.scores_frame(scores.z, scores.held))

    def timed_round(self, federation, ids: np.ndarray):
        """One round within ``--peer-timeout``: past it, the party that did not acknowledge the request
        is named and the federation ends; a party that breaks the protocol is named and excluded."""
        from protocols.errors import ProtocolViolation

        seconds = self.serving.peer_timeout

        def silent() -> None:
            late = federation.unacknowledged()
            self.end(f"{self.who(late[0])} did not answer within {seconds:g} s" if late else
                     f"the secure sum did not complete within {seconds:g} s (every party had acknowledged "
                     "the request)")

        timer = threading.Timer(seconds, silent)
        timer.daemon = True
        timer.start()
        try:
            scores = federation.score(ids)
        except ProtocolViolation as err:
            self.end(f"{self.who(err.sender)} broke the protocol ({err}): it is excluded until the "
                     "leader's service is restarted", PROTOCOL_BROKEN, wire_link.EXCLUDED)
            raise AssertionError("not reached") from err
        finally:
            timer.cancel()
        return scores


if __name__ == "__main__":
    main()
