"""The leader's HTTP endpoint (aiohttp): ``POST /score`` and ``GET /health``; the API of docs/serving.md.

A request is checked here, whole, before anything reaches the federation: a malformed one gets 400 and
one line saying what is wrong. Each id gets its own entry in the answer: the outputs asked for, or an
error when some party does not hold it (never a score made without that party's features).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import numpy as np
from aiohttp import web

from parties.serving.batching import MicroBatcher
from parties.serving.federation import BatchScores, PartyUnavailable

OUTPUTS = ("score", "probability", "class", "probabilities")
#: the outputs each task has (the first three as ``vfl predict``'s CSV; a network of more than two
#: classes: the predicted class 0..C−1 and every class's probability)
TASK_OUTPUTS = {"binary": ("score", "probability", "class"), "multiclass": ("class", "probabilities")}
#: the per-id answer for an id some party does not hold
UNKNOWN_ID = "unknown id: not held by every party"
_INT64 = (-(2**63), 2**63 - 1)


class BadRequest(ValueError):
    """A malformed request: its one line goes back with status 400."""


def parse_request(body: bytes, *, max_ids: int, task: str) -> tuple[np.ndarray, tuple[str, ...]]:
    """``(ids, outputs)`` of a ``POST /score`` body, or BadRequest saying what is wrong."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the body is not JSON") from None
    if not isinstance(request, dict) or set(request) - {"ids", "output"}:
        raise BadRequest('the body must be a JSON object {"ids": [...], "output": ...}')
    ids = request.get("ids")
    if not isinstance(ids, list) or not 1 <= len(ids) <= max_ids:
        raise BadRequest(f'"ids" must be a list of 1 to {max_ids} integer ids')
    if not all(type(i) is int and _INT64[0] <= i <= _INT64[1] for i in ids):
        raise BadRequest('every id in "ids" must be an integer (the ids of the party files)')
    return np.array(ids, dtype=np.int64), parse_outputs(request.get("output"), task)


def parse_outputs(output, task: str) -> tuple[str, ...]:
    """The outputs asked for: one name or a list of them; by default all the task has."""
    available = TASK_OUTPUTS.get(task, ("score",))
    if output is None:
        return available
    names = [output] if isinstance(output, str) else output
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise BadRequest(f'"output" must be one of {", ".join(OUTPUTS)} or a list of them')
    for name in names:
        if name not in available:
            raise BadRequest(f'"output" {name!r} is not available for a {task} model (it has: '
                             f'{", ".join(available)})')
    return tuple(dict.fromkeys(names))


def answer(ids: np.ndarray, scores: BatchScores, outputs: tuple[str, ...]) -> list[dict]:
    """One entry per id, in the request's order."""
    entries = []
    for at, (i, held) in enumerate(zip(ids.tolist(), scores.held.tolist(), strict=True)):
        if not held:
            entries.append({"id": i, "error": UNKNOWN_ID})
        elif scores.probabilities is not None:  # a network of more than two classes
            entries.append({"id": i, **_classes(scores.probabilities[at], outputs)})
        else:
            entries.append({"id": i, **_binary(float(scores.z[at]), outputs)})
    return entries


def _binary(z: float, outputs: tuple[str, ...]) -> dict:
    """A score's answer: w·x (a network's logit), σ of it, and +1 where it is >= 0 (else −1), as
    ``vfl predict`` writes them."""
    entry: dict = {}
    if "score" in outputs:
        entry["score"] = z
    if "probability" in outputs:
        entry["probability"] = 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0
    if "class" in outputs:
        entry["class"] = 1 if z >= 0 else -1
    return entry


def _classes(proba: np.ndarray, outputs: tuple[str, ...]) -> dict:
    """A multiclass answer: the class ``vfl predict`` writes (the most probable, 0..C−1) and the list of
    every class's probability."""
    entry: dict = {}
    if "class" in outputs:
        entry["class"] = int(np.argmax(proba))
    if "probabilities" in outputs:
        entry["probabilities"] = proba.tolist()
    return entry


def _error(status: int, line: str) -> web.Response:
    return web.json_response({"error": line}, status=status)


def build_app(batcher: MicroBatcher, *, task: str | Callable[[], str], parties: int,
              on_failure: Callable[[str], None], window_ms: float, sealed: bool = False) -> web.Application:
    """The aiohttp application; ``on_failure(line)`` is called once a party is found unavailable.
    ``sealed``: whether the parties' messages travel sealed (``/health`` says so to the operator).
    ``task`` may be a function: per organisation, the front learns the model's classes from each
    federation's process (:mod:`parties.serving.supervisor`)."""
    state: dict = {"failed": None}
    task_now = task if callable(task) else lambda: task

    async def score(request: web.Request) -> web.Response:
        if state["failed"]:
            return _error(503, state["failed"])
        try:
            ids, outputs = parse_request(await request.read(), max_ids=batcher.max_rows, task=task_now())
        except BadRequest as err:
            return _error(400, str(err))
        try:
            scores = await batcher.submit(ids)
        except PartyUnavailable as err:
            if state["failed"] is None:
                state["failed"] = f"{err}: the service ends"
                on_failure(state["failed"])
            return _error(503, state["failed"])
        return web.json_response({"results": answer(ids, scores, outputs)})

    async def health(request: web.Request) -> web.Response:
        if state["failed"]:
            return _error(503, state["failed"])
        return web.json_response({"status": "ok", "parties": parties, "task": task_now(), "sealed": sealed,
                                  "max_batch": batcher.max_rows, "window_ms": window_ms,
                                  "requests": batcher.requests, "batches": batcher.batches,
                                  "aggregation_seconds": round(batcher.busy_seconds, 6)})

    app = web.Application(client_max_size=max(1 << 20, 32 * batcher.max_rows))
    app.router.add_post("/score", score)
    app.router.add_get("/health", health)
    return app
