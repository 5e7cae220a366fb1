"""``vfl party JOB --as NAME … --serve``: this organisation's party of a served federation (issue 29).

Each organisation serves the run it trained with ``vfl party``, from its own folder, with the same job
file, key and data, and no other organisation's files. One *federation* is one join (the authenticated
hello and MPI join of training, :mod:`parties.federation.join`) and the rounds served on it, in a
process of its own (:mod:`parties.serving.federated`). MPI cannot repair a communicator that lost a
process, so when a party leaves, the federation ends everywhere and a new one is formed once every
party is back: a passive party joins again in a loop (each attempt's line printed, backing off); the
leader keeps its HTTP endpoint up across federations (:mod:`parties.serving.supervisor`), answering 503
naming the missing party in between. The checks here run before any of that, each refused in one line.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from parties.config import ConfigError
from parties.serving.options import DEFAULTS

#: the federation process's exit codes (besides 0: the leader stopped the service; 2: a usage error)
JOIN_FAILED, FEDERATION_ENDED, PROTOCOL_BROKEN = 1, 75, 65
#: a passive party's wait before joining again: after a federation that served, then after each
#: failed join, doubling up to the cap
REJOIN_AFTER_END_S, REJOIN_FIRST_S, REJOIN_CAP_S = 0.5, 1.0, 30.0


@dataclass(frozen=True)
class Serving:
    """What one party serves: its job, rank and key, the epoch of its block, the leader's endpoint."""

    job: object
    rank: int
    private: bytes
    epochs: float
    http: tuple[str, int] | None
    window_ms: float
    max_batch: int
    peer_timeout: float


def checked_serving(args: argparse.Namespace) -> Serving:
    """Every local check of a serving party; ConfigError (one line) otherwise."""
    from parties.federation.command import read_private_key
    from parties.federation.jobfile import load_job, split_address
    from parties.serving.launch import check_options, check_sum_width

    job = load_job(args.job)
    rank = job.rank_of(args.name)
    given = {n: getattr(args, n, None) for n in ("http", *DEFAULTS)}  # absent when not given
    private = read_private_key(args.key, job, rank)
    flags = [f for f, on in (("--resume", args.resume), ("--overwrite", args.overwrite),
                             ("--audit", args.audit)) if on]
    if job.kind == "hfl":
        raise ConfigError("--serve is for vertical jobs: a horizontal job's model is the server's alone")
    if flags:
        raise ConfigError(f"{flags[0]} is for training: --serve reads the run in --folder, changes nothing")
    if not args.join_timeout > 0:
        raise ConfigError(f"--join-timeout must be positive (got {args.join_timeout:g})")
    if (args.listen is not None or given["http"] is not None) and rank != 0:
        flag = "--listen" if args.listen is not None else "--http"
        raise ConfigError(f"{flag} is for the leader ({job.leader.name}) only: the other parties connect out")
    if rank == 0 and given["http"] is None:
        raise ConfigError(f"--serve: the leader {job.leader.name} needs --http HOST:PORT for its endpoint")
    http = split_address(given["http"], "--http") if given["http"] is not None else None
    if args.listen is not None:
        split_address(args.listen, "--listen")
    values = {n: given[n] if given[n] is not None else d for n, d in DEFAULTS.items()}
    try:
        check_options(http[1] if http else 0, values["window_ms"], values["max_batch"],
                      values["peer_timeout"])
        check_sum_width(job.options, values["max_batch"])  # a network job's (k+1) values a row
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if not Path(args.data).exists():
        raise ConfigError(f"--data {args.data}: no such file or folder")
    epochs = trained_epochs(Path(args.folder), job, rank)
    return Serving(job, rank, private, epochs, http, **values)


def trained_epochs(folder: Path, job, rank: int) -> float:
    """The epoch every party completed, from this party's folder of the same job (one line if not)."""
    from parties.export_source import party_epochs
    from parties.federation.command import PARTY_RECORD, _model_part, _read_record
    from parties.federation.jobfile import first_difference

    record = _read_record(folder)
    name = job.parties[rank].name
    if record is None:
        raise ConfigError(f"--serve: {folder} holds no run of {name} ({PARTY_RECORD} is missing): train with "
                          "`vfl party` first, then serve from the same --folder")
    if record.get("name") != name:
        raise ConfigError(f"--serve: {folder} holds a run of another party, not of {name}")
    found = first_difference(_model_part(job.canonical()), _model_part(record.get("job")))
    if found is not None:
        raise ConfigError(f"--serve: {folder} was trained on another job: {found[0]} is {found[2]} there, "
                          f"{found[1]} in {job.where}")
    try:
        return party_epochs(folder, rank)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--serve: {err}") from None


def federation_argv(args: argparse.Namespace, serving: Serving) -> list[str]:
    """The arguments of one federation's process (:mod:`parties.serving.federated`)."""
    argv = [str(args.job), "--as", args.name, "--key", str(args.key), "--data", str(args.data),
            "--folder", str(args.folder), "--join-timeout", str(args.join_timeout), "--serve",
            "--max-batch", str(serving.max_batch), "--peer-timeout", str(serving.peer_timeout)]
    if args.listen is not None:
        argv += ["--listen", args.listen]
    if serving.http is not None:
        argv += ["--http", f"{serving.http[0]}:{serving.http[1]}"]
    return argv


def mpi_env() -> dict[str, str]:
    """MPICH's OFI netmod over TCP unless the environment names a netmod (as ``vfl party``)."""
    from parties.netns import TCP_TRANSPORT

    return {} if "MPIR_CVAR_CH4_NETMOD" in os.environ else dict(TCP_TRANSPORT)


def serving_plan(serving: Serving, args: argparse.Namespace):
    """This party's plan to load its block and rows, as training's (:func:`party_plan`) but resumed:
    its ``--standardize`` statistics and ``--label-privacy dp`` draw are read back from the folder,
    never drawn again (which would overwrite the run's own, and so change what a ``--resume`` reads)."""
    from parties.federation.member import party_plan

    return party_plan(serving.job, serving.rank, argparse.Namespace(**{**vars(args), "resume": True}))
