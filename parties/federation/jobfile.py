"""The job file the organisations agree on: a TOML file a person can read and check.

::

    [job]                         # the training options, spelled as `vfl train`'s long flags
    algorithm = "sgd"
    mode = "sync-global"
    epochs = 5
    batch-size = 1

    [[party]]                     # one table per party, in rank order: the active parties first
    name = "bank-a"               # the first party is the leader: it serves the hello
    role = "active"
    address = "10.0.0.1:7700"     # host:port of the leader's hello (optional for the others)
    public_key = "3f1c…"          # its X25519 public key, hex (from `vfl keygen`), pinned

    [[party]]
    name = "hospital-b"
    role = "passive"
    public_key = "a9e0…"

A horizontal job (``kind = "hfl"`` in ``[job]``: a ``python -m parties.hfl`` server and its client
processes) is read by :mod:`parties.federation.hfl_job`, with roles ``server`` and ``client``.

The ``[job]`` keys are the option table of :mod:`parties.config` (``vfl train``'s long flags without the
dashes; ``_`` may stand for ``-``), checked by the same :func:`parties.config.validate`. What each party
decides for itself (its data, its folder, resuming, its progress bar, its audit) is not in the file
but on its own command line (:data:`NOT_JOB_OPTIONS` says where). Every party derives the same
canonical JSON and digest from the file (:meth:`Job.canonical`, :meth:`Job.digest`); the hello compares
digests and, when they differ, names the first field that does (:func:`first_difference`). Defaults
are filled in before hashing, so ``epochs = 10`` and no ``epochs`` line are the same job.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import itertools
import json
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parties.config import ConfigError, RunConfig, long_flag, validate
from parties.federation.party_table import (
    PARTY_KEYS,
    ROLES,
    Party,
    check_distinct,
    check_leader_address,
    read_party,
    split_address,
)
from parties.federation.toml_values import scalar_as

__all__ = ["JOB_FORMAT", "PARTY_KEYS", "ROLES", "Job", "Party", "check_distinct", "check_leader_address",
           "first_difference", "job_key", "load_job", "parse_job", "read_party", "split_address"]

#: Bumped when the canonical form changes: parties of different versions then differ at "format".
JOB_FORMAT = "vfl-job/1"
#: A job file is a page of text; a larger one is not one.
MAX_JOB_BYTES = 64 * 1024
#: The most parties a job file may list (one MPI process each).
MAX_PARTIES = 256


#: Options of ``vfl train`` that are not the job's: why, and where each party gives them instead.
NOT_JOB_OPTIONS = {
    "parties": "q is the number of [[party]] tables",
    "active": "the parties with role = \"active\" are the active ones",
    "dataset": "each party gives its own data with --data",
    "party_files": "each party gives its own data with --data",
    "data_dir": "each party gives its own data with --data",
    "out": "each party gives its own --folder",
    "party_dir": "each party gives its own --folder",
    "channel_keys": "each [[party]] pins its public_key",
    "overwrite": "each party passes --overwrite itself",
    "resume": "each party passes --resume itself (the hello checks that all do)",
    "progress": "each party passes --no-progress itself",
    "audit": "each party passes --audit itself (what it records of what it receives is its own)",
    "reference": "no party holds the pooled data a NonF reference needs (give f-star if you know f*)",
}
#: The options a job file sets, in the table's order.
JOB_OPTIONS = tuple(f.name for f in dataclasses.fields(RunConfig) if f.name not in NOT_JOB_OPTIONS)
#: In this mode the channels are sealed unless the job file says otherwise: the keys are pinned anyway.
FEDERATION_DEFAULTS = {"secure_channels": True, "reference": False, "progress": True}


def job_key(name: str) -> str:
    """The ``[job]`` key of an option: its long flag without the dashes (``batch_size`` → ``batch-size``)."""
    return long_flag(name)[2:]


_BY_KEY = {job_key(name): name for name in JOB_OPTIONS}
_NOT_BY_KEY = {job_key(name): name for name in NOT_JOB_OPTIONS}


@dataclass(frozen=True)
class Job:
    """A checked job file: the training options (with q and m from the parties) and the parties in rank
    order. ``options`` has no per-party value (data, folder): :meth:`parties.federation.member` adds
    this party's own. A horizontal job (``kind`` "hfl") holds a :class:`parties.hfl.HflConfig`."""

    options: Any   # RunConfig; HflConfig when kind is "hfl"
    parties: tuple[Party, ...]
    where: str = "job file"
    kind: str = "vfl"

    @property
    def leader(self) -> Party:
        return self.parties[0]

    def rank_of(self, name: str) -> int:
        for rank, party in enumerate(self.parties):
            if party.name == name:
                return rank
        names = ", ".join(p.name for p in self.parties)
        raise ConfigError(f"{self.where}: no party named {name!r} (the parties are {names})")

    def public_keys(self) -> tuple[bytes, ...]:
        return tuple(p.public_key for p in self.parties)

    def canonical(self) -> dict[str, Any]:
        """What every party must agree on, as plain JSON values: every job option (defaults filled in,
        numbers as the option's type) and every party's table."""
        if self.kind == "hfl":
            from parties.federation.hfl_job import canonical_options

            options = canonical_options(self.options)
        else:
            options = {job_key(name): getattr(self.options, name) for name in JOB_OPTIONS}
        return {"format": JOB_FORMAT, "job": options,
                "parties": [{"name": p.name, "role": p.role, "address": p.address,
                             "public_key": p.public_key.hex()} for p in self.parties]}

    def canonical_json(self) -> str:
        return json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))

    def digest(self) -> bytes:
        """SHA-256 of the canonical JSON: equal at two parties iff they run the same job."""
        return hashlib.sha256(self.canonical_json().encode()).digest()


def load_job(path: str | Path) -> Job:
    """Read and check a job file; :class:`ConfigError` in one line naming the file and the key."""
    where = str(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_JOB_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"{where}: cannot read the job file ({err.strerror})") from None
    if len(raw) > MAX_JOB_BYTES:
        raise ConfigError(f"{where}: over {MAX_JOB_BYTES // 1024} KiB, not a job file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not UTF-8 text") from None
    return parse_job(text, where)


def parse_job(text: str, where: str = "job file") -> Job:
    """A job from the text of a job file (see the module's docstring)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{where}: not valid TOML ({err})") from None
    unknown = sorted(set(doc) - {"job", "party"})
    if unknown:
        raise ConfigError(f"{where}: unknown table [{unknown[0]}]; a job file has one [job] table and one "
                          "[[party]] table per party")
    section = doc.get("job", {})
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: [job] must be a table")
    tables = doc.get("party")
    if not isinstance(tables, list) or not tables:
        raise ConfigError(f"{where}: no [[party]] table: list every party, the leader first")
    if len(tables) > MAX_PARTIES:
        raise ConfigError(f"{where}: {len(tables)} parties; at most {MAX_PARTIES}")
    kind = section.get("kind", "vfl")
    if kind == "hfl":
        from parties.federation.hfl_job import parse_hfl

        config, parties = parse_hfl(section, tables, where)
        return Job(config, parties, where, kind="hfl")
    if kind != "vfl":
        raise ConfigError(f"{where}: [job] kind must be \"vfl\" (the default) or \"hfl\" (got {kind!r})")
    section = {k: v for k, v in section.items() if k != "kind"}
    parties = tuple(read_party(table, i, where) for i, table in enumerate(tables))
    _check_parties(parties, where)
    given = _job_options(section, where)
    active = sum(p.active for p in parties)
    options = RunConfig(**{**FEDERATION_DEFAULTS, **given, "parties": len(parties), "active": active})
    if options.f_star is not None and options.label_privacy != "none":
        raise ConfigError(f"{where}: [job] f-star with label-privacy = {options.label_privacy!r}: f* is "
                          "computed from all the labels, and every party reads the job file")
    try:
        validate(options)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    return Job(options, parties, where)


def _job_options(section: dict[str, Any], where: str) -> dict[str, Any]:
    """The ``[job]`` table as RunConfig fields, each value of the option's type."""
    hints = typing.get_type_hints(RunConfig)
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    given: dict[str, Any] = {}
    for key, value in section.items():
        spelled = key.replace("_", "-")
        if spelled in _NOT_BY_KEY:
            why = NOT_JOB_OPTIONS[_NOT_BY_KEY[spelled]]
            raise ConfigError(f"{where}: [job] {key} is not a job option: {why}")
        if spelled not in _BY_KEY:
            close = difflib.get_close_matches(spelled, list(_BY_KEY), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"{where}: [job] has no option {key!r}{hint}")
        name = _BY_KEY[spelled]
        if name in given:
            raise ConfigError(f"{where}: [job] sets {spelled} twice")
        given[name] = _typed(value, hints[name], fields[name], f"{where}: [job] {spelled}")
    return given


def _typed(value: Any, hint: Any, field: dataclasses.Field, what: str) -> Any:
    """``value`` as the option's type: TOML has no None (leave the key out to unset an option)."""
    kinds = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    kind = kinds[0]
    parse = field.metadata.get("parse")
    if isinstance(value, str) and parse is not None:  # e.g. gamma = "auto"
        try:
            return parse(value)
        except ValueError:
            raise ConfigError(f"{what}: {value!r} is not a valid value") from None
    return scalar_as(kind, value, what)


def _check_parties(parties: tuple[Party, ...], where: str) -> None:
    check_distinct(parties, where)
    for before, after in itertools.pairwise(parties):
        if after.active and not before.active:
            raise ConfigError(f"{where}: active party {after.name} follows passive party {before.name}: the "
                              "active parties come first (they are ranks 0..m-1)")
    if not parties[0].active:
        raise ConfigError(f"{where}: the first party ({parties[0].name}) leads the job and must be active")
    check_leader_address(parties, where)


# ---------------------------------------------------------------------------- comparing two jobs


def first_difference(mine: dict[str, Any], theirs: Any) -> tuple[str, str, str] | None:
    """The first field where another party's canonical job (untrusted JSON) differs from ``mine``:
    (field, my value, theirs), values shown short and printable; None when they agree."""
    if not isinstance(theirs, dict):
        return "the job", "a job file", _shown(theirs)
    if theirs.get("format") != mine["format"]:
        return "format", _shown(mine["format"]), _shown(theirs.get("format"))
    their_job = theirs.get("job")
    if not isinstance(their_job, dict):
        return "[job]", "a table", _shown(their_job)
    for key, value in mine["job"].items():
        if key not in their_job:
            return f"[job] {key}", _shown(value), "not known there"
        if not _same(value, their_job[key]):
            return f"[job] {key}", _shown(value), _shown(their_job[key])
    extra = sorted(str(k) for k in their_job if k not in mine["job"])
    if extra:
        return f"[job] {extra[0][:40]}", "not known here", _shown(their_job[extra[0]])
    their_parties = theirs.get("parties")
    if not isinstance(their_parties, list):
        return "[[party]]", "a list", _shown(their_parties)
    for i, party in enumerate(mine["parties"]):
        if i >= len(their_parties):
            return "number of parties", str(len(mine["parties"])), str(len(their_parties))
        other = their_parties[i]
        if not isinstance(other, dict):
            return f"[[party]] {i + 1}", "a table", _shown(other)
        for key in PARTY_KEYS:
            if party[key] != other.get(key):
                where = f"[[party]] {i + 1} ({party['name']}) {key}"
                return where, _shown(party[key]), _shown(other.get(key))
    if len(their_parties) != len(mine["parties"]):
        return "number of parties", str(len(mine["parties"])), str(len(their_parties))
    return None


def _same(a: Any, b: Any) -> bool:
    return (type(a) is type(b) and a == b) or (isinstance(a, float) and isinstance(b, int | float)
                                             and not isinstance(b, bool) and a == b)


def _shown(value: Any) -> str:
    """A value from another party, printable on one line: JSON-escaped (no control characters) and short."""
    text = json.dumps(value, ensure_ascii=True, default=str)
    return text if len(text) <= 40 else text[:37] + "..."
