"""A job file's scalar values checked against the option's type, one line naming the key when not.

Shared by the vertical job (:mod:`parties.federation.jobfile`) and the horizontal one
(:mod:`parties.federation.hfl_job`): TOML gives bool, int, float and str, and a bool is no number.
"""

from __future__ import annotations

from typing import Any

from parties.config import ConfigError


def scalar_as(kind: Any, value: Any, what: str) -> Any:
    """``value`` as ``kind`` (bool, int, float, else str); :class:`ConfigError` naming ``what``."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{what} must be true or false, got {value!r}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{what} must be a whole number, got {value!r}")
    if kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{what} must be a number, got {value!r}")
    if isinstance(value, str):
        return value
    raise ConfigError(f"{what} must be a string, got {value!r}")
