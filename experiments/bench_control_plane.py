"""What deadlines cost at barrier time: the control plane's polled point-to-point exchanges against the
blocking MPI collectives they replaced (issue 26, liveness as progress).

Every barrier-time exchange of the runtime is now ``Isend``/``Irecv`` completed by polling (``Test``,
then sleeps from 20 µs to 1 ms), so that a party that never arrives is named; ``MPI_Barrier`` and
``MPI_Allreduce`` would wait for it forever. One ``mpiexec`` job times, in alternating blocks of
``--calls`` calls so that load changes hit both alike: ``ControlPlane.barrier`` against ``Barrier``,
and ``ControlPlane.agree`` (``sync-global``'s per-step agreement of the dominators) against an
``Allreduce(MIN)`` of one word.

    python -m experiments control_plane [--parties 3] [--blocks 10] [--calls 200]

Outputs in ``experiments/results/control_plane/``: ``results.json`` (every block's µs per call, the
load average before and after, the CPU model) and ``table.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "control_plane"
KINDS = ("barrier, polled point to point", "Barrier (blocking collective)",
         "agree, polled point to point", "Allreduce MIN (blocking collective)")


def _rank(blocks: int, calls: int, result: str) -> None:
    """One rank: alternate the four kinds, ``calls`` calls per block; rank 0 writes µs per call."""
    import numpy as np
    from mpi4py import MPI

    from parties.audit import AuditLog
    from parties.control_plane import ControlPlane
    from protocols.liveness import Liveness

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    control = ControlPlane(comm, AuditLog(rank, False), Liveness(rank, size, 30.0),
                           lockstep_of=list(range(size)))
    plain = comm.Dup()
    one, out = np.ones(1, dtype=np.int64), np.empty(1, dtype=np.int64)
    calls_of = (control.barrier, plain.Barrier, lambda: control.agree(True),
                lambda: plain.Allreduce(one, out, op=MPI.MIN))
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for _ in range(blocks):
        for kind, call in zip(KINDS, calls_of, strict=True):
            plain.Barrier()
            started = time.perf_counter()
            for _ in range(calls):
                call()
            times[kind].append((time.perf_counter() - started) / calls * 1e6)
    control.close()
    plain.Free()
    if rank == 0:
        Path(result).write_text(json.dumps(times))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments control_plane",
                                description=__doc__.splitlines()[0])
    p.add_argument("--parties", type=int, default=3)
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--rank-result", default=None, help=argparse.SUPPRESS)  # set when run as a rank
    args = p.parse_args(argv)
    if args.rank_result is not None:
        _rank(args.blocks, args.calls, args.rank_result)
        return {}
    from experiments._machine import cpu_model
    from parties.launch import run_mpi_module

    args.out.mkdir(parents=True, exist_ok=True)
    raw = args.out / "per_block.json"
    load_before = os.getloadavg()[0]
    code, output = run_mpi_module(args.parties, "experiments.bench_control_plane",
                                  ["--blocks", str(args.blocks), "--calls", str(args.calls),
                                   "--rank-result", str(raw)], echo=False)
    if code != 0:
        raise SystemExit(f"the job failed ({code}):\n{output[-2000:]}")
    times = json.loads(raw.read_text())
    raw.unlink()
    summary = {"parties": args.parties, "blocks": args.blocks, "calls": args.calls, "cpu": cpu_model(),
               "load_before": load_before, "load_after": os.getloadavg()[0],
               "command": "python -m experiments control_plane " + " ".join(argv or sys.argv[1:]),
               "microseconds_per_call": times}
    (args.out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    rows = ["| exchange | µs per call (median of blocks; min–max) |", "|---|---|"]
    for kind in KINDS:
        t = times[kind]
        rows.append(f"| {kind} | {statistics.median(t):.0f} ({min(t):.0f}–{max(t):.0f}) |")
    table = "\n".join(rows) + (f"\n\nq = {args.parties}, {args.blocks} alternating blocks of {args.calls} "
                               f"calls; {summary['cpu']}; load average {load_before:.2f} before, "
                               f"{summary['load_after']:.2f} after; command: `{summary['command']}`\n")
    (args.out / "table.md").write_text(table)
    print(table)
    return summary


if __name__ == "__main__":
    main()
