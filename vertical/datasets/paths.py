"""Where dataset files are looked for, and the error raised when they are nowhere.

Search order (first hit wins):

1. an explicit ``data_dir`` argument, else ``$VFL_DATA_DIR``: when either is given it is the *only*
   place searched, so that a run is reproducible and a test can point at an empty folder;
2. otherwise ``<repo>/../shared/data`` (the project's shared data folder, resolved relative to this
   package, not to the working directory) when it exists, then the user cache
   (``$XDG_CACHE_HOME/vfl`` or ``~/.cache/vfl``), then dataset-specific system folders such as
   ``/usr/share/datasets`` where Debian's ``dataset-fashion-mnist`` package installs its files.

Every file may be stored plain or compressed (``.bz2``, ``.gz``); the compressed variants are tried
after the plain name. Nothing here downloads: a missing file raises :class:`DatasetNotFoundError`
that lists every path tried and says how to provide the file.
"""

from __future__ import annotations

import bz2
import gzip
import os
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

DATA_DIR_ENV = "VFL_DATA_DIR"
COMPRESSION_SUFFIXES = ("", ".bz2", ".gz")
_REPO_ROOT = Path(__file__).resolve().parents[2]


class DatasetNotFoundError(FileNotFoundError):
    """A registered dataset's file is not in any searched folder (the message lists them)."""


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/vfl``, else ``~/.cache/vfl``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vfl"


def data_dir_candidates(data_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """The folders searched for dataset files, in order (see the module docstring)."""
    override = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV) or None
    if override is not None:
        return [Path(override).expanduser()]
    candidates = []
    shared = _REPO_ROOT.parent / "shared" / "data"
    if shared.is_dir():
        candidates.append(shared)
    candidates.append(user_cache_dir())
    return candidates


def _explicit_dir_given(data_dir: str | os.PathLike[str] | None) -> bool:
    return data_dir is not None or bool(os.environ.get(DATA_DIR_ENV))


def candidate_paths(relative_name: str, *, data_dir: str | os.PathLike[str] | None = None,
                    system_dirs: Sequence[Path] = ()) -> list[Path]:
    """Every path where ``relative_name`` (with each compression suffix) may be, in search order.

    ``system_dirs`` are searched only when no explicit folder was given.
    """
    folders = data_dir_candidates(data_dir)
    if not _explicit_dir_given(data_dir):
        folders += list(system_dirs)
    return [folder / f"{relative_name}{suffix}" for folder in folders for suffix in COMPRESSION_SUFFIXES]


def find_file(relative_name: str, *, dataset: str, data_dir: str | os.PathLike[str] | None = None,
              system_dirs: Sequence[Path] = ()) -> Path:
    """The first existing variant of ``relative_name``; :class:`DatasetNotFoundError` otherwise."""
    tried = candidate_paths(relative_name, data_dir=data_dir, system_dirs=system_dirs)
    for path in tried:
        if path.is_file():
            return path
    looked = "\n".join(f"  {path}" for path in tried)
    raise DatasetNotFoundError(
        f"dataset {dataset!r}: file {relative_name!r} (plain, .bz2 or .gz) not found. Looked in:\n{looked}\n"
        f"Put the file in one of these folders, or set ${DATA_DIR_ENV} (or pass data_dir=) to the folder "
        f"that holds it."
    )


def open_binary(path: Path) -> BinaryIO:
    """Open ``path`` for reading bytes, decompressing ``.gz`` / ``.bz2`` transparently."""
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    if path.suffix == ".bz2":
        return bz2.open(path, "rb")
    return open(path, "rb")
