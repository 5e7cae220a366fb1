"""Today's linear VFB² as party models: a block with its update rule (k = 1) and the loss as the top.

:class:`LinearPartyModel` is the existing :class:`~vertical.algorithms.vfb2.Block` and
:class:`~vertical.algorithms.vfb2.UpdateRule` behind the :class:`~vertical.nn.base.PartyModel`
interface, nothing re-implemented: ``forward`` is ``rule.products``, ``backward`` is ``rule.apply``,
so driving it gives the rule's iterates bit for bit (``tests/test_vertical_nn.py``). :class:`LossTop`
is the active party's ϑ = ∂L/∂z of a :class:`~vertical.problems.Problem`, with no parameters.

Full-pass rules (SVRG snapshots, SAGA's initial pass) also need the barriers of the runtime; the
simulator of :mod:`vertical.nn.simulate` runs none, so it drives the SGD rule. Numpy only: this module
must not import torch (``tests/test_vertical_nn.py`` checks).
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit

from vertical.algorithms.vfb2 import Block, UpdateRule
from vertical.nn.base import PartyModel, TopModel, check_state
from vertical.nn.protection import LabelProtection
from vertical.problems import Problem


class LinearPartyModel(PartyModel):
    """One party's linear block ``w_l`` and its VFB² update rule, as a k = 1 party model."""

    k = 1

    def __init__(self, rule: UpdateRule, w: np.ndarray | None = None) -> None:
        self.rule = rule
        self.block: Block = rule.block
        self.n_rows = self.block.n_rows
        self.w = np.zeros(self.block.n_cols) if w is None else np.ascontiguousarray(w, dtype=np.float64)
        if self.w.shape != (self.block.n_cols,):
            raise ValueError(f"w has shape {self.w.shape}, the block has {self.block.n_cols} columns")

    def forward(self, rows):
        return self.rule.products(self.w, np.ascontiguousarray(rows, dtype=np.int64))[:, None]

    def backward(self, rows, theta, steps=1):
        theta = np.asarray(theta, dtype=np.float64)
        if theta.shape != (np.size(rows), 1):
            raise ValueError(f"a linear party takes ϑ of shape (B, 1), got {theta.shape}")
        rows, theta = np.ascontiguousarray(rows, dtype=np.int64), np.ascontiguousarray(theta[:, 0])
        for _ in range(steps):
            self.rule.apply(self.w, rows, theta)

    def weights(self) -> np.ndarray:
        """``w_l`` brought up to date (a barrier: no step may run meanwhile)."""
        self.rule.synchronize(self.w)
        return self.w

    def embed(self, X):
        return np.asarray(X @ self.weights(), dtype=np.float64).reshape(-1, 1)

    def state_dict(self):
        return {"w": self.weights().copy()}

    def load_state_dict(self, state):
        check_state(state, {"w": self.w}, "linear party")
        self.weights()
        self.w[:] = state["w"]


class LossTop(TopModel):
    """The identity top of linear VFB²: ``ϑ = ∂L(z, y)/∂z`` of ``problem`` (labels as it takes them)."""

    k = 1

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.n_classes = 2 if problem.task == "binary" else 0

    def step(self, z, y, protection: LabelProtection | None = None):
        scores = np.asarray(z, dtype=np.float64)[:, 0]
        theta = np.asarray(self.problem.theta(scores, y), dtype=np.float64).reshape(-1, 1)
        loss = float(np.mean(self.problem.loss.value(scores, y)))
        return (theta if protection is None else protection.release(theta)), loss

    def predict_proba(self, z):
        if self.problem.task != "binary":
            raise ValueError(f"problem {self.problem.name!r} is a regression: no class probabilities")
        positive = expit(np.asarray(z, dtype=np.float64)[:, 0])
        return np.column_stack([1.0 - positive, positive])
