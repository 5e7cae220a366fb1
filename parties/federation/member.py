"""One party of a federated job, in its own MPI world (``vfl party`` runs it under ``mpiexec -n 1``).

In order: the local checks (:func:`parties.federation.command.checked`), this party's own data (loaded
before anyone waits on it), the join (:mod:`parties.federation.join`), then the same training as
``vfl train`` (:func:`parties.rank.train_guarded` on the joined communicator) with this party's plan:
its data, its folder as the run folder (its block, checkpoints, audit, label-DP draw and verdict file;
the leader's metrics, manifest and result), the channel keys pinned in the job file and the job id
the leader drew for this run. Nothing is read from or written to any other party's folder: there is
no shared ``config.json`` (each party builds its plan from the job file) and no pid file.

At the end the leader sends every party the run's summary (a bounded JSON buffer, checked where it is
received): the outcome, epochs and updates, and the leader's metrics unless a label-privacy mode is
on (a loss or accuracy is computed from the labels, which those modes keep from passive parties).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from parties.config import ConfigError
from parties.federation.command import add_arguments, checked, clear_folder, write_record
from parties.federation.jobfile import Job
from parties.federation.join import end_now
from parties.federation.joined_run import broadcast_bytes, join_and_hold
from parties.plan import JobPlan, check_he_batch, check_he_features, noise_multiplier

#: Largest run summary a party accepts from the leader.
SUMMARY_BYTES = 4096
_METRICS = ("loss", "suboptimality", "test_accuracy", "test_rmse")
_OUTCOMES = ("budget", "target", "diverged")


def party_plan(job: Job, rank: int, args: argparse.Namespace) -> JobPlan:
    """This party's plan: the job's options with its own data, folder and command-line choices."""
    options = dataclasses.replace(job.options, party_files=str(args.data), out=str(args.folder),
                                  resume=args.resume, overwrite=args.overwrite, progress=args.progress,
                                  audit=args.audit)
    sealed = options.secure_channels
    return JobPlan(options, out=str(args.folder), party_files=str(args.data), dataset=Path(args.data).name,
                   f_star=options.f_star,
                   channel_public_keys=tuple(k.hex() for k in job.public_keys()) if sealed else None,
                   channel_key_file=str(Path(args.key).resolve()) if sealed else None)


def with_own_data(plan: JobPlan, party: Any, rank: int) -> JobPlan:
    """What ``vfl train`` checks against all the data, checked here against this party's own block
    (each passive party checks its own; together that is the same check), and the DP noise, derived
    from the rows every party holds (the same n at all: the join checks the ids line up)."""
    if rank >= plan.active and plan.label_privacy == "he":
        check_he_batch(plan.options, party.block.n_cols, party.block.n_rows)
        check_he_features(plan.options, [party.block.to_csr()])
    return dataclasses.replace(plan, noise_multiplier=noise_multiplier(plan.options, party.block.n_rows))


def run(args: argparse.Namespace) -> None:
    from parties.lifecycle import report_verdicts_to
    from parties.loading import load_party
    from parties.orphans import die_with_parent
    from parties.rank import train_guarded
    from parties.runtime import name_os_thread
    from protocols.label_he_key_spawn import start_early

    die_with_parent()  # no orphan party if its proxy is killed (parties/orphans.py)
    name = args.name

    def say(line: str) -> None:
        print(f"vfl party {name}: {line}", flush=True)

    try:
        job, rank, private = checked(args)
        if job.kind == "hfl":
            from parties.federation.hfl_member import run_hfl

            run_hfl(args, job, rank, private, say)
            return
        folder = Path(args.folder)
        clear_folder(folder, resume=args.resume)
        plan = party_plan(job, rank, args)
        if plan.label_privacy == "he" and rank < plan.active:  # the key made while it loads and joins
            start_early(plan.he_scheme, plan.he_key_bits)
        party = load_party(plan, rank)
        plan = with_own_data(plan, party, rank)
    except (ConfigError, ValueError, OSError) as err:
        end_now(f"vfl party {name}: error: {err}", 2)
        return
    name_os_thread(f"p{rank}-main")
    report_verdicts_to(folder / f"verdict-{rank}.txt")
    q = job.options.parties
    legend = ", ".join(f"{r} {p.name}" for r, p in enumerate(job.parties))
    say(f"party {rank} of {q} ({legend}); {party.block.n_rows} rows, {party.block.n_cols} features")
    ended = (f"this party's checkpoints are in {folder} (--resume continues from the newest epoch every "
             "party completed)")
    joined, line = join_and_hold(job, rank, private, args, say, ended)
    comm = joined.comm
    write_record(folder, job, rank, joined.job_id)
    plan = dataclasses.replace(plan, job_id=joined.job_id.hex())
    result = train_guarded(comm, party, plan, rank, abort_on_error=True)
    share_summary(comm, rank, job, plan, result, say)
    comm.Barrier()
    line.finish()


def share_summary(comm: Any, rank: int, job: Job, plan: JobPlan, result: Any, say: Any) -> None:
    """The leader's summary of the run to every party (collective); each other party prints it and
    keeps it as ``result.json`` in its own folder."""
    data = b""
    if rank == 0:
        summary: dict[str, Any] = {"outcome": result.outcome.name.lower(), "epochs": result.epochs,
                                   "updates": result.updates, "train_time": result.train_time}
        if plan.label_privacy == "none" and result.record is not None:
            summary["record"] = {k: v for k, v in result.record.items() if k in _METRICS}
        data = json.dumps(summary).encode()[:SUMMARY_BYTES]
    received = broadcast_bytes(comm, rank, data, SUMMARY_BYTES, "run summary")
    if rank == 0:
        return
    summary = checked_summary(received)
    shown = ", ".join(f"{k} {v:.6g}" for k, v in summary.get("record", {}).items())
    metrics = f"; {shown} (the leader {job.leader.name}'s evaluation)" if shown else ""
    c = plan.options
    say(f"VFB²-{c.algorithm} ({c.mode}), q={c.parties}, m={c.active}: {summary['outcome']} after "
        f"{summary['epochs']:g} epochs, {summary['updates']} dominated updates in "
        f"{summary['train_time']:.2f} s of training{metrics}. This party's block: "
        f"{Path(plan.out) / f'party-{rank}.ckpt.npz'}")
    (Path(plan.out) / "result.json").write_text(json.dumps({**summary, "from": job.leader.name}) + "\n")


def checked_summary(data: bytes) -> dict[str, Any]:
    """The leader's summary as received: a JSON object of known fields, finite numbers only."""
    from protocols.errors import ProtocolViolation

    def bad(detail: str) -> ProtocolViolation:
        return ProtocolViolation(0, "run summary", detail)

    try:
        summary = json.loads(data.decode("utf-8"), parse_constant=lambda c: math.nan)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise bad("not JSON") from None
    if not isinstance(summary, dict) or summary.get("outcome") not in _OUTCOMES:
        raise bad("no known outcome")
    out: dict[str, Any] = {"outcome": summary["outcome"]}
    for key in ("epochs", "train_time"):
        value = summary.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
            raise bad(f"{key} is not a finite count")
        out[key] = float(value)
    updates = summary.get("updates")
    if isinstance(updates, bool) or not isinstance(updates, int) or updates < 0:
        raise bad("updates is not a count")
    out["updates"] = updates
    record = summary.get("record", {})
    numbers = isinstance(record, dict) and all(
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in record.values())
    if not numbers or set(record) - set(_METRICS):
        raise bad("its metrics are not finite numbers of known names")
    if record:
        out["record"] = {k: float(v) for k, v in record.items()}
    return out


def main(argv: list[str] | None = None) -> None:
    import warnings

    from protocols.masking import PrecisionWarning

    warnings.filterwarnings("ignore", category=PrecisionWarning)  # as parties.rank: not the user's concern
    run(add_arguments(argparse.ArgumentParser(prog="vfl party")).parse_args(argv))
    # Every file of the run is closed: leave without tearing the interpreter down module by module,
    # which took 5-25 s on a loaded machine (numba, scipy) after the run was over.
    from parties.lifecycle import exit_now

    exit_now()


if __name__ == "__main__":
    main()
