"""Which jobs take the inline B = 1 hot path (docs/runtime.md, "The B = 1 hot path").

The communication thread runs a dominator's steps and applies the (ϑ, i) it receives itself only where
that is the same algorithm and cheaper than a hand-off: a linear block, the asynchronous mode, small B,
no label plane and none of the emulations that act between threads. Every other job keeps the worker
threads; the MPI tests of both paths are the runtime's own (``tests/test_runtime.py`` and
``tests/test_minibatch_runtime.py`` run inline jobs, ``tests/test_synchrony.py``,
``tests/test_link_delay.py`` and ``tests/test_vertical_nn_runtime.py`` the workers).
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import numpy as np
import pytest

from parties.data_plane import INLINE_MAX_BATCH, inline_path
from parties.dominated import DominatedLoop, _Segment
from parties.options import RuntimeOptions


class _Linear:
    merges_messages = True


class _Network:
    merges_messages = False


BASE = RuntimeOptions(active_ranks=(0, 1, 2, 3), threads=4, seed=0)


def test_the_papers_setting_runs_inline():
    assert inline_path(BASE, _Linear(), label=None)
    assert inline_path(dataclasses.replace(BASE, batch_size=INLINE_MAX_BATCH, inflight=4, piggyback=True),
                       _Linear(), label=None)


@pytest.mark.parametrize("change", [
    {"mode": "sync-global"},  # a step waits for acknowledgements
    {"batch_size": INLINE_MAX_BATCH + 1},  # large batches: the k workers' kernels in parallel
    {"straggler": 1, "slowdown": 0.4},  # the straggler's slowed workers
    {"straggler": 1, "slowdown": 0.0, "apply_delay": 0.02},
    {"link_delay": 0.001},  # delivered by the link-delay thread
    {"link_jitter": 0.001},
], ids=lambda change: ",".join(change))
def test_other_jobs_keep_the_worker_threads(change):
    options = dataclasses.replace(BASE, **change)
    assert not inline_path(options, _Linear(), label=None)


def test_a_network_or_a_label_plane_keeps_the_worker_threads():
    assert not inline_path(BASE, _Network(), label=None)  # one step per message, under one lock
    assert not inline_path(BASE, _Linear(), label=object())  # --label-privacy he: encrypted batches


def test_the_benchmark_table_gives_each_settings_medians_and_their_ratio():
    from experiments.bench_hot_path import table

    runs = [{"tree": tree, "setting": setting, "ms_per_update": ms, "load_before": 1.0}
            for setting, base, head in (("alone", [0.9, 1.2, 0.6], [0.3, 0.2, 0.4]), ("beside", [2.0], [1.0]))
            for tree, values in (("base", base), ("head", head)) for ms in values]
    text = table({"commits": {"base": "aaaa", "head": "bbbb"}, "cpu": "x", "command": "c"}, runs)
    assert "| alone | base | `aaaa` | 0.900 (0.600–1.200) |" in text
    assert "| alone | base / head | | **3.00×** |" in text  # median 0.9 against 0.3
    assert "| beside | base / head | | **2.00×** |" in text


class _Loop(DominatedLoop):
    """The inline path's ordering alone: requests whose result comes back while they are still being
    issued (``early``: every child's partial sum arrived before this root's own start, so the node
    completes the request inside :meth:`_request`), the others later, as the communication thread
    delivers them; a step records its request."""

    inline = True

    def __init__(self, inflight: int, early: set[int]) -> None:
        self.inflight, self.early = inflight, early
        self.inline_lock = threading.RLock()
        self.later: list = []
        self.steps: list[int] = []

    def _may_start(self, step: int, deadline) -> bool:
        return True

    def _request(self, rows, theta=None, on_result=None):
        rid = int(rows[0])
        if rid in self.early:
            on_result(rid, np.array([float(rid)]))
        else:
            self.later.append(functools.partial(on_result, rid, np.array([float(rid)])))
        return rid, None

    def _step(self, seg, step_rows, scores) -> None:
        self.steps.append(int(scores[0]))
        seg.done += 1


@pytest.mark.parametrize("inflight", [1, 3])
@pytest.mark.parametrize("early", [{0}, {0, 2, 4}, {1, 2, 3}, set(range(6))])
def test_a_request_completed_while_it_is_issued_is_stepped_in_order_and_the_segment_ends(inflight, early):
    """Two full-suite runs saw a B = 1 dominator go silent at a segment's end ("party 0 has been silent
    for 30.8 s while party 2 waited for its DONE"): a request that completed inside its own issuing had
    its scores filed before the request was in line, and with nothing else out nobody took them."""
    loop = _Loop(inflight, early)
    seg = _Segment(np.arange(6)[:, None], 6, None, [1])
    with loop.inline_lock:
        loop._drain(seg)
    while loop.later:  # the communication thread, one result at a time, oldest first
        loop.later.pop(0)()
    assert seg.finished.is_set() and seg.done == 6
    assert loop.steps == list(range(6))
