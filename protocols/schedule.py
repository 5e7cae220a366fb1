"""What a dominator's schedule allows, checked where its messages arrive (issue 26, finding 3).

Only a dominator roots a request (:class:`~protocols.aggregation.AggregationNode`'s ``roots``); this is
*how much* it may ask. A dominator's step ``s`` is one aggregation REQUEST (request id ``s``, its rows)
followed, once every party has contributed and the root has the scores, by one (ϑ, i) broadcast
numbered ``s`` for exactly those rows (or, under ``--label-privacy he``, an encrypted batch for them).
It keeps at most ``inflight`` requests outstanding and sends request ``s + inflight`` only after step
``s``'s broadcast. So a receiver can hold every dominator to three invariants, with state bounded by
``inflight`` row lists per dominator:

* a REQUEST ``rid`` comes only once the broadcast of step ``rid - inflight`` has arrived (the node
  already refuses one ``inflight`` or more beyond the oldest request unfinished here);
* a broadcast ``s`` is for a request ``s`` that this party has seen and contributed to (finished here:
  the root cannot have its scores before), never one it did not make, never a second one;
* its rows are exactly the rows of that request: ϑ's of rows nobody aggregated would be labels the
  dominator made up, or steps beyond its schedule.

An algorithm without broadcasts (``dispatch`` False, AFSVRG-VP) gets only the first bound, with no
broadcast allowed at all. A violation raises :class:`~protocols.errors.ProtocolViolation` naming the
dominator.
"""

from __future__ import annotations

import numpy as np

from protocols.errors import ProtocolViolation

__all__ = ["DominatorSchedule"]


class DominatorSchedule:
    """A receiver's view of every dominator's schedule: the rows of its requests whose broadcast is
    still due, and how many broadcasts have come (per root). Not thread-safe: one thread feeds it."""

    def __init__(self, size: int, *, inflight: int, dispatch: bool) -> None:
        if inflight < 1:
            raise ValueError(f"inflight must be at least 1, got {inflight}")
        self.inflight = inflight
        self.dispatch = dispatch
        self._due: list[dict[int, list[int]]] = [{} for _ in range(size)]
        self._broadcasts = [0] * size

    def due(self, root: int) -> int:
        """How many of ``root``'s requests still wait for their broadcast here (at most ``inflight``)."""
        return len(self._due[root])

    def request(self, root: int, rid: int, rows: np.ndarray) -> None:
        """``root``'s REQUEST ``rid`` for ``rows`` (already validated by the aggregation node)."""
        if not self.dispatch:
            return
        broadcast = self._broadcasts[root]
        if rid >= broadcast + self.inflight:
            raise ProtocolViolation(root, "REQUEST", f"request id {rid} before its (ϑ, i) #{broadcast} "
                                    f"arrived: no more than --inflight ({self.inflight}) may run "
                                    f"ahead of its broadcasts")
        self._due[root][rid] = _rows_key(rows)

    def broadcast(self, root: int, seq: int, rows: np.ndarray, *, finished: bool,
                  what: str = "(ϑ, i) message") -> None:
        """``root``'s broadcast number ``seq`` (its sequence already checked) for ``rows``; ``finished``:
        whether request ``(root, seq)`` is finished at this party."""
        if not self.dispatch:
            raise ProtocolViolation(root, what, "this job's algorithm broadcasts no (ϑ, i)")
        requested = self._due[root].pop(seq, None)
        if requested is None:
            raise ProtocolViolation(root, what, f"#{seq} is for a step it never requested (no REQUEST {seq} "
                                    f"of root {root} waits for its broadcast)")
        if not finished:
            raise ProtocolViolation(root, what, f"#{seq} came before its request was aggregated (party "
                                    f"contributions to ({root}, {seq}) are still due)")
        if _rows_key(rows) != requested:
            requested = np.asarray(requested, dtype=np.int64)
            raise ProtocolViolation(root, what, f"#{seq} is for rows {_head(rows)} where its request "
                                    f"aggregated rows {_head(requested)}")
        self._broadcasts[root] = seq + 1


def _rows_key(rows: np.ndarray) -> list[int]:
    """Rows as Python ints, compared with ``==``: at the B = 1 hot path a list beats
    ``np.array_equal``'s dozen numpy calls, and rows are never longer than one request."""
    return np.asarray(rows, dtype=np.int64).tolist()


def _head(rows: np.ndarray, n: int = 4) -> str:
    shown = ", ".join(str(int(r)) for r in np.asarray(rows)[:n])
    return f"[{shown}{', …' if len(rows) > n else ''}]"
