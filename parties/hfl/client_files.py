"""The client data files of a deployment-style run: one ``clients-<p>.npz`` per client process (written by
:func:`parties.hfl.split.write_client_files`, which documents the format), read by that process only
(:func:`load_client_file`) and checked as a folder before any rank starts, from the arrays' headers
without reading the data."""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from horizontal import FederatedData
from parties.config import ConfigError

CLIENT_FILE_FORMAT = "vfl-hfl-clients/1"


def client_file_name(process: int) -> str:
    return f"clients-{process}.npz"


@dataclass(frozen=True)
class Shard:
    """What one client process holds: its logical clients (global ids, increasing) and their rows."""

    client_ids: torch.Tensor
    data: FederatedData


def load_client_file(path: Path, dtype: torch.dtype) -> tuple[Shard, int, int]:
    """(shard, n_clients, n_classes) from a ``clients-<p>.npz`` file; errors name the file."""
    try:
        with np.load(path, allow_pickle=False) as f:
            if str(f["format"]) != CLIENT_FILE_FORMAT:
                raise ValueError(f"format {str(f['format'])!r}, expected {CLIENT_FILE_FORMAT!r}")
            ids, offsets = f["client_ids"].astype(np.int64), f["offsets"].astype(np.int64)
            X, y, n_clients, n_classes = f["X"], f["y"], int(f["n_clients"]), int(f["n_classes"])
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as err:
        raise ConfigError(f"client file {path}: {err}") from None
    if ids.ndim != 1 or ids.size == 0 or np.any(np.diff(ids) <= 0):
        raise ConfigError(f"client file {path}: client_ids must be a non-empty increasing list")
    if offsets.shape != (ids.size + 1,) or offsets[0] != 0 or offsets[-1] != X.shape[0] or np.any(
            np.diff(offsets) < 1):
        raise ConfigError(f"client file {path}: offsets must run from 0 to {X.shape[0]} rows, one or more "
                          "rows per client")
    parts = [np.arange(offsets[k], offsets[k + 1]) for k in range(ids.size)]
    data = FederatedData.from_partition(X, y, parts, dtype=dtype)
    return Shard(torch.as_tensor(ids), data), n_clients, n_classes


def _npy_header(path: Path, member: str) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of one array of an ``.npz`` without reading its data."""
    with zipfile.ZipFile(path) as archive, archive.open(f"{member}.npy") as handle:
        major, _ = np.lib.format.read_magic(handle)
        read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(handle)
    return shape, dtype


def inspect_client_files(folder: Path, processes: int, n_clients: int) -> tuple[int, int]:
    """Check ``--client-files`` before any rank starts: one file per process, together hosting each of
    the N clients exactly once, the same feature count and task; returns (n_features, n_classes or 0)."""
    names = [client_file_name(p) for p in range(processes)]
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise ConfigError(f"--client-files {folder}: missing {', '.join(missing)} for --processes "
                          f"{processes} (write them with `python -m parties.hfl split`)")
    hosted, features, classes = [], set(), set()
    for p in range(processes):
        path = folder / client_file_name(p)
        try:
            with np.load(path, allow_pickle=False) as f:
                hosted.append(f["client_ids"])
                federation, n_classes = int(f["n_clients"]), int(f["n_classes"])
            shape, _ = _npy_header(path, "X")
        except (OSError, KeyError, ValueError, zipfile.BadZipFile) as err:
            raise ConfigError(f"client file {path}: {err}") from None
        if federation != n_clients:
            raise ConfigError(f"client file {path} belongs to a federation of {federation} clients, but "
                              f"--clients is {n_clients}")
        features.add(shape[1] if len(shape) == 2 else -1)
        classes.add(n_classes)
    ids = np.sort(np.concatenate(hosted))
    if not np.array_equal(ids, np.arange(n_clients)):
        raise ConfigError(f"--client-files {folder}: the files must host each of the {n_clients} clients "
                          "exactly once (some are missing or hosted twice)")
    if len(features) != 1 or -1 in features or len(classes) != 1:
        raise ConfigError(f"--client-files {folder}: files disagree on the feature count {sorted(features)} "
                          f"or the number of classes {sorted(classes)}")
    return features.pop(), classes.pop()
