"""Where ``vfl export`` finds one party's trained part: a ``vfl train`` run folder or a ``vfl party`` one.

A run under one ``mpiexec`` has a ``config.json`` that says everything (the problem, the scaling, each
party's data and folder) and a ``checkpoint.json`` with the epoch every party completed. A party of the
per-organisation launch (``vfl party``) has neither: its folder holds ``party.json`` (the job it
joined, its name and rank), its own checkpoints and, at a passive party, ``result.json`` (the summary
the leader sent at the end of the run, with the final epoch). Its data lives wherever the organisation
keeps it, so the export is given it (``--data``, the ``vfl party --data`` it trained from). Both files
are read as untrusted input: bounded, every field checked, one line naming what is missing or wrong.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from parties.checkpoint import MANIFEST, checkpoint_path, complete_epochs, epochs_in
from parties.loading import own_party_file, scaling_file, scaling_path

#: the ``vfl party`` files read here (:mod:`parties.federation.command`, :mod:`parties.federation.member`)
PARTY_RECORD, RESULT = "party.json", "result.json"
#: a party record or result is a few KiB (the job file is at most 64 KiB): anything larger is damage
RECORD_MAX_BYTES = 1 << 20
STANDARDIZE = ("off", "on", "center")


@dataclass(frozen=True)
class PartySource:
    """What party ``rank``'s export reads: the model's shape, its own data file and folder, the epoch."""

    rank: int
    parties: int
    problem: str
    standardize: str
    active: bool
    data: Path
    folder: Path
    scaling: Path
    epochs: float
    #: the job's ``--model`` and, for ``mlp``, its ``--bottom``/``--top`` specs (every party's, as given)
    model: str = "linear"
    bottom: str | None = None
    top: str | None = None


def party_source(run: str | Path, rank: int, data: str | Path | None, problems) -> PartySource:
    """The source of ``rank``'s part in ``run``; ``problems`` are the problems that can be exported."""
    folder = Path(run)
    if (folder / "config.json").exists():
        return _from_run(folder, rank, data, problems)
    if (folder / PARTY_RECORD).exists():
        return _from_party_folder(folder, rank, data, problems)
    raise FileNotFoundError(f"{folder}: neither a `vfl train` run folder (no config.json) nor a `vfl party` "
                            f"folder (no {PARTY_RECORD})")


def _from_run(run: Path, rank: int, data, problems) -> PartySource:
    from parties.resume import load_run

    if data is not None:
        raise ValueError("--data is for a `vfl party` folder: a `vfl train` run's config.json names each "
                         "party's data")
    plan = load_run(run)
    _check_rank(rank, plan.parties)
    if plan.problem not in problems:
        raise ValueError(f"the run's problem {plan.problem!r} has no export")
    if plan.party_files is None:
        raise ValueError(f"{run}: the run names no party files, so party {rank}'s columns are unknown")
    return PartySource(rank, plan.parties, plan.problem, plan.standardize, rank < plan.active,
                       own_party_file(plan.party_files, rank), plan.party_folder(rank),
                       scaling_path(plan, rank), complete_epochs(run), plan.model, plan.bottom, plan.top)


def _from_party_folder(folder: Path, rank: int, data, problems) -> PartySource:
    record = _read_json(folder / PARTY_RECORD)
    job = record.get("job") if isinstance(record.get("job"), dict) else {}
    options, table = job.get("job"), job.get("parties")
    if not (isinstance(options, dict) and isinstance(table, list) and 2 <= len(table) <= 2**16
            and all(isinstance(p, dict) and p.get("role") in ("active", "passive") for p in table)
            and _index(record.get("rank"), len(table)) and isinstance(record.get("name"), str)):
        raise ValueError(f"{folder / PARTY_RECORD} is damaged (a field is missing or out of range)")
    _check_rank(rank, len(table))
    if record["rank"] != rank:
        raise ValueError(f"{folder} is the folder of party {record['rank']} ({record['name']}), not of party "
                         f"{rank}: each party exports its own part from its own folder")
    problem, standardize = options.get("problem"), options.get("standardize", "off")
    if problem not in problems or standardize not in STANDARDIZE:
        raise ValueError(f"{folder}: its job's problem {problem!r} has no export (a linear vertical job's "
                         f"problem is one of {', '.join(problems)})")
    if data is None:
        raise ValueError(f"{folder} is a `vfl party` folder, which does not record where the party's data "
                         "is: pass --data, the --data it was trained from (for its column schema)")
    model, bottom, top = _network_options(folder, options)
    return PartySource(rank, len(table), problem, standardize, table[rank]["role"] == "active",
                       own_party_file(data, rank), folder, scaling_file(folder, rank),
                       party_epochs(folder, rank), model, bottom, top)


def _network_options(folder: Path, options: dict) -> tuple[str, str, str]:
    """The job's ``model``, ``bottom`` and ``top`` (the training defaults where the job left them out)."""
    from parties.config import DEFAULT_BOTTOM, DEFAULT_TOP, MODELS

    chosen = (options.get("model", "linear"), options.get("bottom", DEFAULT_BOTTOM),
              options.get("top", DEFAULT_TOP))
    if chosen[0] not in MODELS or not all(isinstance(value, str) for value in chosen):
        raise ValueError(f"{folder / PARTY_RECORD} is damaged (its job's model, bottom or top)")
    return chosen


def party_epochs(folder: Path, rank: int) -> float:
    """The epoch every party completed: the leader's manifest, else the leader's final summary, which
    must be the newest block this party holds (else the run went on after it and did not end)."""
    if (folder / MANIFEST).exists():
        return complete_epochs(folder)
    path = folder / RESULT
    if not path.exists():
        raise FileNotFoundError(f"{folder}: no {RESULT}, so the run did not end here, and only the leader's "
                                f"{MANIFEST} knows the epoch every party completed: finish the run "
                                "(`vfl party … --resume`) before exporting")
    epochs = _read_json(path).get("epochs")
    if isinstance(epochs, bool) or not isinstance(epochs, int | float) or not 0 <= epochs < math.inf:
        raise ValueError(f"{path} is damaged (no finite epoch count)")
    newest = epochs_in(checkpoint_path(folder, rank))
    if newest is not None and newest > epochs + 1e-9:
        raise ValueError(f"{folder}: party-{rank}.ckpt.npz holds epoch {newest:g}, after the epoch "
                         f"{epochs:g} {RESULT} reports: a resumed run did not end; finish it first")
    return float(epochs)


def _read_json(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            text = fh.read(RECORD_MAX_BYTES + 1)
    except OSError as err:
        raise ValueError(f"{path}: cannot read it ({err.strerror})") from None
    try:
        value = json.loads(text) if len(text) <= RECORD_MAX_BYTES else None
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"{path} is damaged (not a JSON object of at most {RECORD_MAX_BYTES} bytes)")
    return value


def _index(value: object, size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < size


def _check_rank(rank: int, parties: int) -> None:
    if not _index(rank, parties):
        raise ValueError(f"--party must be a rank of the run's parties 0..{parties - 1}, got {rank}")
