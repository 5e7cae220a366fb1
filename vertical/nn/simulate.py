"""VFB² for party models in one process: the asynchronous protocol played step by step, with bounded
staleness, and the lock-step split-learning baseline.

What it plays, per step of the dominator (the active party, which holds the labels and the top):

1. it draws a batch B (one permutation of the rows per pass: :func:`epoch_batches`);
2. every party contributes ``h_l(x_B)`` at its parameters *now* (the secure sum gives the dominator
   only ``z_B = Σ_l h_l``; nothing here needs the masking, which changes no value);
3. the top steps on ``(z_B, y_B)`` and returns ϑ_B (clipped and noised in the protected mode);
4. the dominator steps its own bottom at once and dispatches the message ``(ϑ_B, B)``
   (:mod:`vertical.nn.messages`) to every other party, which queues it.

Asynchrony is the queue: before contributing to step t, a collaborator l applies its oldest queued
messages until at most ``s_l(t)`` remain, so its contribution misses its last ``s_l(t)`` updates, with
``s_l(t)`` drawn uniformly in ``0..τ_l`` (``lags="uniform"``) or always ``τ_l`` (``"fixed"``, a
straggler). Messages are applied exactly once and in order, as the runtime's dispatcher guarantees.
``mode="sync"`` (or ``"sync-global"``: with one dominator they coincide) is τ = 0: every party has
applied step t − 1 before it contributes to step t, which is lock-step split learning. Every queue is
drained at the end of a pass, where the runtime's evaluation barrier is.

What this cannot show is time: one process plays every party, so a straggler costs nothing here. The
asynchronous speed-up is the MPI runtime's to measure (phase 2, ``docs/vertical-networks.md``).

``record=True`` keeps every dispatched message (the words a collaborator receives) for the label
attacks; ``experiments/label_attacks.py`` writes them as a passive party's ``--audit`` transcript.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from vertical.nn import messages
from vertical.nn.base import PartyModel, TopModel
from vertical.nn.protection import LabelProtection

MODES = ("async", "sync", "sync-global")


def epoch_batches(rng: np.random.Generator, n_rows: int, batch_size: int) -> list[np.ndarray]:
    """One pass: a permutation of the rows cut into ``max(1, n // B)`` batches of B or B + 1 rows, so
    every row is in exactly one batch (what the label-DP accounting counts on)."""
    if batch_size < 1 or n_rows < 1:
        raise ValueError(f"need n_rows >= 1 and batch_size >= 1, got {n_rows}, {batch_size}")
    return np.array_split(rng.permutation(n_rows), max(1, n_rows // batch_size))


@dataclass
class SimulationResult:
    """What a run did: per-pass rows, the dispatched messages (when recorded) and staleness seen."""

    #: per pass: ``epoch``, mean training ``loss``, cumulative training ``seconds`` (wall) and
    #: ``cpu_seconds`` (this process), and ``evaluate``'s
    history: list[dict] = field(default_factory=list)
    #: every (ϑ, i) message the dominator sent, in order (float64 words), when ``record``
    dispatched: list[np.ndarray] = field(default_factory=list)
    steps: int = 0
    #: per party: the largest number of its own updates a contribution of it missed
    max_staleness: list[int] = field(default_factory=list)


def simulate(parties: Sequence[PartyModel], top: TopModel, y: np.ndarray, *, epochs: int, batch_size: int,
             mode: str = "async", max_staleness: int | Sequence[int] = 0, lags: str = "uniform",
             seed: int = 0, protection: LabelProtection | None = None, record: bool = False,
             dominator: int = 0, evaluate: Callable[[int], dict] | None = None,
             batches: Callable[[int, np.random.Generator], list[np.ndarray]] | None = None
             ) -> SimulationResult:
    """Train ``parties`` and ``top`` by VFB² (see the module docstring); returns the run's record.

    ``y`` holds the labels as ``top`` takes them (class indices for a network top, ±1 for the linear
    :class:`~vertical.nn.linear.LossTop`); only the dominator's top reads them. ``max_staleness`` is τ,
    one for all collaborators or one per party (the dominator's own entry is ignored: it steps its
    bottom at once). ``batches(epoch, rng)`` replaces :func:`epoch_batches` (tests replaying another
    schedule); the protected mode refuses it, its accounting needs one release per row and pass.
    """
    q = len(parties)
    taus = _checked(parties, top, y, epochs=epochs, mode=mode, max_staleness=max_staleness, lags=lags,
                    dominator=dominator, protected=protection is not None, replayed=batches is not None)
    y = np.asarray(y)

    rng = np.random.default_rng(seed)
    lag_rng = np.random.default_rng([seed, 1])
    queues: list[deque] = [deque() for _ in range(q)]
    result = SimulationResult(max_staleness=[0] * q)
    elapsed = cpu = 0.0

    def drain(party: int, keep: int) -> None:
        while len(queues[party]) > keep:
            rows, theta = queues[party].popleft()
            parties[party].backward(rows, theta)

    for epoch in range(1, epochs + 1):
        start, cpu_start, losses = time.perf_counter(), time.process_time(), []
        plan = batches(epoch, rng) if batches is not None else epoch_batches(rng, y.shape[0], batch_size)
        for rows in plan:
            rows = np.asarray(rows, dtype=np.int64)
            z = None
            for party, model in enumerate(parties):
                if taus[party]:
                    keep = taus[party] if lags == "fixed" else int(lag_rng.integers(0, taus[party] + 1))
                    drain(party, keep)
                    result.max_staleness[party] = max(result.max_staleness[party], len(queues[party]))
                h = model.forward(rows)
                z = h if z is None else z + h
            theta, loss = top.step(z, y[rows], protection)
            losses.append(loss)
            parties[dominator].backward(rows, theta)
            for party in range(q):
                if party != dominator:
                    queues[party].append((rows, theta))
                    if not taus[party]:
                        drain(party, 0)
            if record:
                result.dispatched.append(messages.pack(result.steps, rows, theta))
            result.steps += 1
        for party in range(q):
            drain(party, 0)
        elapsed += time.perf_counter() - start
        cpu += time.process_time() - cpu_start
        row = {"epoch": epoch, "loss": float(np.mean(losses)), "seconds": elapsed, "cpu_seconds": cpu}
        if evaluate is not None:
            row.update(evaluate(epoch))
        result.history.append(row)
    return result


def predict_proba(parties: Sequence[PartyModel], top: TopModel, blocks: Sequence) -> np.ndarray:
    """Class probabilities of new rows, party l's columns in ``blocks[l]``: the top on ``Σ_l h_l``.

    In one process only; a deployment sums the contributions by secure aggregation (phase 2)."""
    if len(blocks) != len(parties):
        raise ValueError(f"{len(blocks)} column blocks for {len(parties)} parties")
    z = parties[0].embed(blocks[0])
    for model, X in zip(parties[1:], blocks[1:], strict=True):
        z = z + model.embed(X)
    return top.predict_proba(z)


def _checked(parties: Sequence[PartyModel], top: TopModel, y, *, epochs: int, mode: str, max_staleness,
             lags: str, dominator: int, protected: bool, replayed: bool) -> list[int]:
    """:func:`simulate`'s arguments checked, one line per mistake; returns τ per party (0 for the
    dominator, and for every party outside ``async``)."""
    q = len(parties)
    if q < 1 or not 0 <= dominator < q:
        raise ValueError(f"need at least one party and a dominator in 0..{q - 1}, got {q}, {dominator}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if lags not in ("uniform", "fixed"):
        raise ValueError(f"lags must be 'uniform' or 'fixed', got {lags!r}")
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    if protected and replayed:
        raise ValueError("the protected mode draws its own batches (one release per row and pass)")
    widths = {p.k for p in parties} | {top.k}
    rows_per_party = {p.n_rows for p in parties}
    if len(widths) != 1:
        raise ValueError(f"every party and the top must share the width k, got {sorted(widths)}")
    y = np.asarray(y)
    if rows_per_party != {y.shape[0]}:
        raise ValueError(f"the parties hold {sorted(rows_per_party)} rows and there are {y.shape[0]} labels")
    taus = [int(max_staleness)] * q if np.isscalar(max_staleness) else [int(t) for t in max_staleness]
    if len(taus) != q or min(taus) < 0:
        raise ValueError(f"max_staleness must be one τ >= 0 or one per party ({q}), got {max_staleness}")
    if mode != "async":
        taus = [0] * q
    taus[dominator] = 0
    return taus
