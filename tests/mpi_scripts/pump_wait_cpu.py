"""The compiled pump's wait, alone in a process: how much CPU it burns while no message comes.

``python tests/mpi_scripts/pump_wait_cpu.py SECONDS``: a thread waits in the pump's ``_wait`` on
``COMM_SELF`` (compiled, without the GIL); the main thread prints the waiting thread's CPU seconds over
SECONDS of its wait as ``CPU <seconds>``, then sends it the message that ends it.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from parties import compiled_loop as cl
from parties.compiled_pump import handle


def main() -> None:
    seconds = float(sys.argv[1])
    s = np.zeros(cl.S_SLOTS, np.int64)
    s[[cl.COMM, cl.BYTE, cl.ANY_SRC, cl.ANY_TAG]] = (handle(MPI.COMM_SELF), handle(MPI.BYTE),
                                                      MPI.ANY_SOURCE, MPI.ANY_TAG)
    info = np.zeros(8, np.int64)
    clocks: list[int] = []

    def wait() -> None:
        clocks.append(time.pthread_getcpuclockid(threading.get_ident()))
        cl._wait(s, info)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.5)  # the wait has begun (and numba's cache is loaded)
    start = time.clock_gettime(clocks[0])
    time.sleep(seconds)
    cpu = time.clock_gettime(clocks[0]) - start
    message = np.zeros(1, np.int64)
    sent = MPI.COMM_SELF.Isend(message, dest=0, tag=5)  # a blocking send to oneself may wait for its receive
    waiter.join()
    MPI.COMM_SELF.Recv(np.zeros(1, np.int64), source=0, tag=5)
    sent.Wait()
    assert info[1] == 5 and info[2] == 8, info  # it woke for that message: tag 5, 8 bytes
    print(f"CPU {cpu:.3f}", flush=True)


if __name__ == "__main__":
    main()
