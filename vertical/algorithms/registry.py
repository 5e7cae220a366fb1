"""Every VFL algorithm the runtime can run, by name: its update rule and how the runtime drives it.

One entry per algorithm, and the CLI's choices, the configuration check and the launcher all read it,
so a new algorithm is one entry here (or, for a new update rule, one class in
:mod:`vertical.algorithms.vfb2`, which registers itself in ``RULES`` and appears here by that alone).

An algorithm is an update rule plus runtime flags. AFSVRG-VP, the paper's baseline, is the SVRG rule
with the backward-updating dispatcher switched off: only the dominators' own blocks ever move.
"""

from __future__ import annotations

from dataclasses import dataclass

from vertical.algorithms.vfb2 import RULES, UpdateRule

#: How the dominators run: asynchronous VFB²; the synchronous VFB baseline with each dominator waiting
#: for every party's acknowledgement of its step (``sync``, per dominator: dominators do not wait for
#: each other); and ``sync-global``, where every step also waits for all dominators, in lockstep.
MODES = ("async", "sync", "sync-global")


@dataclass(frozen=True)
class VFLAlgorithm:
    """How the runtime runs one named algorithm."""

    name: str
    rule: type[UpdateRule]
    summary: str
    #: Whether a dominator broadcasts (ϑ, i) so that every party updates its own block.
    dispatch: bool = True
    #: The ``--mode`` values that make sense for it.
    modes: tuple[str, ...] = MODES


def _rule_summary(rule: type[UpdateRule]) -> str:
    doc = (rule.__doc__ or rule.name).strip().splitlines()[0]
    return doc.replace("``", "").rstrip(".")


ALGORITHMS: dict[str, VFLAlgorithm] = {
    **{name: VFLAlgorithm(name, rule, _rule_summary(rule)) for name, rule in RULES.items()},
    "afsvrg-vp": VFLAlgorithm("afsvrg-vp", RULES["svrg"],
                              "AFSVRG-VP baseline: SVRG without backward updating (passive blocks stay 0)",
                              dispatch=False, modes=("async",)),
}


def get_algorithm(name: str) -> VFLAlgorithm:
    """The algorithm registered under ``name``; a one-line error listing the choices otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown --algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}") from None
