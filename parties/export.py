"""``vfl export``: each party writes its own part of a trained model, for use outside vfl.

Nobody holds the whole model, so nobody can export it: party ``r`` exports only what it holds, from its
own folder (``--party-dir``, by default the run folder): its block ``w_r`` of the complete epoch the
run marked, the ``--standardize`` statistics it scales its raw columns with (``standardize-<r>.npz``),
and the schema of the columns it expects (names from its party file or CSV header where present, its
global column indices where known, else positions). Each part is two files in ``--out``:

* ``party-<r>.export.json``: a small manifest (format, version, party, q, problem and output link, the
  id column, the width, the standardisation mode, the epoch, the SHA-256 of the arrays file);
* ``party-<r>.export.npz``: the arrays ``w``, and where they apply ``shift``/``scale``, ``columns``,
  ``feature_names`` (plain arrays: no pickle).

The score of a row is Σ_r w_r·((x_r − shift_r)/scale_r), the same sum ``vfl predict`` computes by secure
aggregation; :func:`combined_scores` recombines parts held in one place (a test, or organisations that
agree to pool their parts). A network party's part (``--model mlp``) holds its network's layers
instead of ``w`` (:mod:`parties.export_network`). Parts are read back as untrusted input, as checkpoints are
(:mod:`parties.checkpoint`): a bounded manifest, array headers checked before any array is read.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from parties.checkpoint import atomic_write, holds_network, load_checkpoint
from parties.export_network import NetworkExport

FORMAT = "vfl-party-export"
VERSION = 1
#: the party files' id column (``vfl split``'s and ``vfl align``'s): what a row is keyed by
ID_COLUMN = "id"
#: a manifest holds no per-column list: anything larger is not one this module wrote
MANIFEST_MAX_BYTES = 16384
#: more columns than any party file holds (int32 indices): a larger width is damage
MAX_FEATURES = 2**31 - 1
#: the longest column name a part holds (a header announcing wider strings would allocate n times it)
MAX_NAME_CHARS = 256
#: the output link of each problem: the score w·x is turned into the prediction by it
LINKS = {"logistic": "sigmoid", "nonconvex-logistic": "sigmoid", "least-squares": "identity",
         "robust": "identity"}


@dataclass(frozen=True)
class PartyExport:
    """One party's exported part: its block, its scaling (None: ``--standardize off``) and its schema."""

    party: int
    parties: int
    problem: str
    epochs: float
    w: np.ndarray
    standardize: str = "off"
    shift: np.ndarray | None = None
    scale: np.ndarray | None = None
    columns: np.ndarray | None = None
    feature_names: tuple[str, ...] | None = None
    id_column: str = ID_COLUMN
    model = "linear"

    @property
    def n_features(self) -> int:
        return int(self.w.size)

    @property
    def link(self) -> str:
        return LINKS[self.problem]

    def partial_scores(self, X) -> np.ndarray:
        """w_r·x_r of each row of this party's raw columns ``X`` (in the schema's order)."""
        if X.ndim != 2 or X.shape[1] != self.n_features:
            raise ValueError(f"party {self.party}: its part takes {self.n_features} columns, got shape "
                             f"{X.shape}")
        w = self.w if self.scale is None else self.w / self.scale
        offset = 0.0 if self.shift is None else float(w @ self.shift)
        dense = X if sp.issparse(X) else np.asarray(X, dtype=np.float64)
        return np.asarray(dense @ w, dtype=np.float64).ravel() - offset


def part_paths(out: str | Path, rank: int) -> tuple[Path, Path]:
    return Path(out) / f"party-{rank}.export.json", Path(out) / f"party-{rank}.export.npz"


def export_party(run: str | Path, rank: int, out: str | Path, *, overwrite: bool = False,
                 data: str | Path | None = None) -> PartyExport:
    """Party ``rank`` writes its part into ``out``, reading only its own folder and party file. ``run``
    is a ``vfl train`` run folder or the party's ``vfl party`` folder (then ``data`` is its data,
    :mod:`parties.export_source`). One ``ValueError`` line for a rank the run lacks, a part already
    there, or a folder that lacks what the part needs."""
    from parties.export_source import party_source
    from parties.loading import ids_digest, read_own_party, read_scaling

    source = party_source(run, rank, data, tuple(LINKS))
    json_path, npz_path = part_paths(out, rank)
    if not overwrite and (json_path.exists() or npz_path.exists()):
        raise ValueError(f"{json_path} exists: pass --overwrite to replace party {rank}'s part")
    own = read_own_party(source.data, source.active, source.problem)
    if holds_network(source.folder, rank) != (source.model == "mlp"):
        raise ValueError(f"party {rank}'s checkpoint in {source.folder} is not of the run's --model "
                         f"{source.model}")
    shift = scale = None
    if source.standardize != "off":
        digest = np.frombuffer(ids_digest(own.train_ids, np.zeros(0, dtype=np.int64)), dtype=np.uint8)
        scaling = read_scaling(source.scaling, own.n_features, source.standardize, digest)
        shift, scale = scaling.shift, scaling.scale
    part: PartyExport | NetworkExport
    if source.model == "mlp":
        from parties.export_network import trained_part

        part = trained_part(source, own, shift, scale)
    else:
        w = load_checkpoint(source.folder, rank, own.n_features, source.epochs).w
        part = PartyExport(rank, source.parties, source.problem, source.epochs, w, source.standardize,
                           shift, scale, None if own.columns is None else np.asarray(own.columns,
                                                                                      dtype=np.int64),
                           own.feature_names)
    write_part(part, out)
    return part


def write_part(part: PartyExport | NetworkExport, out: str | Path) -> tuple[Path, Path]:
    """The arrays file first, then the manifest naming its digest (each written whole or not at all)."""
    from parties import export_network

    json_path, npz_path = part_paths(out, part.party)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    network = isinstance(part, NetworkExport)
    arrays = export_network.arrays(part) if network else {"w": part.w}
    if part.scale is not None:
        arrays |= {"shift": part.shift, "scale": part.scale}
    if part.columns is not None:
        arrays["columns"] = part.columns
    if part.feature_names is not None:
        if any(len(name) > MAX_NAME_CHARS for name in part.feature_names):
            raise ValueError(f"party {part.party}: a column name is longer than {MAX_NAME_CHARS} characters")
        arrays["feature_names"] = np.asarray(part.feature_names, dtype=np.str_)
    atomic_write(npz_path, lambda fh: np.savez(fh, **arrays))
    manifest = {"format": FORMAT, "version": VERSION, "party": part.party, "parties": part.parties,
                "model": part.model, "problem": part.problem, "link": part.link, "id_column": part.id_column,
                "n_features": part.n_features, "standardize": part.standardize, "epochs": part.epochs,
                "schema": _schema(part), "arrays": npz_path.name,
                "arrays_sha256": _digest(npz_path)}
    if network:
        manifest |= export_network.manifest_fields(part)
    text = (json.dumps(manifest, indent=1) + "\n").encode()
    atomic_write(json_path, lambda fh: fh.write(text))
    return json_path, npz_path


def _digest(path: Path) -> str:
    """SHA-256 of a file, read in pieces (a planted file may be large)."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _member_header(z: np.lib.npyio.NpzFile, key: str) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype the header of the npz member ``key`` announces, read without the array."""
    with z.zip.open(f"{key}.npy") as fh:
        version = np.lib.format.read_magic(fh)
        fmt = np.lib.format
        read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, _, dtype = read(fh)
    return shape, dtype


def _schema(part: PartyExport | NetworkExport) -> str:
    """How the columns are named: by ``feature_names``, by global ``columns`` indices, or by position."""
    if part.feature_names is not None:
        return "names"
    return "columns" if part.columns is not None else "positions"


def read_part(folder: str | Path, rank: int) -> PartyExport | NetworkExport:
    """Party ``rank``'s part from ``folder``, checked whole; any damage is one ``ValueError`` naming it."""
    from parties import export_network

    json_path, npz_path = part_paths(folder, rank)
    manifest = _read_manifest(json_path, rank)
    network = manifest.get("model", "linear") == export_network.MODEL
    layers = None
    if network:
        try:
            layers = export_network.expected_arrays(manifest)
        except ValueError as exc:
            raise ValueError(f"{json_path} is damaged ({exc})") from None
    try:
        digest = _digest(npz_path)
    except OSError as exc:
        raise ValueError(f"{npz_path}: cannot read the part's arrays ({exc.strerror})") from None
    if digest != manifest["arrays_sha256"]:
        raise ValueError(f"{npz_path} is not the arrays {json_path.name} names (its digest differs)")
    arrays = _read_arrays(npz_path, manifest, layers)
    common = {"party": rank, "parties": manifest["parties"], "problem": manifest["problem"],
              "epochs": float(manifest["epochs"]), "standardize": manifest["standardize"],
              "shift": arrays.get("shift"), "scale": arrays.get("scale"), "columns": arrays.get("columns"),
              "feature_names": None if "feature_names" not in arrays
              else tuple(arrays["feature_names"].tolist()), "id_column": manifest["id_column"]}
    if network:
        return export_network.from_arrays(manifest, arrays, common)
    return PartyExport(w=arrays["w"], **common)


def _read_manifest(path: Path, rank: int) -> dict:
    """The manifest, bounded and checked field by field (types and ranges) before anything uses it."""
    try:
        with open(path, "rb") as fh:
            text = fh.read(MANIFEST_MAX_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the part ({exc.strerror})") from None
    if len(text) > MANIFEST_MAX_BYTES:
        raise ValueError(f"{path} is damaged (over {MANIFEST_MAX_BYTES} bytes)")
    try:
        m = json.loads(text)
    except (ValueError, RecursionError):
        raise ValueError(f"{path} is damaged (not JSON)") from None
    ok = (isinstance(m, dict) and m.get("format") == FORMAT and m.get("version") == VERSION
          and _count(m.get("parties"), 1, 2**16) and _count(m.get("party"), 0, 2**16)
          and m["party"] == rank < m["parties"]
          and m.get("model", "linear") in ("linear", "mlp")
          and isinstance(m.get("problem"), str) and m["problem"] in LINKS
          and (m.get("model") == "mlp" or m.get("link") == LINKS[m["problem"]])
          and isinstance(m.get("id_column"), str) and _count(m.get("n_features"), 1, MAX_FEATURES)
          and m.get("standardize") in ("off", "on", "center")
          and isinstance(m.get("epochs"), int | float) and not isinstance(m.get("epochs"), bool)
          and math.isfinite(m["epochs"]) and m["epochs"] >= 0
          and m.get("schema") in ("names", "columns", "positions")
          and isinstance(m.get("arrays_sha256"), str) and len(m["arrays_sha256"]) == 64)
    if not ok:
        raise ValueError(f"{path} is not a {FORMAT} v{VERSION} part of party {rank} (a field is missing "
                         "or out of range)")
    return m


def _count(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _read_arrays(path: Path, manifest: dict, layers: dict | None = None) -> dict[str, np.ndarray]:
    """The arrays the manifest announces, each header checked (shape (n,), or a network's ``layers``:
    name → (shape, dtype)) before the array is read."""
    n = manifest["n_features"]
    wanted = {"w": "f"} if layers is None else {}
    if manifest["standardize"] != "off":
        wanted |= {"shift": "f", "scale": "f"}
    optional = {"columns": "iu", "feature_names": "U"}
    try:
        with np.load(path, allow_pickle=False) as z:
            present = {k: v for k, v in {**wanted, **optional}.items() if k in wanted or k in z.files}
            for key, kinds in present.items():  # every header checked before any array is read
                shape, dtype = _member_header(z, key)
                if shape != (n,):
                    raise ValueError(f"{key} is not {n} entries")
                if dtype.kind not in kinds or dtype.itemsize > 4 * MAX_NAME_CHARS:
                    raise ValueError(f"{key} has dtype {dtype}")
            for key, expected in (layers or {}).items():
                if _member_header(z, key) != expected:
                    raise ValueError(f"{key} is not of shape {expected[0]} and dtype {expected[1]}")
            arrays = {key: z[key] for key in [*present, *(layers or {})]}
    except (OSError, KeyError, EOFError, ValueError) as exc:
        raise ValueError(f"{path} is damaged ({exc})") from None
    for key in ("w", "shift", "scale", *(layers or {})):
        if key in arrays and not np.isfinite(arrays[key]).all():
            raise ValueError(f"{path} is damaged: {key} holds NaN or infinite values")
    if "scale" in arrays and not (arrays["scale"] > 0).all():
        raise ValueError(f"{path} is damaged: a scale is not positive")
    named_by = {"names": "feature_names", "columns": "columns"}.get(manifest["schema"])
    if named_by is not None and named_by not in arrays:  # "positions": the order of w or of the layers
        raise ValueError(f"{path} is damaged: the schema {manifest['schema']!r} has no array")
    return {k: v.astype(np.float64) if k in ("w", "shift", "scale") else v for k, v in arrays.items()}


def read_parts(folder: str | Path) -> list[PartyExport | NetworkExport]:
    """Every party's part from one folder (parts pooled in one place), checked to make one model: the
    same q, model, problem and epoch (a network's: the same k), and a part for each rank 0..q-1."""
    first = read_part(folder, 0)
    parts = [first] + [read_part(folder, r) for r in range(1, first.parties)]

    def kind(part) -> tuple:
        return (part.parties, part.model, part.problem, part.epochs, getattr(part, "k", 1))

    for part in parts[1:]:
        if kind(part) != kind(first):
            raise ValueError(f"{folder}: party {part.party}'s part is of another model (q, model, problem, "
                             "epoch or k differs from party 0's)")
    return parts


def combined_scores(parts: Sequence[PartyExport | NetworkExport], blocks: Sequence) -> np.ndarray:
    """What ``vfl predict`` writes for the rows of the parties' raw column blocks (rows aligned by id):
    Σ_r w_r·x_r, the score w·x; for network parts, the top's logit of the positive class (two classes)
    or the class probabilities (n, C), :func:`parties.export_network.network_scores`."""
    if len(blocks) != len(parts):
        raise ValueError(f"{len(blocks)} column blocks for {len(parts)} parts")
    if all(isinstance(part, NetworkExport) for part in parts):
        from parties.export_network import network_scores

        return network_scores(parts, blocks)
    if any(isinstance(part, NetworkExport) for part in parts):
        raise ValueError("network and linear parts do not make one model")
    return np.sum([part.partial_scores(X) for part, X in zip(parts, blocks, strict=True)], axis=0)
