"""Run under ``mpiexec -n 3``: a ``--label-privacy he`` runtime (party 0 dominates, 1 and 2 are passive)
where passive party 1 answers its second encrypted batch with a forged masked gradient.

``argv[1]`` picks the forgery: ``wide`` (B well-formed ciphertexts, as many values as the batch has
rows: decrypting them would let party 1 solve for the batch's ϑ) or ``garbage`` (bytes that are no
ciphertext array); with SVRG, at the snapshot's encrypted full pass: ``full-wide`` (the n ciphertexts
of ϑ_0 sent back as its "gradient") or ``full-huge`` (an announced answer of 2^40 words, which the
leader must refuse before allocating it). Party 0 must end the job naming party 1; without that, every
rank closes normally and prints ``NOT REJECTED``.
"""

from __future__ import annotations

import sys

from mpi4py import MPI

from protocols.label_he_key_spawn import start_early

if MPI.COMM_WORLD.Get_rank() == 0:  # its key made during the imports below, as in parties/rank.py
    start_early("ou", 2048)

import numpy as np

from parties.runtime import PartyRuntime, RuntimeOptions
from protocols.label_he import Pending
from tests.mpi_scripts.small_party import small_party

BATCH = 16


def main() -> None:
    scenario = sys.argv[1]
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    full = scenario.startswith("full")
    party = small_party(rank, active=rank == 0, rule="svrg" if full else "sgd", lazy=False, batch_size=BATCH)
    runtime = PartyRuntime(comm, party, RuntimeOptions(active_ranks=(0,), threads=1, seed=0, batch_size=BATCH,
                                                       label_privacy="he"))
    if rank == 1:
        gradients = runtime.label.gradients[0]
        honest, calls = gradients.masked, []

        def forged(payload: bytes, rows: np.ndarray, progress=None) -> bytes:
            calls.append(1)
            if len(calls) < (1 if full else 2):
                return honest(payload, rows, progress)
            if scenario == "garbage":
                return bytes(300)
            return payload  # the dominator's own ciphertexts: as many values as rows

        def forged_batch(payload: bytes, rows: np.ndarray, progress=None):  # the batches' path
            if len(calls) < 1:
                calls.append(1)
                return honest_batch(payload, rows, progress)
            return forged(payload, rows, progress), Pending([], np.zeros(0))

        honest_batch = gradients.masked_batch
        gradients.masked, gradients.masked_batch = forged, forged_batch
        if scenario == "full-huge":
            runtime.control.send_framed = lambda tag, dest, words: runtime.control.comm.Send(
                np.array([1 << 40], dtype=np.uint64), dest, tag)
    if full:
        runtime.snapshot(0)
    if rank == 0:
        runtime.dominate(4)
        runtime.finish_segment()
    # drain() is the synchronisation: party 1 cannot pass it before party 0 answered (or refused) every
    # masked gradient it sent, the forged one included, and the snapshot's full pass is answered before
    # snapshot() returns; a refusal ends the job before anyone gets here
    runtime.drain()
    runtime.close()
    print(f"NOT REJECTED {rank}", flush=True)


if __name__ == "__main__":
    main()
