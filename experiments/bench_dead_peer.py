"""What MPICH does to a process whose connected peer dies (the decision of docs/serving.md's
"Federations, and a party that returns").

Two processes, each under its own ``mpiexec -n 1`` as ``vfl party`` runs them, join by
``Open_port``/``Accept``/``Connect`` and ``Merge`` and set ``MPI.ERRORS_RETURN``. The second then
kills itself (SIGKILL); the first, after a pause, sends it ``--sends`` blocking messages of
``--bytes`` bytes and posts a receive from it. The outcome is whether those calls returned, failed with
an MPI error, or neither within ``--wait`` seconds (the first is then stopped by a timeout). Results in
``experiments/results/dead_peer/`` (JSON and ``table.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "dead_peer"


def survivor(port_file: str, sends: int, nbytes: int, wait: float) -> str:
    """The first process: accept, wait for the peer's death, send and receive; its one-line outcome."""
    import numpy as np
    from mpi4py import MPI

    port = MPI.Open_port()
    Path(port_file).write_text(port)
    comm = MPI.COMM_SELF.Accept(port).Merge(high=False)
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    comm.Barrier()
    time.sleep(1.5)  # the peer has killed itself by now
    buf = np.zeros(max(1, nbytes // 8))
    started = time.monotonic()
    try:
        for _ in range(sends):
            comm.Send(buf, dest=1, tag=1)
        request = comm.Irecv(buf, source=1, tag=2)
        while not request.Test():
            if time.monotonic() - started > wait:
                return f"sends returned; the receive neither completed nor failed in {wait:g} s"
            time.sleep(0.01)
    except MPI.Exception as err:
        return f"an MPI error after {time.monotonic() - started:.2f} s: {err.Get_error_string()}"
    return "every call returned"


def victim(port_file: str) -> None:
    from mpi4py import MPI

    while not Path(port_file).exists() or not Path(port_file).read_text():
        time.sleep(0.05)
    comm = MPI.COMM_SELF.Connect(Path(port_file).read_text()).Merge(high=True)
    comm.Barrier()
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def run_once(sends: int, nbytes: int, wait: float, env: dict[str, str]) -> str:
    from parties.launch import mpiexec_path

    with tempfile.TemporaryDirectory() as folder:
        port_file = str(Path(folder) / "port")
        base = [mpiexec_path(), "-n", "1", sys.executable, "-m", "experiments.bench_dead_peer"]
        first = subprocess.Popen([*base, "--role", "survivor", "--port-file", port_file,
                                  "--sends", str(sends), "--bytes", str(nbytes), "--wait", str(wait)],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        subprocess.run([*base, "--role", "victim", "--port-file", port_file], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, timeout=60)
        try:
            out, _ = first.communicate(timeout=wait + 10)
        except subprocess.TimeoutExpired:
            first.kill()
            first.communicate()
            return f"a call neither returned nor failed within {wait + 10:g} s (the process was stopped)"
    lines = [line for line in out.splitlines() if line.startswith("outcome: ")]
    return lines[-1].removeprefix("outcome: ") if lines else "the survivor ended without an outcome"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments dead_peer", description=__doc__.split("\n")[0])
    p.add_argument("--sends", type=int, default=20)
    p.add_argument("--bytes", type=int, nargs="+", default=[8, 1 << 19],
                   help="message sizes, one run each (8 B goes eagerly; 512 KiB needs the peer)")
    p.add_argument("--wait", type=float, default=15.0)
    args = p.parse_args(argv)
    from parties.netns import TCP_TRANSPORT

    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, **TCP_TRANSPORT, "PYTHONPATH": root}
    records = []
    for nbytes in args.bytes:
        outcome = run_once(args.sends, nbytes, args.wait, env)
        records.append({"netmod": "ofi/tcp", "sends": args.sends, "bytes": nbytes, "wait_s": args.wait,
                        "outcome": outcome, "load": os.getloadavg()[0],
                        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
        print(f"{nbytes:,} B: after the peer's death, {outcome}", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "dead_peer.json").write_text(json.dumps(records, indent=1) + "\n")
    rows = "".join(f"| ofi/tcp | {r['sends']} | {r['bytes']:,} | {r['outcome']} | {r['load']:.1f} | "
                   f"{r['when']} |\n" for r in records)
    (OUT / "table.md").write_text("| netmod | blocking sends | bytes each | outcome | load | when |\n"
                                  "|---|---:|---:|---|---|---|\n" + rows)
    return 0


def _rank(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=("survivor", "victim"), required=True)
    p.add_argument("--port-file", required=True)
    p.add_argument("--sends", type=int, default=20)
    p.add_argument("--bytes", type=int, default=1 << 19)
    p.add_argument("--wait", type=float, default=15.0)
    args = p.parse_args(argv)
    if args.role == "victim":
        victim(args.port_file)
        return
    print(f"outcome: {survivor(args.port_file, args.sends, args.bytes, args.wait)}", flush=True)
    os._exit(0)  # MPI_Finalize would wait on the dead peer


if __name__ == "__main__":
    _rank(sys.argv[1:])
