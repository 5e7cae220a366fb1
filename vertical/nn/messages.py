"""The k-wide (ϑ, i) message: what a dominator sends every party after a network's top step.

``[seq, B, i_1..i_B, ϑ_1..ϑ_B]`` as float64 words, each ϑ_b a row of k values (row-major, B·k words).
k is fixed for a job (the plan carries it), so it does not travel: a receiver expects exactly
``2 + B + B·k`` words. With k = 1 this is today's message (``protocols/dispatch.py``, ``pack``)
word for word, so a linear job's transcripts and checks are unchanged. The MPI runtime's receive-side
validation of this layout is phase 2 (``docs/vertical-networks.md``); :func:`unpack` checks what a
transcript reader needs.
"""

from __future__ import annotations

import numpy as np


def pack(seq: int, rows: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """The float64 words of one message: ``rows`` (B,) and ``theta`` (B, k)."""
    rows = np.asarray(rows)
    theta = np.asarray(theta, dtype=np.float64)
    b = rows.size
    if theta.ndim != 2 or theta.shape[0] != b:
        raise ValueError(f"theta must be (B, k) with B = {b} rows, got {theta.shape}")
    buf = np.empty(2 + b + theta.size, dtype=np.float64)
    buf[0], buf[1] = seq, b
    buf[2:2 + b] = rows
    buf[2 + b:] = theta.ravel()
    return buf


def unpack(words: np.ndarray, k: int | None = None) -> tuple[int, np.ndarray, np.ndarray]:
    """``(seq, rows, theta (B, k))`` of a message; k is inferred from the length when not given."""
    words = np.asarray(words, dtype=np.float64)
    if words.size < 4:
        raise ValueError(f"a (ϑ, i) message has at least 4 words, got {words.size}")
    b = int(words[1])
    if not (b >= 1 and words[1] == b):
        raise ValueError(f"batch size B = {words[1]!r} is not a positive integer")
    width, rest = divmod(words.size - 2 - b, b)
    if rest or width < 1 or (k is not None and width != k):
        raise ValueError(f"{words.size} words do not hold B = {b} rows of "
                         f"{'k = ' + str(k) if k is not None else 'whole'} ϑ's")
    return int(words[0]), words[2:2 + b].astype(np.int64), words[2 + b:].reshape(b, width)
