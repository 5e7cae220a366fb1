"""``vfl party JOB --as NAME --key FILE --data PATH --folder DIR``: start this organisation's party only.

The command checks what it can alone (the job file, that the key is the one pinned for NAME, the data
path, the folder), then runs the party under its own ``mpiexec -n 1`` (Hydra on this host only: it
starts nothing anywhere else) as ``python -m mpi4py -m parties.federation.member`` with the same
arguments, on MPICH's OFI netmod over TCP unless the environment names a netmod. The party's own
output passes through; a failure ends in one line naming the party (the join's lines come from the
member itself, :mod:`parties.federation.join`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from parties.config import ConfigError, budget_options
from parties.federation.jobfile import Job, first_difference, job_key, load_job, split_address

#: This party's record of its run, in its folder: the job it joined, its name and rank.
PARTY_RECORD = "party.json"
#: What a run leaves in a party's folder (``--overwrite`` removes these, and nothing else).
RUN_FILES = ("party.json", "party-*.ckpt.npz", "party-*.prev.ckpt.npz", "party-*.ckpt.npz.tmp",
             "checkpoint.json", "metrics.jsonl", "result.json", "verdict-*.txt", "audit-*.npz",
             "label-dp-*.npz", "metrics.csv", "model.npz")
DEFAULT_JOIN_TIMEOUT = 120.0


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("job", help="the job file every party agreed on (TOML: [job] options, one [[party]] "
                               "table per party; docs/deployment.md)")
    p.add_argument("--as", dest="name", required=True, metavar="NAME",
                   help="this party's name in the job file")
    p.add_argument("--key", required=True, metavar="FILE",
                   help="this party's private key (`vfl keygen`); its public half is pinned in the job file")
    p.add_argument("--data", required=True, metavar="PATH",
                   help="this party's own data: its party-<p>/ folder or party-<p>.npz from `vfl split`; "
                        "in a horizontal job, a client's clients-<p>.npz and the server's test.npz from "
                        "`python -m parties.hfl split`")
    p.add_argument("--folder", required=True, metavar="DIR",
                   help="this party's own folder: its block, checkpoints, audit, log (the leader's: the "
                        "metrics too)")
    p.add_argument("--join-timeout", type=float, default=DEFAULT_JOIN_TIMEOUT, metavar="SECONDS",
                   help="a party that has not joined by then ends the join for everyone, named")
    p.add_argument("--listen", default=None, metavar="HOST:PORT",
                   help="the leader only: where its hello listens, when that is not its address in the job "
                        "file (e.g. 0.0.0.0:7700 behind NAT)")
    p.add_argument("--resume", action="store_true",
                   help="continue this party's run in --folder (every party must pass it)")
    p.add_argument("--overwrite", action="store_true", help="reuse a --folder that holds an earlier run")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar (leader)")
    p.add_argument("--audit", action="store_true",
                   help="record every message this party receives to audit-<rank>.npz in --folder")
    from parties.serving.options import add_arguments as serving_options

    serving_options(p)
    return p


# ------------------------------------------------------------------------------------ the checks


def checked(args: argparse.Namespace) -> tuple[Job, int, bytes]:
    """The job, this party's rank and private key, with every local check done; ConfigError otherwise."""
    from parties.serving.options import refuse_without_serve

    refuse_without_serve(args)  # --serve's own checks: parties.serving.organisation.checked_serving
    job = load_job(args.job)
    rank = job.rank_of(args.name)
    private = read_private_key(args.key, job, rank)
    if job.kind == "hfl" and (args.resume or args.audit):
        flag = "--resume" if args.resume else "--audit"
        raise ConfigError(f"{flag} is for vertical jobs: a horizontal job keeps no checkpoints and records "
                          "no audit (start it again)")
    if not args.join_timeout > 0:
        raise ConfigError(f"--join-timeout must be positive (got {args.join_timeout:g})")
    if args.listen is not None:
        if rank != 0:
            raise ConfigError(f"--listen is for the leader ({job.leader.name}) only: the other parties "
                              "connect out to it")
        split_address(args.listen, "--listen")
    if not Path(args.data).exists():
        raise ConfigError(f"--data {args.data}: no such file or folder")
    check_folder(Path(args.folder), job, rank, resume=args.resume, overwrite=args.overwrite)
    return job, rank, private


def read_private_key(path: str, job: Job, rank: int) -> bytes:
    """The raw 32-byte X25519 key of ``vfl keygen``, refused unless its public half is the one the job
    file pins for this party."""
    from protocols.channels import public_key

    name = job.parties[rank].name
    try:
        with open(path, "rb") as fh:
            private = fh.read(65)
    except OSError as err:
        raise ConfigError(f"--key {path}: cannot read it ({err.strerror})") from None
    if len(private) != 32:
        raise ConfigError(f"--key {path}: not a private key of `vfl keygen` (32 raw bytes)")
    public = public_key(private)
    if public != job.parties[rank].public_key:
        raise ConfigError(f"--key {path} is not {name}'s key: its public half is {public.hex()[:16]}..., the "
                          f"job file pins {job.parties[rank].public_key.hex()[:16]}... for {name}")
    return private


def check_folder(folder: Path, job: Job, rank: int, *, resume: bool, overwrite: bool) -> None:
    """A fresh run needs a folder without an earlier run (or ``--overwrite``); ``--resume`` needs this
    party's earlier run of the same job there (only the budget options may change)."""
    record = _read_record(folder)
    name = job.parties[rank].name
    if resume:
        if record is None:
            raise ConfigError(f"--resume: {folder} holds no run of {name} ({PARTY_RECORD} is missing)")
        if record.get("name") != name:
            raise ConfigError(f"--resume: {folder} holds a run of {_text(record.get('name'))}, not {name}")
        found = first_difference(_model_part(job.canonical()), _model_part(record.get("job")))
        if found is not None:
            raise ConfigError(f"--resume keeps the run's job: {found[0]} is {found[2]} in "
                              f"{folder / PARTY_RECORD}, {found[1]} in {job.where} (only "
                              f"{', '.join(_budget_keys())} may change)")
        return
    held = record is not None or any(folder.glob("party-*.ckpt.npz"))
    if held and not overwrite:
        raise ConfigError(f"--folder {folder} holds an earlier run: pass --resume to continue it, "
                          "--overwrite to replace it, or another --folder")


def clear_folder(folder: Path, *, resume: bool) -> None:
    """Make the party's folder; remove what an earlier run left there (a fresh run), or only its
    verdict files (a resumed one). Nothing but :data:`RUN_FILES` is touched."""
    folder.mkdir(parents=True, exist_ok=True)
    patterns = ("verdict-*.txt",) if resume else RUN_FILES
    for pattern in patterns:
        for path in folder.glob(pattern):
            if path.is_file() or path.is_symlink():
                path.unlink()


def write_record(folder: Path, job: Job, rank: int, job_id: bytes) -> None:
    from parties.checkpoint import atomic_write

    text = json.dumps({"name": job.parties[rank].name, "rank": rank, "job_id": job_id.hex(),
                       "job": job.canonical()}, indent=1).encode()
    atomic_write(folder / PARTY_RECORD, lambda fh: fh.write(text))


def _read_record(folder: Path) -> dict[str, Any] | None:
    path = folder / PARTY_RECORD
    if not path.exists():
        return None
    try:
        with open(path, "rb") as fh:
            record = json.loads(fh.read(1 << 20))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path} is damaged ({err}); pass --overwrite to start a new run there") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{path} is damaged; pass --overwrite to start a new run there")
    return record


def _budget_keys() -> list[str]:
    from parties.federation.jobfile import JOB_OPTIONS

    return [job_key(n) for n in JOB_OPTIONS if n in budget_options()]


def _model_part(canonical: Any) -> Any:
    """A canonical job without the budget options (what a resumed run may change)."""
    if not isinstance(canonical, dict) or not isinstance(canonical.get("job"), dict):
        return canonical
    budget = set(_budget_keys())
    return {**canonical, "job": {k: v for k, v in canonical["job"].items() if k not in budget}}


def _text(value: Any) -> str:
    return json.dumps(value)[:60]


# ------------------------------------------------------------------------------------ the command


def run_command(args: argparse.Namespace, argv: list[str]) -> int:
    """``vfl party``: the checks, then this party under its own ``mpiexec -n 1``; exits with its code.

    Once the party has run, this process leaves at once (``os._exit``): the checks imported the
    training stack (numba, scipy), whose teardown kept the command alive 5-10 s after the run on a
    loaded machine, and nothing of this process is left to flush but its two streams."""
    from parties.netns import TCP_TRANSPORT

    checked(args)
    env = {} if "MPIR_CVAR_CH4_NETMOD" in os.environ else dict(TCP_TRANSPORT)
    code = _exit_code(args, *_run(argv, env, args))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(argv: list[str], env: dict[str, str], args: argparse.Namespace) -> tuple[int | None, str]:
    try:
        return run_member(argv, env)
    except KeyboardInterrupt:
        print(f"vfl party {args.name}: interrupted; this party's checkpoints are in {args.folder} "
              "(--resume continues from the newest epoch every party completed)", file=sys.stderr)
        return None, ""


def _exit_code(args: argparse.Namespace, code: int | None, errors: str) -> int:
    """The member's outcome as ``vfl train``'s exit codes, with a line when it left none."""
    from parties.outcomes import EXIT_CODES, find_stop

    if code is None:
        return EXIT_CODES["interrupted"]
    if code == 0:
        return 0
    stopped = find_stop(errors)
    if stopped is not None:
        return EXIT_CODES[stopped[0]]
    if f"vfl party {args.name}:" not in errors and "[party " not in errors:
        print(f"vfl party {args.name}: the job ended (exit code {code}) without a word from this party: "
              "another party ended it (its log says why), or this process was killed; this party's "
              f"checkpoints are in {args.folder}", file=sys.stderr)
    return code if code in EXIT_CODES.values() else EXIT_CODES["failed"]


def run_member(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    """``mpiexec -n 1 python -m mpi4py -m parties.federation.member argv``, tied to this process (no
    orphan if it is killed, :mod:`parties.orphans`): its standard output passes through, its standard
    error too and the last 64 KiB of it come back with the exit code (for the stop line of
    :func:`parties.outcomes.find_stop`). On Ctrl-C the party is stopped (SIGINT, then SIGKILL after
    10 s) and KeyboardInterrupt propagates."""
    from parties.launch import run_mpi_module

    return run_mpi_module(1, "parties.federation.member", argv, extra_env=env, keep="stderr")
