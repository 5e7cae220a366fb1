"""Where does each rank run, and how do the ranks talk? Writes ``<out>/rank-<r>.json``.

Every pair of ranks first exchanges a message both ways (so a transport between them is set up);
then each rank records its network namespace, host name, MPI processor name and the established TCP
connections of its namespace (``/proc/self/net/tcp`` lists only those). Ranks that talk over TCP to
each other show one another's addresses there; ranks on shared memory show none.

With ``--pingpong N``, ranks 0 and 1 also time N round trips of one float64, each way (0 → 1 → 0,
then 1 → 0 → 1), after 50 warm-up trips; the seconds of every trip go to the JSON.

    mpiexec -n 4 python -m mpi4py tests/mpi_scripts/host_probe.py --out DIR [--pingpong N]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI


def established_tcp() -> list[tuple[str, str]]:
    """(local, remote) ``address:port`` of the IPv4 TCP connections established in this namespace."""
    def address(hex_pair: str) -> str:
        ip, port = hex_pair.split(":")
        return f"{socket.inet_ntoa(struct.pack('<I', int(ip, 16)))}:{int(port, 16)}"

    pairs = []
    with open("/proc/self/net/tcp") as fh:
        for line in fh.readlines()[1:]:
            fields = line.split()
            if fields[3] == "01":  # TCP_ESTABLISHED
                pairs.append((address(fields[1]), address(fields[2])))
    return sorted(pairs)


def exchange_with_everyone(comm: MPI.Comm) -> None:
    buf = np.zeros(1)
    for peer in range(comm.size):
        if peer == comm.rank:
            continue
        if comm.rank < peer:
            comm.Send(buf, peer)
            comm.Recv(buf, peer)
        else:
            comm.Recv(buf, peer)
            comm.Send(buf, peer)


def round_trips(comm: MPI.Comm, starter: int, trips: int) -> list[float]:
    """Seconds of each round trip started by ``starter`` between ranks 0 and 1."""
    buf, times = np.zeros(1), []
    other = 1 - starter
    for trip in range(trips + 50):
        if comm.rank == starter:
            began = time.perf_counter()
            comm.Send(buf, other)
            comm.Recv(buf, other)
            if trip >= 50:
                times.append(time.perf_counter() - began)
        elif comm.rank == other:
            comm.Recv(buf, starter)
            comm.Send(buf, starter)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--pingpong", type=int, default=0)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    exchange_with_everyone(comm)
    comm.Barrier()
    report = {"rank": comm.rank, "netns": os.readlink("/proc/self/ns/net"), "hostname": socket.gethostname(),
              "processor": MPI.Get_processor_name(), "tcp": established_tcp(),
              "ucx_tls": os.environ.get("UCX_TLS")}
    if args.pingpong and comm.size >= 2:
        report["rtt_from_0"] = round_trips(comm, 0, args.pingpong)
        report["rtt_from_1"] = round_trips(comm, 1, args.pingpong)
    Path(args.out, f"rank-{comm.rank}.json").write_text(json.dumps(report) + "\n")
    comm.Barrier()


if __name__ == "__main__":
    main()
