"""VFB² update rules run in one process, one step at a time, with no asynchrony and no masking.

Why it exists: it is the same algorithm as the MPI runtime minus federation (every block updated from
the same ϑ right away, no stale reads), so it (1) checks the update rules against the NonF optimum
in a fast unit test, and (2) is the "centralised in one process" side of the cost-of-federation
benchmark. It is not a substitute for the runtime: nothing here crosses a party boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from vertical.algorithms.vfb2 import Block, UpdateRule, get_rule
from vertical.problems import Problem


@dataclass
class SerialResult:
    w: np.ndarray
    #: objective f(w) after each epoch (index 0: at the start)
    objective: list[float] = field(default_factory=list)


def run_serial(problem: Problem, X, y: np.ndarray, blocks: Sequence[np.ndarray], algorithm: str,
               gamma: float, epochs: int, *, seed: int = 0, lazy: bool = True, batch_size: int = 1,
               on_epoch: Callable[[int, np.ndarray], None] | None = None) -> SerialResult:
    """Run ``epochs`` passes of ``algorithm`` ("sgd", "svrg", "saga", "saga-scalar") over the blocks.

    An epoch is n samples drawn uniformly with replacement, i.e. max(1, n // B) steps of B samples
    (``batch_size``); every step's B products are taken at the iterate before the step. SVRG takes a
    snapshot at the start of every epoch (an inner loop of one pass). Reads go through
    ``rule.products`` and every barrier (snapshot, end of epoch) through ``rule.synchronize``, so lazy
    (default) and eager (``lazy=False``) rules give the same iterates up to rounding.
    """
    n = X.shape[0]
    rule_cls = get_rule(algorithm)
    parts = [Block.from_matrix(X[:, cols]) for cols in blocks]
    rules: list[UpdateRule] = [rule_cls(b, problem.regularizer, problem.lam, gamma, lazy=lazy,
                                        batch_size=batch_size) for b in parts]
    ws = [np.zeros(b.n_cols) for b in parts]
    rng = np.random.default_rng(seed)
    steps = max(1, n // batch_size)

    def products(rows: np.ndarray) -> np.ndarray:
        return sum(rule.products(w, rows) for rule, w in zip(rules, ws, strict=True))

    def full_theta() -> np.ndarray:
        return np.asarray(problem.theta(products(np.arange(n)), y), dtype=np.float64)

    def assemble() -> np.ndarray:
        w = np.zeros(X.shape[1])
        for cols, rule, wl in zip(blocks, rules, ws, strict=True):
            rule.synchronize(wl)
            w[cols] = wl
        return w

    result = SerialResult(w=assemble())
    result.objective.append(problem.objective(result.w, X, y))
    if rule_cls.needs_initial_pass:
        theta = full_theta()
        for rule, w in zip(rules, ws, strict=True):
            rule.initialize(theta, w)
    for epoch in range(1, epochs + 1):
        if rule_cls.needs_snapshot:
            theta0 = full_theta()
            for rule, w in zip(rules, ws, strict=True):
                rule.snapshot(theta0, w)
        draws = rng.integers(0, n, size=steps * batch_size)
        for start in range(0, draws.size, batch_size):
            rows = draws[start:start + batch_size]
            thetas = np.asarray(problem.theta(products(rows), y[rows]), dtype=np.float64).reshape(-1)
            for rule, w in zip(rules, ws, strict=True):
                rule.apply(w, rows, thetas)
        result.w = assemble()
        result.objective.append(problem.objective(result.w, X, y))
        if on_epoch is not None:
            on_epoch(epoch, result.w)
    return result
