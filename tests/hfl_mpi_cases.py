"""The MPI trajectory tests' common fixture body: named cases of a base ``HflConfig``, all run in one
``mpiexec`` job (server + P client processes), one config after another."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from parties.hfl import HflConfig, validate, write_client_files
from tests.conftest import run_mpi


def case_config(base: HflConfig, cases: Mapping[str, Mapping[str, object]], name: str,
                root: Path) -> HflConfig:
    """Case ``name``: ``base`` with the case's fields, writing into ``root/name``."""
    return dataclasses.replace(base, out=str(root / name), **cases[name])  # type: ignore[arg-type]


def run_cases(root: Path, base: HflConfig, cases: Mapping[str, Mapping[str, object]], *, timeout: float,
              env: dict[str, str] | None = None) -> Path:
    """Run every case; a case whose name ends in ``-files`` reads client files split from its own config
    (the deployment path: each process reads only its file)."""
    paths = []
    for name in cases:
        config = case_config(base, cases, name, root)
        if name.endswith("-files"):
            files = root / f"client-files-{name}"
            write_client_files(config, files)
            config = dataclasses.replace(config, client_files=str(files))
        path = root / f"{name}.json"
        path.write_text(validate(config).to_json())
        paths.append(path)
    run_mpi(base.processes + 1, ["-m", "parties.hfl"] + [a for p in paths for a in ("--config", str(p))],
            timeout=timeout, env=env)
    return root
