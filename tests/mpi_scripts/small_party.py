"""The small VFB² party that the tamper scripts run at every rank: ``N_ROWS`` random rows of ``WIDTH``
features (seeded by the rank), the logistic loss, labels at the active ranks. One home, so that each
script says only how its party misbehaves."""

from __future__ import annotations

import numpy as np

from parties.runtime import PartyState
from vertical.algorithms.vfb2 import Block, get_rule
from vertical.problems import get_problem

N_ROWS, WIDTH = 40, 3


def small_party(rank: int, active: bool, rule: str = "sgd", **rule_options) -> PartyState:
    """Rank ``rank``'s state; ``rule_options`` go to the update rule (e.g. ``batch_size``)."""
    rng = np.random.default_rng(rank)
    block = Block.from_matrix(rng.normal(size=(N_ROWS, WIDTH)))
    problem = get_problem("logistic", lam=0.1)
    update = get_rule(rule)(block, problem.regularizer, problem.lam, 0.05, writers=2, **rule_options)
    return PartyState(rank=rank, block=block, w=np.zeros(WIDTH), rule=update,
                      problem=problem if active else None,
                      y=rng.choice([-1.0, 1.0], N_ROWS) if active else None)
