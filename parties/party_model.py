"""What the data plane computes with: a party's contribution to rows, ϑ at a label holder, its own step.

The runtime drives one of two *parts* through the same calls, so there is one runtime for both models
(``docs/vertical-networks.md``):

* :class:`LinearPart` - VFB²'s block: ``w_l·x_i`` (k = 1) and the update rule's numba kernels, which
  write ``w`` lock-free from several threads (each its own writer slot); messages queued meanwhile are
  applied in one kernel call (the same result);
* :class:`NetworkPart` - a party's network of :mod:`vertical.nn` (k values a row): a torch model is not
  lock-free, so one lock serialises its forward passes and steps, and each (ϑ, i) message is its own
  step (two messages in one step would be one step of a bigger batch, another algorithm).

Values cross as flat float64 arrays: a contribution of B rows is B·k values (each row's k together),
and so is ϑ, the layout of the k-wide (ϑ, i) message (``vertical/nn/messages.py``).
"""

from __future__ import annotations

import threading

import numpy as np


class LinearPart:
    """``w·x`` of a party's linear block and its VFB² update rule (k = 1)."""

    k = 1
    #: queued (ϑ, i) messages may be applied in one kernel call: the same iterates
    merges_messages = True

    def __init__(self, party) -> None:
        self.party = party

    def contribute(self, rows: np.ndarray) -> np.ndarray:
        return self.party.rule.products(self.party.w, rows)

    def step(self, rows: np.ndarray, thetas: np.ndarray, writer: int) -> None:
        self.party.rule.apply(self.party.w, rows, thetas, writer=writer)

    def theta(self, scores: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """ϑ of the loss at a label holder for its sampled ``rows``."""
        party = self.party
        return np.asarray(party.problem.theta(scores, party.y[rows]), dtype=np.float64)

    def warm_up(self) -> None:
        """Compile the numba kernels now, so that JIT time never counts as training time."""
        party, none = self.party, np.zeros(0, dtype=np.int64)
        party.rule.products(party.w, none)
        party.rule.apply(party.w.copy(), none, np.zeros(0))
        # every drain calls it: compiled now, or the first drain would be a silent step of seconds
        party.rule.synchronize(party.w.copy())

    def synchronize(self) -> None:
        """Bring every coordinate up to date (lazy kernels); nothing writes meanwhile."""
        self.party.rule.synchronize(self.party.w)


class NetworkPart:
    """A party's network (``party.network``, a :class:`~vertical.nn.base.PartyModel`) and, at the label
    holder, the top network with the loss (``party.top``) on the labels as class indices."""

    merges_messages = False

    def __init__(self, party) -> None:
        self.model = party.network
        self.top = getattr(party, "top", None)
        self.labels = getattr(party, "classes", None)
        self.k = int(self.model.k)
        self.lock = threading.Lock()

    def contribute(self, rows: np.ndarray) -> np.ndarray:
        with self.lock:
            return np.ascontiguousarray(self.model.forward(rows), dtype=np.float64).ravel()

    def step(self, rows: np.ndarray, thetas: np.ndarray, writer: int) -> None:
        with self.lock:
            self.model.backward(rows, thetas.reshape(-1, self.k))

    def theta(self, scores: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The top's step on ``z_B`` (the secure sum of every party's contribution) and the rows' ϑ."""
        assert self.top is not None and self.labels is not None, "only a label holder computes ϑ"
        theta, _ = self.top.step(scores.reshape(-1, self.k), self.labels[rows])
        return np.ascontiguousarray(theta, dtype=np.float64).ravel()

    def warm_up(self) -> None:
        self.contribute(np.zeros(1, dtype=np.int64))

    def synchronize(self) -> None:
        """A network's steps are applied whole: nothing to bring up to date."""


def part_of(party) -> LinearPart | NetworkPart:
    """The part the runtime drives for ``party``: its network when it has one, else its linear block."""
    return NetworkPart(party) if getattr(party, "network", None) is not None else LinearPart(party)
