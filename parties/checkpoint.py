"""Per-party checkpoints: each party saves only its own block (never anyone else's), consistently.

A party's checkpoint is ``party-<rank>.ckpt.npz`` in the party's own folder (``--party-dir``, by
default the run's ``--out``; only that party writes or reads it): its block ``w``, the epochs and dominated
updates done and the training time spent. The algorithm state (SVRG snapshot, SAGA table) is rebuilt
from the restored ``w`` by the next full pass, which is the same as starting a new outer loop there.

Why a manifest: an interrupt can stop the parties between their writes, leaving some blocks one
epoch ahead of the others, and mixing them would resume from a model no run ever had. So an epoch is
*complete* only when every party has written it; then the leader records it in
``<out>/checkpoint.json`` (atomically) and tells the others which epoch that is. Each party keeps its
previous block as ``party-<rank>.prev.ckpt.npz`` until the next epoch is complete, so the complete
epoch can always be found, in one file or the other. ``--resume`` takes the complete epoch and says
which.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MANIFEST = "checkpoint.json"


@dataclass(frozen=True)
class Checkpoint:
    w: np.ndarray
    epochs: float
    train_time: float
    updates: int


def checkpoint_path(out: str | Path, rank: int) -> Path:
    return Path(out) / f"party-{rank}.ckpt.npz"


def _previous_path(out: str | Path, rank: int) -> Path:
    return Path(out) / f"party-{rank}.prev.ckpt.npz"


def atomic_write(path: Path, write) -> None:
    """Write ``path`` whole or not at all: into ``<name>.tmp`` first, then renamed over it.

    The temporary file is created anew, never opened through a link: whatever sits at its name (a
    symlink planted there pointing outside the party's folder, a stale file) is removed first, and
    ``O_EXCL | O_NOFOLLOW`` refuse anything that appears between the two calls."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def save_checkpoint(out: str | Path, rank: int, w: np.ndarray, epochs: float, train_time: float,
                    updates: int) -> Path:
    """Write this party's block for the epoch just finished, keeping the previous one beside it."""
    path = checkpoint_path(out, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        os.replace(path, _previous_path(out, rank))
    atomic_write(path, lambda fh: np.savez(fh, w=w, epochs=epochs, train_time=train_time, updates=updates))
    return path


def mark_complete(out: str | Path, epochs: float) -> None:
    """Leader: every party has written the epoch, so it is the one to resume from."""
    text = json.dumps({"epochs": epochs}).encode()
    atomic_write(Path(out) / MANIFEST, lambda fh: fh.write(text))


def complete_epochs(out: str | Path) -> float:
    """The newest epoch every party completed; a clear error when the run has none."""
    path = Path(out) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{out}: no complete checkpoint to resume from ({MANIFEST} is missing); "
                                "start without --resume")
    try:
        return float(json.loads(path.read_text())["epochs"])
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path} is damaged: start without --resume") from None


def load_checkpoint(folder: str | Path, rank: int, n_features: int, epochs: float) -> Checkpoint:
    """This party's block of the complete epoch ``epochs`` (the leader's :func:`complete_epochs`) from
    its own folder; stale temporary files there are removed."""
    for stale in Path(folder).glob(f"party-{rank}.*.tmp"):
        stale.unlink()
    for path in (checkpoint_path(folder, rank), _previous_path(folder, rank)):
        if not path.exists():
            continue
        with np.load(path) as z:
            if abs(float(z["epochs"]) - epochs) > 1e-9:
                continue
            w = z["w"].astype(np.float64)
            if w.shape != (n_features,):
                raise ValueError(f"party {rank}: checkpoint {path} has a block of {w.shape[0]} features, "
                                 f"this party holds {n_features}")
            return Checkpoint(w, epochs, float(z["train_time"]), int(z["updates"]))
    raise FileNotFoundError(f"party {rank}: no checkpoint of the complete epoch {epochs:g} in {folder}")
