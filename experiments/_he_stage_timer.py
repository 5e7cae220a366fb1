"""Per-rank stage timers for ``python -m experiments label_he_profile``, installed in each rank by a
``sitecustomize`` the benchmark writes (no change to the code it measures).

Each HE step of the label plane (protocols/label_he.py, protocols/label_he_pack.py,
parties/label_plane.py) is wrapped: wall seconds and calls per stage, and the thread's CPU seconds
inside it, summed per rank; a rank's process CPU time rides along. Ranks end with the C library's
``exit`` (parties/lifecycle.py ``exit_now``), so no ``atexit`` runs: the totals are written to
``$VFL_HE_STAGES/<rank>.json`` at most every 0.2 s and whenever a stage ends after that.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time

_TOTALS: dict[str, list[float]] = {}
_LOCK = threading.Lock()
_LAST = [0.0]
#: the process's CPU seconds when its first stage began (start-up, data loading and compilation before)
_FIRST: list[float] = []
#: module -> [(class, attribute, stage name)]; an attribute a tree lacks is skipped, so the same timers
#: measure a tree before a refactoring and after it (two names of one stage are never both on a batch's
#: path: ``masked`` and ``masked_batch``, ``column_sums`` and ``sums_and_bounds`` outside a full pass)
TARGETS = {
    "protocols.label_he": [("LabelKey", "encrypt", "encrypt theta"), ("LabelKey", "decrypt", "decrypt"),
                           ("BlockGradient", "column_sums", "column sums"),
                           ("BlockGradient", "sums_and_bounds", "column sums"),
                           ("BlockGradient", "masked", "masked (all)"),
                           ("BlockGradient", "masked_batch", "masked (all)"),
                           ("BlockGradient", "encrypt_masks", "encrypt masks"),
                           ("BlockGradient", "unmask", "unmask"),
                           ("BlockGradient", "unmask_batch", "unmask")],
    "protocols.label_he_pack": [("PackedBlockGradient", "masked_packed", "masked (all)"),
                                ("PackedBlockGradient", "masked_packed_batch", "masked (all)"),
                                ("PackedBlockGradient", "encrypt_slot_masks", "encrypt masks"),
                                ("PackedBlockGradient", "unmask_packed", "unmask"),
                                ("PackedBlockGradient", "unmask_packed_batch", "unmask")],
    "parties.label_plane": [("LabelPlane", "_reply", "wait for decryption"),
                            ("LabelPlane", "await_answers", "wait for answers (HE_AHEAD)"),
                            ("LabelPlane", "passive_gradient", "passive batch (all)"),
                            ("LabelPlane", "decrypt_for", "decrypt for (all)"),
                            ("LabelPlane", "encrypt_batch", "encrypt batch (all)")],
}


def _dump(force: bool = False) -> None:
    now = time.monotonic()
    if not force and now - _LAST[0] < 0.2:
        return
    _LAST[0] = now
    out = os.environ.get("VFL_HE_STAGES")
    rank = os.environ.get("PMI_RANK")
    if not out or rank is None:
        return
    with _LOCK:
        stages = {k: {"wall_s": v[0], "cpu_s": v[1], "calls": int(v[2])} for k, v in _TOTALS.items()}
    record = {"rank": int(rank), "threads_cpu_s": _threads_cpu(), "process_cpu_s": time.process_time(),
              "cpu_before_first_stage_s": _FIRST[0] if _FIRST else None,
              "threads_cpu_before_first_stage_s": _FIRST[1] if _FIRST else {}, "stages": stages}
    tmp = os.path.join(out, f".{rank}.{threading.get_ident()}.json")  # threads dump on their own
    try:
        with open(tmp, "w") as fh:
            json.dump(record, fh)
        os.replace(tmp, os.path.join(out, f"{rank}.json"))
    except OSError:  # a measurement must never fail the job it measures
        pass


def _threads_cpu() -> dict[str, float]:
    """CPU seconds (user + system) per thread name of this process, from ``/proc/self/task``."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _FIRST:
            _FIRST.append(time.process_time())
            _FIRST.append(_threads_cpu())
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            dw, dc = time.perf_counter() - wall, time.thread_time() - cpu
            with _LOCK:
                acc = _TOTALS.setdefault(name, [0.0, 0.0, 0])
                acc[0] += dw
                acc[1] += dc
                acc[2] += 1
            _dump()
    return wrapper


def _patch(module) -> None:
    for cls, attr, name in TARGETS[module.__name__]:
        owner = getattr(module, cls)
        if attr in owner.__dict__:
            setattr(owner, attr, _timed(name, owner.__dict__[attr]))


class _Hook(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Wraps the targets of a module right after it is first executed."""

    def find_spec(self, name, path, target=None):
        if name not in TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self._loader.exec_module(module)
        _patch(module)


def install() -> None:
    sys.meta_path.insert(0, _Hook())
    threading.Thread(target=_heartbeat, daemon=True).start()


def _heartbeat() -> None:
    while True:
        time.sleep(0.5)
        _dump(force=True)
