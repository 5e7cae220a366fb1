"""The plotting conventions of ``experiments/`` (see ``docs/plots.md``), in one place.

* **One legend per figure**, drawn at figure level below the panels. A legend on one panel names the
  lines of the other panels only if they were drawn in the same order with the same colours, and the
  FedBAT curves showed that this silently breaks (a 10 % line labelled "fedavg" on the non-IID panels).
* **A fixed colour per method**, taken from a dict built once per figure, so a method has the same
  colour on every panel whatever order its rows come in.
* **Every axis labelled**, with units: :func:`check_labelled` refuses a figure that forgets one.

matplotlib is imported lazily with the Agg backend: experiments and tests run headless.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

#: matplotlib's tab10, in order: the colours of the methods of one figure
PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
           "tab:gray", "tab:olive", "tab:cyan")


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def colours(keys: Iterable[Any], fixed: Mapping[Any, str] | None = None) -> dict[Any, str]:
    """key -> colour for every key, in first-seen order; ``fixed`` entries win. Pass the keys in a
    stable order (a module constant, sorted values), never the order rows happened to arrive in."""
    fixed = dict(fixed or {})
    free = [c for c in PALETTE if c not in fixed.values()]
    out: dict[Any, str] = {}
    for key in dict.fromkeys(keys):
        out[key] = fixed[key] if key in fixed else free[sum(k not in fixed for k in out) % len(free)]
    return out


def figure_legend(fig: Any, *, ncol: int | None = None, title: str | None = None, **kwargs: Any) -> Any:
    """One legend for the whole figure, below the panels, with every label found on any panel once.
    Panel legends are removed. The figure should use ``layout="constrained"`` so the legend gets room."""
    handles: dict[str, Any] = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
        if ax.get_legend() is not None:
            ax.get_legend().remove()
    if not handles:
        return None
    ncol = ncol or min(len(handles), 6)
    return fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncol=ncol,
                      fontsize=8, title=title, title_fontsize=8, frameon=False, **kwargs)


def check_labelled(fig: Any) -> None:
    """Raise if a panel lacks an x or y label (a figure nobody can read without the code)."""
    for ax in fig.axes:
        if not ax.get_xlabel() or not ax.get_ylabel():
            raise ValueError(f"panel {ax.get_title()!r} lacks an axis label")


def save(fig: Any, path: Any, dpi: int = 110) -> None:
    """Check the conventions, write the PNG, release the figure."""
    check_labelled(fig)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def repetitions_figure(path: Any, series: Mapping[str, tuple[str, list[float]]], *, title: str,
                       ylabel: str = "ms per dominated update",
                       reference: tuple[str, str, float] | None = None) -> None:
    """One value per repetition of variants that were run alternately (name -> (colour, values)),
    with an optional horizontal ``(label, colour, value)`` line: the A/B benchmarks' figure."""
    fig, ax = pyplot().subplots(figsize=(5.5, 3.8), layout="constrained")
    for name, (colour, values) in series.items():
        ax.plot(range(1, len(values) + 1), values, "o-", color=colour, label=name)
    if reference is not None:
        label, colour, value = reference
        ax.axhline(value, color=colour, ls=":", label=label)
    repeats = max((len(values) for _, values in series.values()), default=0)
    ax.set(xlabel="repetition (variants alternate)", ylabel=ylabel, title=title, xticks=range(1, repeats + 1))
    ax.set_ylim(bottom=0)
    figure_legend(fig)
    save(fig, path, dpi=120)
