"""Synthetic stand-ins for the VFB² paper's D3 (news20.binary) and D4 (webspam): LIBSVM files with the
real sets' width and nonzeros per row, for when the real files cannot be had.

The real files cannot be fetched here, but the runtime's cost depends on their *shape*: the block
widths d_l, the nonzeros per row, and how unevenly the columns are used. ``write_standin`` writes a
file with that shape, streamed row by row (memory does not grow with the row count or the width):

- **width**: news20.binary's 1,355,191 or webspam's 16,609,143 columns (the paper's Table 1);
- **nonzeros per row**: log-normal around the real file's mean (the paper gives no nnz; LIBSVM's
  page does: news20.binary 9,097,916 nonzeros over 19,996 rows ≈ 455 a row, webspam trigram
  1,304,697,446 over 350,000 ≈ 3,728 a row);
- **column use**: Zipf-like popularity (rank r drawn with probability ∝ r^-s, s = 1), ranks mapped
  to columns by a seeded affine bijection so that popular columns are spread over every party;
- **values**: positive (tf-idf-like, log-normal), each row scaled to unit ℓ2 norm, as in both sets;
- **labels**: the sign of a planted sparse model w*·x (5 % of the columns carry a Gaussian weight,
  decided by a hash of the column, so w* is never stored), flipped with probability ``label_noise``.

Every file says what it is twice: a ``# vfl stand-in`` comment as its first line (LIBSVM readers skip
comments) and a sidecar ``<file>.stand-in.json`` with the generator's parameters and the realised
statistics. The registry loads it only through the ``*-standin`` names, so a result on it says so.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

FORMAT = "vfl-stand-in/1"
SIDECAR_SUFFIX = ".stand-in.json"
_ROWS_PER_WRITE = 256


@dataclass(frozen=True)
class StandInShape:
    """The published shape a stand-in imitates."""

    name: str
    of: str
    n_rows: int
    n_features: int
    mean_nnz: float
    source: str


SHAPES = {
    "news20": StandInShape("news20-standin", "news20", 19_996, 1_355_191, 9_097_916 / 19_996,
                           "LIBSVM news20.binary: 19,996 rows, 1,355,191 features, 9,097,916 nonzeros"),
    "webspam": StandInShape("webspam-standin", "webspam", 350_000, 16_609_143, 1_304_697_446 / 350_000,
                            "LIBSVM webspam (trigram): 350,000 rows, 16,609,143 features, "
                            "1,304,697,446 nonzeros"),
}


def standin_file_name(shape: str) -> str:
    """The file name ``vfl synth`` writes and the registry looks for: ``<name>-standin.svm``."""
    return f"{SHAPES[shape].name}.svm"


def sidecar_path(path: str | os.PathLike[str]) -> Path:
    return Path(f"{path}{SIDECAR_SUFFIX}")


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A fixed 64-bit mixing function: w*'s support and weights are a hash of the column index."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class _Generator:
    """Rows of one stand-in: draws columns, values and the label of each row."""

    def __init__(self, n_features: int, mean_nnz: float, seed: int, *, zipf_exponent: float,
                 nnz_sigma: float, planted_fraction: float, label_noise: float) -> None:
        self.d = n_features
        self.rng = np.random.default_rng(seed)
        self.s = zipf_exponent
        self.sigma = nnz_sigma
        self.mu = math.log(mean_nnz) - nnz_sigma**2 / 2  # so that E[nnz] = mean_nnz before clipping
        self.noise = label_noise
        self.planted_per = max(1, round(1 / planted_fraction))
        self.salt = np.uint64(int(self.rng.integers(2**63)))
        self.stride = self._coprime_stride()
        self.offset = int(self.rng.integers(n_features))

    def _coprime_stride(self) -> int:
        while True:
            a = int(self.rng.integers(self.d // 3 + 1, 2 * self.d // 3 + 2))
            if math.gcd(a, self.d) == 1:
                return a

    def _ranks(self, size: int) -> np.ndarray:
        """Zipf-like ranks in 0..d-1 by inverting the continuous power law's CDF on [1, d + 1)."""
        u = self.rng.random(size)
        if abs(self.s - 1.0) < 1e-12:
            r = np.exp(u * math.log(self.d + 1.0))
        else:
            e = 1.0 - self.s
            r = (1.0 + u * ((self.d + 1.0) ** e - 1.0)) ** (1.0 / e)
        return np.minimum(r.astype(np.int64) - 1, self.d - 1)

    def _columns(self, k: int) -> np.ndarray:
        """k distinct columns: Zipf draws without replacement (repeats skipped in draw order)."""
        drawn = np.empty(0, dtype=np.int64)
        while True:
            drawn = np.concatenate([drawn, self._ranks(2 * k + 16)])
            unique, first = np.unique(drawn, return_index=True)
            if unique.size >= k:
                ranks = unique[np.sort(np.argsort(first)[:k])] if unique.size > k else unique
                break
        return np.sort((ranks * self.stride + self.offset) % self.d)

    def planted_weights(self, columns: np.ndarray) -> np.ndarray:
        """w*_j: Gaussian on the columns whose hash falls in the planted fraction, 0 elsewhere."""
        h = _splitmix64(columns.astype(np.uint64) ^ self.salt)
        planted = (h % np.uint64(self.planted_per)) == 0
        h2 = _splitmix64(h)
        u1 = ((h2 >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53
        u2 = ((_splitmix64(h2) >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53
        gauss = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
        return np.where(planted, gauss, 0.0)

    def row(self) -> tuple[float, np.ndarray, np.ndarray, bool, bool]:
        """(label, columns, values, flipped, tied) of the next row; ``tied``: w*·x = 0, the label is
        a coin toss."""
        k = int(np.clip(round(self.rng.lognormal(self.mu, self.sigma)), 1, self.d))
        columns = self._columns(k)
        values = self.rng.lognormal(0.0, 1.0, size=k)
        values /= np.linalg.norm(values)
        margin = float(values @ self.planted_weights(columns))
        label = 1.0 if margin > 0 else -1.0 if margin < 0 else float(self.rng.choice((-1.0, 1.0)))
        flipped = bool(self.rng.random() < self.noise)
        return (-label if flipped else label), columns, values, flipped, margin == 0


def _check_parameters(spec: StandInShape, rows: int, target: float, zipf_exponent: float,
                      planted_fraction: float, label_noise: float) -> None:
    """Refuse, before any byte is written, what would make a file of the wrong shape or never finish."""
    if rows < 1:
        raise ValueError(f"--rows must be at least 1, got {rows}")
    if not 1 <= target <= spec.n_features / 4:
        raise ValueError(f"--mean-nnz must be between 1 and {spec.n_features // 4:,}, got {target:g}")
    if not 0 <= label_noise < 0.5:
        raise ValueError(f"--label-noise must be in [0, 0.5), got {label_noise:g}")
    if not 0 < planted_fraction <= 1:
        raise ValueError(f"planted_fraction must be in (0, 1], got {planted_fraction:g}")
    if zipf_exponent <= 0:
        raise ValueError(f"zipf_exponent must be positive, got {zipf_exponent:g}")


@dataclass
class _Tally:
    """The realised statistics the sidecar reports, counted as the rows are written."""

    nnz: int = 0
    max_nnz: int = 0
    positives: int = 0
    flips: int = 0
    ties: int = 0

    def add(self, label: float, nnz: int, flipped: bool, tied: bool) -> None:
        self.nnz += nnz
        self.max_nnz = max(self.max_nnz, nnz)
        self.positives += label > 0
        self.flips += flipped
        self.ties += tied


def _libsvm_line(label: float, columns: np.ndarray, values: np.ndarray) -> str:
    """One row as LIBSVM text: the label as ``+1``/``-1``, then ``column:value`` pairs with 1-based
    columns (the LIBSVM convention) and values to 7 significant digits."""
    pairs = np.empty(2 * columns.size, dtype=object)
    pairs[0::2], pairs[1::2] = (columns + 1).tolist(), values.tolist()
    return f"{label:+.0f} " + ("%d:%.7g " * columns.size % tuple(pairs)).rstrip()


def _write_rows(f, gen: _Generator, rows: int) -> _Tally:
    """``rows`` rows of ``gen``, written ``_ROWS_PER_WRITE`` lines at a time."""
    tally = _Tally()
    lines = []
    for _ in range(rows):
        label, columns, values, flipped, tied = gen.row()
        lines.append(_libsvm_line(label, columns, values))
        tally.add(label, columns.size, flipped, tied)
        if len(lines) == _ROWS_PER_WRITE:
            f.write("\n".join(lines) + "\n")
            lines.clear()
    if lines:
        f.write("\n".join(lines) + "\n")
    return tally


def write_standin(path: str | os.PathLike[str], shape: str, *, n_rows: int | None = None, seed: int = 0,
                  mean_nnz: float | None = None, zipf_exponent: float = 1.0, nnz_sigma: float = 0.8,
                  planted_fraction: float = 0.05, label_noise: float = 0.05,
                  overwrite: bool = False) -> dict:
    """Write a stand-in LIBSVM file (1-based indices) for ``shape`` ("news20" or "webspam") and its
    sidecar; returns the sidecar's contents. Same arguments and seed give the same bytes.

    ``n_rows`` defaults to the real file's row count; ``mean_nnz`` to the real file's mean nonzeros
    per row (lower it to make a file of the real width that fits a small machine).
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown stand-in shape {shape!r}; choose one of {', '.join(SHAPES)}")
    spec = SHAPES[shape]
    rows = spec.n_rows if n_rows is None else int(n_rows)
    target = spec.mean_nnz if mean_nnz is None else float(mean_nnz)
    _check_parameters(spec, rows, target, zipf_exponent, planted_fraction, label_noise)
    out = Path(path)
    if (out.exists() or sidecar_path(out).exists()) and not overwrite:
        raise FileExistsError(f"{out} already exists; pass --overwrite to replace it")
    gen = _Generator(spec.n_features, target, seed, zipf_exponent=zipf_exponent, nnz_sigma=nnz_sigma,
                     planted_fraction=planted_fraction, label_noise=label_noise)
    params = {"shape": shape, "rows": rows, "seed": seed, "mean_nnz_target": target,
              "zipf_exponent": zipf_exponent, "nnz_lognormal_sigma": nnz_sigma,
              "planted_fraction": planted_fraction, "label_noise": label_noise}
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="ascii") as f:
        f.write(f"# vfl stand-in for {spec.of} (NOT the real data): {spec.name}, {spec.n_features} features, "
                f"{json.dumps(params, sort_keys=True)}\n")
        tally = _write_rows(f, gen, rows)
    info = {"format": FORMAT, "name": spec.name, "stand_in_for": spec.of, "real_shape": asdict(spec),
            "n_rows": rows, "n_features": spec.n_features, "nnz": tally.nnz, "mean_nnz": tally.nnz / rows,
            "max_nnz": tally.max_nnz, "positive_fraction": tally.positives / rows,
            "flipped_fraction": tally.flips / rows, "coin_toss_fraction": tally.ties / rows,
            "parameters": params, "file": out.name,
            "note": "synthetic stand-in: same width and nonzeros per row as the real file, not its content"}
    os.replace(tmp, out)
    sidecar_path(out).write_text(json.dumps(info, indent=2) + "\n")
    return info


def read_sidecar(path: str | os.PathLike[str]) -> dict:
    """The sidecar of a stand-in file; a file without a valid one is not treated as a stand-in."""
    side = sidecar_path(path)
    try:
        info = json.loads(side.read_text())
        if info.get("format") != FORMAT:
            raise ValueError(f"format {info.get('format')!r}, expected {FORMAT!r}")
        int(info["n_rows"]), int(info["n_features"]), str(info["name"])
        return info
    except (OSError, ValueError, KeyError, TypeError) as error:
        from vertical.datasets.validation import DataValidationError

        raise DataValidationError(f"{path}: no valid stand-in sidecar {side.name} ({error}); write the "
                                  f"file with `vfl synth`") from None
