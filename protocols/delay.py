"""Link-latency emulation: hold every received message for a one-way delay before it is processed.

Parties of a real federation sit a network hop of milliseconds apart, and kernel-level emulation (netem)
is not available everywhere, so the runtime can add the delay itself: the receiving thread hands each
message to :class:`DelayedDelivery`, whose own thread processes it ``delay`` (plus up to ``jitter``)
seconds after it arrived. Messages from one sender are still processed in the order they were sent
(a jittered release time never overtakes the previous one from the same sender), as MPI guarantees.
Users plan deployments with it: ``vfl train --link-delay 10`` shows what a 10 ms link does to a run.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable

import numpy as np

__all__ = ["DelayedDelivery"]

Handler = Callable[[int, int, np.ndarray], None]


class DelayedDelivery:
    """Calls ``handler(source, tag, buffer)`` for each submitted message after the link delay.

    ``delay`` and ``jitter`` are in seconds; each message waits ``delay + U(0, jitter)``. The handler
    runs on this object's thread, one message at a time; :meth:`close` stops it after everything
    already submitted has been delivered.
    """

    def __init__(self, handler: Handler, delay: float, jitter: float = 0.0, *, seed: int = 0,
                 wrap: Callable[[Callable[[], None]], Callable[[], None]] | None = None) -> None:
        if delay < 0 or jitter < 0:
            raise ValueError(f"delay and jitter must be non-negative, got {delay}, {jitter}")
        self._handler = handler
        self._delay, self._jitter = delay, jitter
        self._rng = np.random.default_rng(seed)
        self._queue: list[tuple[float, int, int, int, np.ndarray | None]] = []
        self._order = itertools.count()  # ties in release time keep submission order
        self._last_release: dict[int, float] = {}
        self._cond = threading.Condition()
        body = self._run if wrap is None else wrap(self._run)
        self._thread = threading.Thread(target=body, name="link-delay", daemon=True)
        self._thread.start()

    def submit(self, source: int, tag: int, buffer: np.ndarray) -> None:
        """Queue one message (the caller gives up ``buffer``)."""
        wait = self._delay + (self._rng.uniform(0.0, self._jitter) if self._jitter else 0.0)
        with self._cond:
            release = max(time.monotonic() + wait, self._last_release.get(source, 0.0))
            self._last_release[source] = release
            heapq.heappush(self._queue, (release, next(self._order), source, tag, buffer))
            self._cond.notify()

    def close(self) -> None:
        """Deliver what is queued, then stop the thread."""
        with self._cond:
            heapq.heappush(self._queue, (float("inf"), next(self._order), -1, -1, None))
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._queue:
                        release = self._queue[0][0]
                        now = time.monotonic()
                        if release <= now or (self._queue[0][4] is None and len(self._queue) == 1):
                            break
                        self._cond.wait(None if release == float("inf") else release - now)
                    else:
                        self._cond.wait()
                _, _, source, tag, buffer = heapq.heappop(self._queue)
            if buffer is None:
                return
            self._handler(source, tag, buffer)
