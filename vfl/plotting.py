"""``vfl plot``: the metrics of one or more ``vfl train`` runs as one PNG, and each run's metrics as CSV.

A run writes ``metrics.jsonl`` (one record per evaluation: ``epoch``, ``time`` in training seconds,
``updates``, ``loss``, optionally ``suboptimality``, ``test_accuracy`` or ``test_rmse``). People compare
runs by looking, and open tables in a spreadsheet, so this draws loss, sub-optimality (log scale) and the
test metric against training time or epochs, and writes ``metrics.csv`` beside each ``metrics.jsonl``.
The figure follows the conventions of ``experiments/_plotting.py``: one legend, one colour per run on
every panel, labelled axes. matplotlib (Agg backend) is imported only when a figure is drawn.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: the fields ``metrics.csv`` starts with, in this order; any others follow, sorted
COLUMNS = ("epoch", "time", "updates", "loss", "suboptimality", "test_accuracy", "test_rmse")
#: y-axis panels: (field, label, log scale)
#: (``train_loss`` is a horizontal run's: ``python -m parties.hfl`` writes rounds, not epochs)
PANELS = (("loss", "training loss f(w)", False), ("train_loss", "training loss", False),
          ("suboptimality", "sub-optimality f(w) − f*", True),
          ("test_accuracy", "test accuracy (%)", False), ("test_rmse", "test RMSE", False))
X_LABELS = {"time": "training time (s)", "epoch": "epochs", "round": "rounds"}
PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
           "tab:gray", "tab:olive", "tab:cyan")


class PlotError(ValueError):
    """A user-facing problem with a run folder (``vfl plot`` prints it as one line, exit 2)."""


def read_metrics(run: str | Path) -> list[dict[str, Any]]:
    """The records of ``run/metrics.jsonl`` (or of the file itself); a :class:`PlotError` naming the file
    and line when it is missing, empty or not JSON."""
    path = Path(run)
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.exists():
        where = path.parent if path.name == "metrics.jsonl" else path
        raise PlotError(f"{where}: no metrics.jsonl (is it the --out folder of a `vfl train` run?)")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise PlotError(f"{path}:{number}: not a JSON record ({err.msg})") from None
        if not isinstance(record, dict):
            raise PlotError(f"{path}:{number}: not a JSON object")
        records.append(record)
    if not records:
        raise PlotError(f"{path}: empty, no evaluation was recorded")
    return records


def write_metrics_csv(run: str | Path) -> Path:
    """Write ``metrics.csv`` beside the run's ``metrics.jsonl`` (same records, one column per field)."""
    records = read_metrics(run)
    path = Path(run)
    path = (path if path.is_dir() else path.parent) / "metrics.csv"
    fields = [c for c in COLUMNS if any(c in r for r in records)]
    fields += sorted({k for r in records for k in r} - set(fields))
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(records)
    return path


def run_label(run: str | Path) -> str:
    """The run's folder name, with ``algorithm/mode`` from its ``config.json`` when there is one."""
    path = Path(run)
    folder = path if path.is_dir() else path.parent
    name = folder.resolve().name if folder.name in ("", ".", "latest") else folder.name
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return name
    if not isinstance(config, dict):
        return name
    parts = [str(config[k]) for k in ("algorithm", "mode") if config.get(k)]
    return f"{name} ({'/'.join(parts)})" if parts else name


def plot_runs(runs: Sequence[str | Path], out: str | Path | None = None, x: str | None = None) -> Path:
    """Draw the runs' metrics into one PNG (default ``<first run>/metrics.png``) and write each run's
    ``metrics.csv``; return the PNG's path. ``x`` is ``"time"`` (training seconds), ``"epoch"`` or
    ``"round"`` (horizontal runs); ``None`` takes time where the runs record it, else rounds."""
    if x is not None and x not in X_LABELS:
        raise PlotError(f"--x must be one of {', '.join(X_LABELS)} (got {x!r})")
    if not runs:
        raise PlotError("no run given")
    data = [(run_label(run), read_metrics(run)) for run in runs]   # every error before any output
    x = x or default_x(data)
    for run in runs:
        write_metrics_csv(run)
    first = Path(runs[0])
    out = Path(out) if out is not None else (first if first.is_dir() else first.parent) / "metrics.png"
    fig = figure(data, x)
    fig.savefig(out, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return out


def default_x(data: Sequence[tuple[str, list[dict[str, Any]]]]) -> str:
    """Training time when any run records it (``vfl train``), else rounds (``python -m parties.hfl``)."""
    for field in ("time", "round"):
        if any(_finite(r.get(field)) for _, records in data for r in records):
            return field
    raise PlotError("the runs' metrics.jsonl record neither training time nor rounds to plot against")


def figure(data: Sequence[tuple[str, list[dict[str, Any]]]], x: str = "time") -> Any:
    """The Figure of :func:`plot_runs`: one panel per metric present in any run, one legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in PANELS
              if any(_finite(r.get(p[0])) and _finite(r.get(x)) for _, recs in data for r in recs)]
    if not panels:
        raise PlotError(f"no loss, sub-optimality or test metric recorded with '{x}' in the runs' "
                        f"metrics.jsonl (choose --x among {', '.join(X_LABELS)})")
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.9), squeeze=False,
                             layout="constrained")
    for i, (label, records) in enumerate(data):
        colour = PALETTE[i % len(PALETTE)]   # run i has this colour on every panel
        for ax, (field, _, log) in zip(axes[0], panels, strict=True):
            pts = [(r[x], r[field]) for r in records if _finite(r.get(x)) and _finite(r.get(field))]
            if field == "test_accuracy":
                pts = [(a, 100 * b) for a, b in pts]
            if log:
                pts = [(a, max(b, 1e-16)) for a, b in pts]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", ms=3, color=colour, label=label)
    for ax, (_, ylabel, log) in zip(axes[0], panels, strict=True):
        ax.set(xlabel=X_LABELS[x], ylabel=ylabel, yscale="log" if log else "linear")
        ax.grid(alpha=0.3)
    handles = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    fig.legend(list(handles.values()), list(handles), loc="outside lower center",
               ncol=min(len(handles), 3), fontsize=8, frameon=False)
    return fig


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
