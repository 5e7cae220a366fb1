"""The job file of a horizontal job (``kind = "hfl"``): one server and its client processes, each run by
its own organisation.

::

    [job]
    kind = "hfl"
    algorithm = "fedavg"          # the keys are `python -m parties.hfl`'s long flags without the dashes
    model = "softmax"
    n-features = 64               # the model's shape is part of the job: the server holds no training
    n-classes = 10                # rows to read it from, and each client checks its own file against it
    clients = 6                   # N logical clients, hosted by the client parties (their files say which)
    per-round = 3
    rounds = 5

    [[party]]                     # the server first: it leads the join
    name = "server-org"
    role = "server"
    address = "10.0.0.1:7700"
    public_key = "…"

    [[party]]                     # one table per client process, in the order of its clients-<p>.npz
    name = "clinic-a"
    role = "client"
    public_key = "…"

An algorithm's own options (``python -m parties.hfl --help`` lists them, e.g. ``momentum``) are keys of
``[job]`` too. The number of client processes is the number of client tables. What each party decides
for itself (its data file, its folder, its progress bar, its threads) is on its own command line, and
what only shaped the split (``dataset``, ``partition``, ...) is not the job's: the files are the data.
There is no ``secure-channels`` here: the horizontal frames (:mod:`parties.hfl.wire`) are not sealed,
so an hfl job file that asks for it is refused rather than run in the clear (docs/deployment.md).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from parties.config import ConfigError
from parties.federation.party_table import Party, check_distinct, check_leader_address, read_party
from parties.federation.toml_values import scalar_as
from parties.hfl.config import HflConfig, check_shape, option_names, validate_options

HFL_ROLES = ("server", "client")

#: HflConfig fields that are not the job's, and why (each party's own, or only the split's).
NOT_HFL_OPTIONS = {
    "dataset": "each party gives its own data file with --data",
    "data_dir": "each party gives its own data file with --data",
    "client_files": "each party gives its own data file with --data",
    "partition": "the split decided the partition: the client files are the data",
    "shards_per_client": "the split decided the partition: the client files are the data",
    "dirichlet_alpha": "the split decided the partition: the client files are the data",
    "processes": "the client processes are the [[party]] tables with role = \"client\"",
    "out": "each party gives its own --folder",
    "progress": "each party passes --no-progress itself",
    "compute_threads": "each party's threads are its own host's business",
    "trajectory": "not available in a federated job (the server keeps model.npz and the metrics)",
    "options": "an algorithm's options are keys of [job] themselves",
    "secure_channels": "the horizontal frames are not sealed yet; this job type runs without it "
                       "(docs/deployment.md, \"Horizontal jobs\")",
}
_FIELDS = {f.name: f for f in dataclasses.fields(HflConfig)}
JOB_FIELDS = tuple(name for name in _FIELDS if name not in NOT_HFL_OPTIONS)


def _key(name: str) -> str:
    return name.replace("_", "-")


def parse_hfl(section: dict[str, Any], tables: list[Any], where: str) -> tuple[HflConfig, tuple[Party, ...]]:
    """A horizontal job's options and parties from its ``[job]`` and ``[[party]]`` tables (the job file
    makes them a :class:`~parties.federation.jobfile.Job`); ConfigError in one line."""
    parties = tuple(read_party(table, i, where, HFL_ROLES) for i, table in enumerate(tables))
    check_distinct(parties, where)
    _check_roles(parties, where)
    check_leader_address(parties, where)
    fields, options = _options(section, where)
    missing = [_key(n) for n in ("n_features",) if n not in fields]
    if fields.get("model") != "least-squares" and "n_classes" not in fields:
        missing.append("n-classes")
    if missing:
        raise ConfigError(f"{where}: [job] needs {' and '.join(missing)} (the model's shape: the server "
                          "holds no training rows to read it from)")
    config = HflConfig(**fields, options=options, processes=len(parties) - 1, progress=True)
    try:
        validate_options(config)
        check_shape(config, config.n_features or 0, config.n_classes or 0)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    if config.n_features is None or config.n_features < 1 or (config.n_classes or 2) < 2:
        raise ConfigError(f"{where}: [job] n-features must be at least 1 and n-classes at least 2")
    return config, parties


def canonical_options(config: HflConfig) -> dict[str, Any]:
    """What every party of a horizontal job must agree on, as plain JSON values (defaults filled in)."""
    out: dict[str, Any] = {"kind": "hfl"}
    for name in JOB_FIELDS:
        value = getattr(config, name)
        out[_key(name)] = list(value) if isinstance(value, list) else value
    out["algorithm-options"] = dict(sorted(config.options.items()))
    return out


def _check_roles(parties: tuple[Party, ...], where: str) -> None:
    servers = [p.name for p in parties if p.role == "server"]
    if parties[0].role != "server" or len(servers) != 1:
        raise ConfigError(f"{where}: a horizontal job has one server, listed first (it leads the join); "
                          f"the servers listed: {', '.join(servers) or 'none'}")
    if len(parties) < 2:
        raise ConfigError(f"{where}: a horizontal job needs at least one client party")


def _options(section: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The ``[job]`` table as HflConfig fields and the algorithm's options (as text, like its flags)."""
    algorithm_options = {_key(n): n for n in option_names()}
    by_key = {_key(n): n for n in JOB_FIELDS}
    not_job = {_key(n): why for n, why in NOT_HFL_OPTIONS.items()}
    fields: dict[str, Any] = {}
    options: dict[str, str] = {}
    for key, value in section.items():
        spelled = key.replace("_", "-")
        what = f"{where}: [job] {spelled}"
        if spelled == "kind":
            continue
        if spelled in not_job:
            raise ConfigError(f"{what} is not an hfl job option: {not_job[spelled]}")
        if spelled in by_key:
            fields[by_key[spelled]] = _typed(value, by_key[spelled], what)
        elif spelled in algorithm_options:
            if isinstance(value, dict | list):
                raise ConfigError(f"{what} must be a number, a string or true/false, got {value!r}")
            text = str(value).lower() if isinstance(value, bool) else str(value)
            options[algorithm_options[spelled]] = text
        else:
            close = difflib.get_close_matches(spelled, [*by_key, *algorithm_options], n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"{where}: [job] has no hfl option {key!r}{hint}")
    return fields, options


def _typed(value: Any, name: str, what: str) -> Any:
    """``value`` as the HflConfig field's type (TOML has no None: leave the key out instead)."""
    hint = typing.get_type_hints(HflConfig)[name]
    kinds = [t for t in typing.get_args(hint) if t is not type(None)] if typing.get_args(hint) else [hint]
    kind = typing.get_origin(kinds[0]) or kinds[0]
    if kind is list:
        if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool)
                                                     for v in value):
            return value
        raise ConfigError(f"{what} must be a list of whole numbers, got {value!r}")
    return scalar_as(kind, value, what)
