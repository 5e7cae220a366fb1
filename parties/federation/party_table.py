"""The ``[[party]]`` tables of a job file, of either kind: who each party is (:class:`Party`), read and
checked in one line naming the table (:func:`read_party`), and the checks every kind of job makes of
its parties (distinct names and keys, the leader's address). :mod:`parties.federation.jobfile` reads a
vertical job and :mod:`parties.federation.hfl_job` a horizontal one from them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from parties.config import ConfigError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_HOST = re.compile(r"[A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")
ROLES = ("active", "passive")
PARTY_KEYS = ("name", "role", "address", "public_key")


@dataclass(frozen=True)
class Party:
    """One ``[[party]]`` table: who the party is, its role, where its hello listens, its pinned key."""

    name: str
    role: str
    address: str | None
    public_key: bytes

    @property
    def active(self) -> bool:
        return self.role == "active"


def read_party(table: Any, index: int, where: str, roles: tuple[str, ...] = ROLES) -> Party:
    what = f"{where}: [[party]] {index + 1}"
    if not isinstance(table, dict):
        raise ConfigError(f"{what} is not a table")
    keys = {k.replace("-", "_"): v for k, v in table.items()}
    unknown = sorted(set(keys) - set(PARTY_KEYS))
    if unknown:
        raise ConfigError(f"{what} has no key {unknown[0]!r}; a party has {', '.join(PARTY_KEYS)}")
    name = keys.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"{what}: name must be 1-64 letters, digits, '.', '_' or '-' (got {name!r})")
    what = f"{what} ({name})"
    role = keys.get("role")
    if role not in roles:
        spelled = " or ".join(f'"{r}"' for r in roles)
        raise ConfigError(f"{what}: role must be {spelled} (got {role!r})")
    address = keys.get("address")
    if address is not None:
        split_address(address, what)
    key = keys.get("public_key")
    if not isinstance(key, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", key):
        raise ConfigError(f"{what}: public_key must be 64 hex digits (an X25519 key from `vfl keygen`)")
    return Party(name, role, address, bytes.fromhex(key))


def split_address(address: Any, what: str = "address") -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) as (host, port); :class:`ConfigError` otherwise."""
    if not isinstance(address, str) or ":" not in address:
        raise ConfigError(f"{what}: address must be \"host:port\" (got {address!r})")
    host, _, port = address.rpartition(":")
    if not _HOST.fullmatch(host) or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{what}: address must be \"host:port\" with a port in 1..65535 (got {address!r})")
    return host.strip("[]"), int(port)


def check_leader_address(parties: tuple[Party, ...], where: str) -> None:
    if parties[0].address is None:
        raise ConfigError(f"{where}: the first party ({parties[0].name}) leads the job: it needs an address "
                          "(host:port where its hello listens)")


def check_distinct(parties: tuple[Party, ...], where: str) -> None:
    """No two parties share a name or a pinned key."""
    seen: dict[str, int] = {}
    keys: dict[bytes, str] = {}
    for party in parties:
        if party.name in seen:
            raise ConfigError(f"{where}: two parties are named {party.name!r}")
        seen[party.name] = len(seen)
        if party.public_key in keys:
            raise ConfigError(f"{where}: {keys[party.public_key]} and {party.name} pin the same public key")
        keys[party.public_key] = party.name
