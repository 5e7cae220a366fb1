"""The interfaces every party model and top model implement, and the layer spec strings.

The runtime only ever hands a party model row indices of its own training block and ϑ's, as numpy
arrays (they arrive as float64 words on the wire), and reads back numpy arrays: what a party model is
made of (a numba-updated weight vector, a torch network) stays inside it. State goes out as a flat
``{name: ndarray}`` dict, so a checkpoint is one ``np.savez`` with no pickle.

Conventions shared by every implementation:

* ``forward(rows)`` returns the party's contribution ``h_l(x_i)`` for each row, shape ``(B, k)``;
* ``ϑ`` is **per row**, ``ϑ_b = ∂ℓ(z_b, y_b)/∂z_b`` (not divided by B), as the linear VFB² rules take
  it; a party's step from a message of B rows is on the batch mean, ``(1/B) Σ_b ϑ_b ∂h(x_b)/∂θ``;
* a party steps when ϑ arrives, at its parameters *then* (a network recomputes its forward pass):
  under asynchrony these may have moved since its ``forward`` for the same rows, as in VFB².
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class PartyModel(ABC):
    """One party's part of a vertical model over its own training block (rows ``0..n_rows - 1``)."""

    #: Width of the party's contribution (the cut layer); the same at every party of a job.
    k: int
    n_rows: int

    @abstractmethod
    def forward(self, rows: np.ndarray) -> np.ndarray:
        """``h_l(x_i)`` for each training row in ``rows``: float64 ``(B, k)``."""

    @abstractmethod
    def backward(self, rows: np.ndarray, theta: np.ndarray, steps: int = 1) -> None:
        """One step of this party's parameters from the rows' ϑ, float64 ``(B, k)``; ``steps`` > 1 takes
        that many steps from this one gradient (a party catching up on queued messages:
        ``parties/party_model.py``)."""

    @abstractmethod
    def embed(self, X) -> np.ndarray:
        """``h_l(x)`` for new rows of this party's columns (prediction): float64 ``(n, k)``."""

    @abstractmethod
    def state_dict(self) -> dict[str, np.ndarray]:
        """Everything a resumed run needs (parameters, optimiser state) as named numpy arrays."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Restore :meth:`state_dict`'s output (checked: names and shapes must match)."""


class TopModel(ABC):
    """The active party's part after the secure sum: the top model and the loss on ``z = Σ_l h_l``."""

    #: Width of z it takes.
    k: int
    #: Number of classes it predicts (2 for binary).
    n_classes: int

    @abstractmethod
    def step(self, z: np.ndarray, y: np.ndarray, protection=None) -> tuple[np.ndarray, float]:
        """Step the top's own parameters on the batch ``(z, y)`` and return the rows' ϑ ``(B, k)`` to
        dispatch and the batch's mean loss. With a :class:`~vertical.nn.protection.LabelProtection`,
        the ϑ returned and the top's own step are the clipped and noised ones."""

    @abstractmethod
    def predict_proba(self, z: np.ndarray) -> np.ndarray:
        """Class probabilities ``(n, n_classes)`` from summed contributions z."""

    def state_dict(self) -> dict[str, np.ndarray]:
        return {}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        check_state(state, {}, "top model")


def check_state(state: dict[str, np.ndarray], expected: dict[str, np.ndarray], what: str) -> None:
    """Raise a one-line ``ValueError`` unless ``state`` has exactly the names and shapes of ``expected``."""
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(f"{what}: state names differ (missing {missing}, unexpected {extra})")
    for name, value in expected.items():
        if np.shape(state[name]) != np.shape(value):
            raise ValueError(f"{what}: {name} has shape {np.shape(state[name])}, expected {np.shape(value)}")


def parse_spec(spec: str, *, first: int | None = None, last: int | None = None, what: str = "layers"
               ) -> tuple[int, ...]:
    """Layer widths from a spec string such as ``"196-64-16"``.

    ``*`` stands for a width the job fixes (a party's number of columns first, the number of logits
    last) and is replaced by ``first`` / ``last``; a number given there must equal it. One width
    (``"10"``) is a model without layers (an identity top).
    """
    tokens = spec.strip().split("-") if isinstance(spec, str) else []
    if not tokens or any(not t.strip() for t in tokens):
        raise ValueError(f"{what} spec {spec!r}: expected widths joined by '-', e.g. '196-64-16'")
    widths = []
    for position, token in enumerate(t.strip() for t in tokens):
        fixed = {w for w in (first if position == 0 else None,
                             last if position == len(tokens) - 1 else None) if w is not None}
        if len(fixed) > 1:
            raise ValueError(f"{what} spec {spec!r}: one width cannot be both {first} and {last}")
        if token == "*":
            if not fixed:
                raise ValueError(f"{what} spec {spec!r}: '*' only stands first or last, where the job "
                                 f"fixes the width")
            widths.append(fixed.pop())
            continue
        if not token.isdigit() or int(token) < 1:
            raise ValueError(f"{what} spec {spec!r}: {token!r} is not a positive width")
        if fixed and int(token) not in fixed:
            where = "first" if position == 0 else "last"
            raise ValueError(f"{what} spec {spec!r}: the {where} width must be {fixed.pop()}, got {token}")
        widths.append(int(token))
    return tuple(widths)
