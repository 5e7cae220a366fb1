"""Micro-batching: concurrent requests share one secure aggregation.

One aggregation costs a few message rounds whatever its width, so rows scored together cost little
more than one. The batcher takes the first waiting request; if nothing else waits, it goes at once (a
lone request never waits for a window). If others wait too (concurrency), the batch keeps gathering
until ``window`` seconds after its first request or ``max_rows`` rows, whichever comes first. While an
aggregation runs, new requests queue, and form the next batch: under load batches grow by themselves.
Each request gets back exactly its own rows' answers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from parties.serving.federation import BatchScores


@dataclass
class _Pending:
    ids: np.ndarray
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)


class MicroBatcher:
    """Gathers requests into batches for ``score`` (an async call that scores one batch of ids)."""

    def __init__(self, score: Callable[[np.ndarray], Awaitable[BatchScores]], *, window: float,
                 max_rows: int) -> None:
        self.score, self.window, self.max_rows = score, window, max_rows
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._held: _Pending | None = None  # a request that did not fit the last batch: first of the next
        self.batches = self.requests = 0  # scored so far (GET /health shows them)
        self.busy_seconds = 0.0  # time spent in score(): the federation's share of a request's latency

    async def submit(self, ids: np.ndarray) -> BatchScores:
        """This request's own scores (``ids`` has at most ``max_rows`` ids)."""
        pending = _Pending(ids, asyncio.get_running_loop().create_future())
        await self.queue.put(pending)
        return await pending.future

    async def run(self) -> None:
        """Form and score batches until cancelled."""
        while True:
            batch = await self._gather()
            await self._score(batch)

    async def _gather(self) -> list[_Pending]:
        first = self._held if self._held is not None else await self.queue.get()
        self._held = None
        batch, rows = [first], first.ids.size
        while not self.queue.empty() and self._take(batch, rows, self.queue.get_nowait()):
            rows += batch[-1].ids.size
        if len(batch) == 1:  # a lone request goes at once
            return batch
        deadline = first.arrived + self.window
        while self._held is None and rows < self.max_rows and (left := deadline - time.monotonic()) > 0:
            try:
                pending = await asyncio.wait_for(self.queue.get(), left)
            except TimeoutError:
                break
            if self._take(batch, rows, pending):
                rows += pending.ids.size
        return batch

    def _take(self, batch: list[_Pending], rows: int, pending: _Pending) -> bool:
        """Add ``pending`` to ``batch`` if it fits, else hold it for the next batch."""
        if rows + pending.ids.size > self.max_rows:
            self._held = pending
            return False
        batch.append(pending)
        return True

    async def _score(self, batch: list[_Pending]) -> None:
        ids = np.concatenate([p.ids for p in batch])
        started = time.perf_counter()
        try:
            scores = await self.score(ids)
        except Exception as error:  # every request of the batch gets the failure (e.g. a party is gone)
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(error)
            return
        self.busy_seconds += time.perf_counter() - started
        self.batches += 1
        self.requests += len(batch)
        start = 0
        for pending in batch:
            stop = start + pending.ids.size
            if not pending.future.done():  # its client may have gone away
                pending.future.set_result(scores.take(start, stop))
            start = stop
