"""A run folder is the run: ``--resume`` and ``vfl predict`` take the options from its ``config.json``.

The plan saved when the run started (:class:`parties.plan.JobPlan`) holds the options the user gave and
what the launcher resolved (dataset name, party files, f*). Resuming re-resolves nothing: the model is
the one those options define, and a defaults-filled command line (``--resume --out RUN`` and nothing
else, as the interrupt message suggests) must not train a9a's blocks with breast-cancer's f* for 10
epochs. Options marked ``budget`` in the table of :mod:`parties.config` (epochs, time limit, target,
progress, peer timeout, audit, the folder itself) may change; any other option the user gives
explicitly must equal the run's, or the resume is refused in one line. Nothing is written before these
checks, so a refused resume leaves the folder as it was.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from parties.checkpoint import complete_epochs
from parties.config import EPOCH_SLACK, ConfigError, RunConfig, budget_options, long_flag, validate
from parties.plan import JobPlan, leader_view


def load_run(folder: str | Path) -> JobPlan:
    """The plan saved in ``folder``, as the run is now: ``out`` is that folder (it may have moved, and
    the party files the launcher wrote inside it move along), and ``resume`` is on, so nothing the run
    drew once (the randomized response of ``--label-privacy dp``) is drawn again."""
    run = Path(folder)
    path = run / "config.json"
    if not path.exists():
        raise ConfigError(f"{run}: no config.json, so not the --out folder of a `vfl train` run")
    try:
        saved = JobPlan.from_json(path.read_text())
    except (ValueError, TypeError, KeyError) as err:
        raise ConfigError(f"{path} is damaged ({err}); start a new run with another --out") from None
    options = dataclasses.replace(saved.options, out=str(run), resume=True)
    return dataclasses.replace(saved, options=options, out=str(run),
                               party_files=_moved(saved.party_files, saved.out, run))


def _moved(files: str | None, old_out: str | None, run: Path) -> str | None:
    """Party files the launcher wrote inside the run folder, found where the folder is now."""
    if files is None or old_out is None:
        return files
    try:
        inside = Path(files).resolve().relative_to(Path(old_out).resolve())
    except ValueError:
        return files  # the user's own --party-files, outside the run
    return str(run / inside)


def resumed_plan(options: RunConfig, given: frozenset[str], out: Path) -> JobPlan:
    """The saved plan of the run in ``out`` with the budget options of ``options`` the user ``given``;
    :class:`ConfigError` for a given option that would change the model, or too few epochs. Reads only."""
    done = complete_epochs(out)  # no complete checkpoint: nothing to resume (FileNotFoundError)
    saved = leader_view(load_run(out), 0)
    budget = budget_options()
    for name in (f.name for f in dataclasses.fields(RunConfig) if f.name in given - budget):  # table order
        mine, theirs = getattr(options, name), getattr(saved.options, name)
        if mine != theirs:
            raise ConfigError(f"--resume keeps the run's options: {long_flag(name)} is {_shown(theirs)} in "
                              f"{out}, not {_shown(mine)} (start a new run with another --out)")
    changes = {name: getattr(options, name) for name in given & budget}
    merged = dataclasses.replace(saved.options, **{**changes, "out": str(out), "resume": True,
                                                   "overwrite": False})
    validate(merged)
    if merged.epochs < done - EPOCH_SLACK:
        raise ConfigError(f"--resume: {out} has {done:g} epochs complete already; --epochs {merged.epochs:g} "
                          "would end before them (give at least that many)")
    return dataclasses.replace(saved, options=merged)


def _shown(value) -> str:
    return "not set" if value is None else str(value)


def restored_line(plan: JobPlan) -> str:
    """What ``--resume`` restored, in one line for the launcher to print."""
    done = complete_epochs(plan.out)
    data = plan.dataset if plan.options.party_files is None else f"--party-files {plan.options.party_files}"
    return (f"vfl train: resuming {plan.out}: {data}, {plan.algorithm} ({plan.mode}), "
            f"q={plan.parties}/m={plan.active}, from epoch {done:g} to {plan.epochs:g}")
