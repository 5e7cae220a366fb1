"""Starting a job from the command line: validate the config, write ``<out>/config.json``, run the P + 1
ranks under ``mpiexec`` and, if the job fails, say which rank failed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from parties.hfl.config import HflConfig, validate
from parties.hfl.wire import SERVER
from parties.launch import run_mpi_module


def launch_hfl(config: HflConfig, *, extra_env: dict[str, str] | None = None) -> int:
    """Validate ``config`` (ConfigError before any rank starts), write ``<out>/config.json`` and run the
    job under ``mpiexec`` with P + 1 ranks; returns the job's exit code."""
    from parties.launch import FirstDeath, rank_threads

    config = validate(config)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "config.json"
    config_path.write_text(config.to_json() + "\n")
    for stale in out.glob("party-*.pid"):
        stale.unlink()
    watch = FirstDeath(out, config.processes + 1)
    env = {**rank_threads(config.processes + 1, config.compute_threads, extra_env), **(extra_env or {})}
    code, output = run_mpi_module(config.processes + 1, "parties.hfl", ["--config", str(config_path)],
                                  extra_env=env)
    if code != 0:
        culprit = _failed_rank(output, watch.first())
        print(f"hfl: the job failed (exit code {code}){culprit}.", file=sys.stderr)
    return code


def _failed_rank(output: str, first_dead: tuple[int, ...]) -> str:
    """Which rank failed: the one that printed a fatal error, else the first to die (from pidfds: Hydra's
    banner names an arbitrary rank)."""
    from parties.launch import died_first

    named = re.search(r"\[hfl rank (\d+), ([^\]]+)\]", output)
    if named:
        return f": rank {named.group(1)} ({named.group(2)}) failed, see its message above"
    if first_dead:
        return f": {died_first(first_dead, _rank_and_role)}, and the other ranks were stopped"
    return ""


def _rank_and_role(rank: int) -> str:
    return f"rank {rank} ({'the server' if rank == SERVER else f'client process {rank - 1}'})"
