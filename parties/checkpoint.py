"""Per-party checkpoints: each party saves only its own block (never anyone else's), consistently.

A party's checkpoint is ``party-<rank>.ckpt.npz`` in the party's own folder (``--party-dir``, by default
the run's ``--out``; only that party writes or reads it): its block ``w``, the epochs and dominated
updates done, the training time spent, the base step γ (so a resumed run steps as it started) and, for a
dominator, where its row sampler stands (:func:`sampler_words`), so that a resumed lock-step run draws
the rows the uninterrupted run would have drawn. The algorithm state (SVRG snapshot, SAGA table) is
rebuilt from the restored ``w`` by the next full pass, which is the same as starting a new outer loop
there.

Why a manifest: an interrupt can stop the parties between their writes, leaving some blocks one
epoch ahead of the others, and mixing them would resume from a model no run ever had. So an epoch is
*complete* only when every party has written it; then the leader records it in
``<out>/checkpoint.json`` (atomically) and tells the others which epoch that is. Each party keeps a
second file, ``party-<rank>.prev.ckpt.npz``, and never replaces the file holding the last *marked*
epoch before a newer one is marked (:func:`save_checkpoint`'s ``keep``): after a crash before the mark,
a resume from the marked epoch writes the next one over the stale newest file, not over the marked
one, so no number of crashes loses the resume point. ``--resume`` takes the complete epoch and says
which.

Both the manifest and the blocks are read back as untrusted input (anyone who can write into the run
folder wrote them): small, with finite counts, no pickles.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MANIFEST = "checkpoint.json"
#: the manifest is one small JSON object; anything bigger is not one this module wrote
MANIFEST_MAX_BYTES = 4096
#: no run trains this many epochs; a larger count in a file is damage, not progress
MAX_EPOCHS = 1e9
#: dominated updates: an int64 count
MAX_UPDATES = 2**62


@dataclass(frozen=True)
class Checkpoint:
    w: np.ndarray
    epochs: float
    train_time: float
    updates: int
    #: the run's base step (None in a checkpoint written before it was kept)
    gamma: float | None = None
    #: the dominator's row sampler (:func:`sampler_words`; None: not kept, or a passive party)
    sampler: np.ndarray | None = None
    #: ``--model mlp``: the party's network (and the top's) state as named arrays (:data:`NETWORK`)
    network: dict[str, np.ndarray] | None = None


#: The prefix of a network's arrays in a party file (``net/bottom/param/0.weight``, ...)
NETWORK = "net/"
#: What a party's network may hold in its file (each array's shape) and must hold (its parameters):
#: ``parties.party_model.NetworkPart.state_shapes``
NetworkShapes = tuple[dict[str, tuple[int, ...]], set[str]]


#: the PCG64 state as words: state and increment (128 bits each, high word first), the cached-half flag
#: and the cached half
SAMPLER_WORDS = 6


def sampler_words(rng: np.random.Generator) -> np.ndarray:
    """Where a PCG64 generator stands, as :data:`SAMPLER_WORDS` unsigned 64-bit words (no pickle)."""
    state = rng.bit_generator.state
    if state["bit_generator"] != "PCG64":
        raise ValueError(f"only a PCG64 sampler is kept, not {state['bit_generator']}")
    mask = 2**64 - 1
    core, inc = state["state"]["state"], state["state"]["inc"]
    return np.array([core >> 64, core & mask, inc >> 64, inc & mask, state["has_uint32"], state["uinteger"]],
                    dtype=np.uint64)


def sampler_from_words(words: np.ndarray, where: str) -> np.random.Generator:
    """A PCG64 generator at the state :func:`sampler_words` wrote, checked like any file read back: six
    words, an odd increment (PCG64's are), a cached-half flag of 0 or 1 and a 32-bit cached half."""
    words = np.asarray(words)
    if words.shape != (SAMPLER_WORDS,) or words.dtype != np.uint64:
        raise ValueError(f"{where} is damaged: the sampler is not {SAMPLER_WORDS} unsigned words")
    core_hi, core_lo, inc_hi, inc_lo, has_half, half = (int(x) for x in words)
    if inc_lo % 2 == 0 or has_half > 1 or half >= 2**32:
        raise ValueError(f"{where} is damaged: the sampler's words are no PCG64 state")
    rng = np.random.Generator(np.random.PCG64())
    rng.bit_generator.state = {"bit_generator": "PCG64",
                               "state": {"state": (core_hi << 64) | core_lo, "inc": (inc_hi << 64) | inc_lo},
                               "has_uint32": has_half, "uinteger": half}
    return rng


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
                    updates: int, keep: float | None = None, gamma: float | None = None,
                    sampler: np.ndarray | None = None, network: dict[str, np.ndarray] | None = None
                    ) -> Path:
    """Write this party's block for the epoch just finished without losing the last marked one.

    ``keep`` is the last epoch the leader marked complete (``None``: none of this run yet). The newest
    file moves onto the previous one only when it holds ``keep``; otherwise it holds an epoch never
    marked (left by a crash before the mark) and is simply overwritten, so the file holding ``keep``
    (then the previous one) survives until a newer epoch is marked."""
    path = checkpoint_path(out, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    held = epochs_in(path) if keep is not None else None
    if held is not None and abs(held - keep) <= 1e-9:
        os.replace(path, _previous_path(out, rank))
    extra = {} if gamma is None else {"gamma": gamma}
    if sampler is not None:
        extra["sampler"] = sampler
    for name, value in (network or {}).items():
        extra[NETWORK + name] = value
    atomic_write(path, lambda fh: np.savez(fh, w=w, epochs=epochs, train_time=train_time, updates=updates,
                                           **extra))
    return path



def holds_network(folder: str | Path, rank: int) -> bool:
    """Whether party ``rank``'s newest file in ``folder`` holds a network (``--model mlp``): the
    member names only, no array is read."""
    try:
        with np.load(checkpoint_path(folder, rank), allow_pickle=False) as z:
            return any(name.startswith(NETWORK) for name in z.files)
    except (OSError, ValueError):
        return False


def mark_complete(out: str | Path, epochs: float) -> None:
    """Leader: every party has written the epoch, so it is the one to resume from."""
    text = json.dumps({"epochs": epochs}).encode()
    atomic_write(Path(out) / MANIFEST, lambda fh: fh.write(text))


def metrics_before(path: Path, epochs: float) -> None:
    """Resume: keep only the records of ``metrics.jsonl`` before the resumed epoch ``epochs``.

    The run evaluates again at the epoch it resumes from, and a crash before the mark may have logged
    epochs past it that the resumed run trains again; each epoch is logged once, in order. Lines that
    are not a record with a finite epoch (a line cut short by the crash) are dropped."""
    if not path.exists():
        return
    kept = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                record = json.loads(line, parse_constant=_no_constant)
                epoch = _finite_epochs(record["epoch"], str(path))
            except (ValueError, KeyError, TypeError, RecursionError):
                continue
            if epoch < epochs - 1e-9:
                kept.append(line if line.endswith("\n") else line + "\n")
    text = "".join(kept).encode()
    atomic_write(path, lambda fh: fh.write(text))


def _finite_epochs(value: object, where: str) -> float:
    """An epoch count read back from a file or a peer: a finite, non-negative number no run exceeds
    (a NaN or an infinity would make ``--resume`` train forever; a bool is no count)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: the epoch count {value!r} is not a number; start without --resume")
    epochs = float(value)
    if not math.isfinite(epochs) or not 0 <= epochs <= MAX_EPOCHS:
        raise ValueError(f"{where}: the epoch count {epochs!r} is not a finite count between 0 and "
                         f"{MAX_EPOCHS:g}; start without --resume")
    return epochs


def complete_epochs(out: str | Path) -> float:
    """The newest epoch every party completed; one clear error when the run has none or the manifest
    is not the small ``{"epochs": <finite count>}`` this module writes."""
    path = Path(out) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{out}: no complete checkpoint to resume from ({MANIFEST} is missing); "
                                "start without --resume")
    damaged = f"{path} is damaged"
    try:
        with open(path, "rb") as fh:
            text = fh.read(MANIFEST_MAX_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{damaged} ({exc.strerror}): start without --resume") from None
    if len(text) > MANIFEST_MAX_BYTES:
        raise ValueError(f"{damaged} (over {MANIFEST_MAX_BYTES} bytes): start without --resume")
    try:
        manifest = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"{damaged} (not JSON): start without --resume") from None
    if not isinstance(manifest, dict) or "epochs" not in manifest:
        raise ValueError(f"{damaged} (no epoch count): start without --resume")
    return _finite_epochs(manifest["epochs"], damaged)


def _no_constant(name: str) -> float:
    """JSON's NaN and Infinity are no counts: refused while parsing."""
    raise ValueError(f"{name} is no epoch count")


def _read(path: Path, n_features: int | None = None, network: NetworkShapes | None = None
          ) -> tuple[dict[str, np.ndarray], tuple[int, ...]]:
    """A party file's counters, and its block when it has ``n_features`` weights (else not read), with
    the block's shape; with ``network`` (each array's name and shape), the network's arrays too, exactly
    those. No pickles, and no array is read before its header says it is the size it should be (a
    planted file could announce gigabytes); any damage is a ``ValueError`` naming it."""
    try:
        with np.load(path, allow_pickle=False) as z:
            for key in ("epochs", "train_time", "updates"):
                if npz_member_shape(z, key) != ():
                    raise ValueError(f"{key} is not one number")
            arrays = {key: z[key] for key in ("epochs", "train_time", "updates")}
            if "gamma" in z.files:
                if npz_member_shape(z, "gamma") != ():
                    raise ValueError("gamma is not one number")
                arrays["gamma"] = z["gamma"]
            if "sampler" in z.files:
                if npz_member_shape(z, "sampler") != (SAMPLER_WORDS,):
                    raise ValueError(f"the sampler is not {SAMPLER_WORDS} words")
                arrays["sampler"] = z["sampler"]
            shape = npz_member_shape(z, "w")
            if n_features is not None and shape == (n_features,):
                arrays["w"] = z["w"]
            if network is not None:
                arrays.update(_network_arrays(z, network))
            return arrays, shape
    except (OSError, KeyError, EOFError, ValueError) as exc:
        raise ValueError(f"{path} is damaged ({exc})") from None


def _network_arrays(z: np.lib.npyio.NpzFile, network: NetworkShapes
                    ) -> dict[str, np.ndarray]:
    """The network's arrays of a party file: names this party's network may hold (``network[0]``, with
    their shapes), every one it must (``network[1]``, its parameters), each of its shape."""
    allowed, required = network
    held = {name[len(NETWORK):] for name in z.files if name.startswith(NETWORK)}
    if not required <= held <= set(allowed):
        missing, extra = sorted(required - held), sorted(held - set(allowed))
        raise ValueError(f"its network differs from this party's (missing {missing[:3]}, unexpected "
                         f"{extra[:3]}): was the run trained with other --bottom/--top?")
    arrays = {}
    for name in sorted(held):
        shape = allowed[name]
        if npz_member_shape(z, NETWORK + name) != tuple(shape):
            raise ValueError(f"its network's {name} has shape {npz_member_shape(z, NETWORK + name)}, this "
                             f"party's has {tuple(shape)}")
        value = z[NETWORK + name]
        if value.dtype.kind not in "iuf" or not np.all(np.isfinite(value)):
            raise ValueError(f"its network's {name} is not finite numbers")
        arrays[NETWORK + name] = value
    return arrays


def npz_member_shape(z: np.lib.npyio.NpzFile, key: str) -> tuple[int, ...]:
    """The shape the header of the array ``key`` of an npz announces, read without the array (a planted
    file could announce gigabytes)."""
    with z.zip.open(f"{key}.npy") as fh:
        version = np.lib.format.read_magic(fh)
        fmt = np.lib.format
        read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, _, _ = read(fh)
    return shape


def _scalar(z: dict[str, np.ndarray], key: str, path: Path) -> float | int:
    """One numeric scalar of a party file, refused unless it is a real number of one element."""
    a = z[key]
    if a.shape != () or a.dtype.kind not in "iuf":
        raise ValueError(f"{path} is damaged: {key} is not a number")
    return a.item()


def _restored(path: Path, rank: int, n_features: int, epochs: float,
              network: NetworkShapes | None = None) -> Checkpoint:
    """The block and counters of a party file whose epoch matched, each checked before use."""
    z, shape = _read(path, n_features, network)
    if shape != (n_features,):
        raise ValueError(f"party {rank}: checkpoint {path} has a block of shape {shape}, "
                         f"this party holds {n_features} features")
    train_time = _scalar(z, "train_time", path)
    updates = _scalar(z, "updates", path)
    if not math.isfinite(train_time) or train_time < 0:
        raise ValueError(f"{path} is damaged: train_time {train_time!r} is not a finite duration")
    if isinstance(updates, float) or not 0 <= updates <= MAX_UPDATES:
        raise ValueError(f"{path} is damaged: updates {updates!r} is not a count")
    w = z["w"]
    if w.dtype.kind not in "iuf":
        raise ValueError(f"{path} is damaged: the block is not numbers")
    w = w.astype(np.float64)
    if not np.all(np.isfinite(w)):
        raise ValueError(f"{path} is damaged: the block holds NaN or infinite weights")
    gamma = _scalar(z, "gamma", path) if "gamma" in z else None
    if gamma is not None and not (math.isfinite(gamma) and gamma > 0):
        raise ValueError(f"{path} is damaged: gamma {gamma!r} is not a positive step")
    sampler = z.get("sampler")
    if sampler is not None:
        sampler_from_words(sampler, str(path))  # refused here, before any rank trains from it
    held = (None if network is None
            else {name[len(NETWORK):]: value for name, value in z.items() if name.startswith(NETWORK)})
    return Checkpoint(w, epochs, float(train_time), int(updates), None if gamma is None else float(gamma),
                      sampler, held)


def epochs_in(path: Path) -> float | None:
    """The epoch a party file holds; ``None`` when there is none or it is unreadable."""
    try:
        return _finite_epochs(_scalar(_read(path)[0], "epochs", path), str(path))
    except (FileNotFoundError, ValueError):
        return None


def load_checkpoint(folder: str | Path, rank: int, n_features: int, epochs: float,
                    network: NetworkShapes | None = None) -> Checkpoint:
    """This party's block of the complete epoch ``epochs`` (the leader's :func:`complete_epochs`) from
    its own folder (with ``network``, the names and shapes of its network's arrays: those are read
    too); stale temporary files there are removed. A file that is unreadable or holds another
    epoch is passed over (the other may hold it); the one that holds it is checked whole."""
    epochs = _finite_epochs(epochs, f"party {rank}: the complete epoch to resume from")
    for stale in Path(folder).glob(f"party-{rank}.*.tmp"):
        stale.unlink()
    damaged = []
    for path in (checkpoint_path(folder, rank), _previous_path(folder, rank)):
        if not path.exists():
            continue
        try:
            held = _finite_epochs(_scalar(_read(path)[0], "epochs", path), f"{path} is damaged")
        except ValueError as exc:
            damaged.append(str(exc))
            continue
        if abs(held - epochs) <= 1e-9:
            return _restored(path, rank, n_features, epochs, network)
    raise FileNotFoundError(f"party {rank}: no checkpoint of the complete epoch {epochs:g} in {folder}"
                            + "".join(f"; {why}" for why in damaged))
