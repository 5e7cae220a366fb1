"""One serving round over real MPI with made-up parties (``tests/test_serving.py``).

``partial``: party 2 lacks id 30 and party 1 alone has id 50; the leader scores [10, 30, 50, 40, 99]
and prints the scores, the held flags and the plain sums to compare with. ``hostile``: the leader
sends a request whose count disagrees with its length; the passive parties must refuse it, naming it.
"""

import json
import sys
import warnings

import numpy as np
import scipy.sparse as sp
from mpi4py import MPI

from parties.serving import wire
from parties.serving.federation import Federation, serve_passive
from parties.serving.store import PartyModel
from protocols.errors import ProtocolViolation
from protocols.masking import PrecisionWarning
from protocols.secure_aggregation import SecureAggregator

warnings.filterwarnings("ignore", category=PrecisionWarning)
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
ids = {0: [10, 20, 30, 40], 1: [40, 10, 50, 30, 20], 2: [20, 10, 40]}[rank]
rng = np.random.default_rng(rank)
rows = rng.normal(size=(len(ids), 3))
w = rng.normal(size=3)
order = np.argsort(ids)
model = PartyModel(rank, w, sp.csr_matrix(rows), np.array(ids)[order], order, "binary" if rank == 0 else None)
service = comm.Dup()
aggregator = SecureAggregator.over_mpi(comm, seed=0, max_batch=64)
# the plain products, gathered only to check the secure answer (a test, not the protocol)
products = comm.gather({i: float(rows[k] @ w) for k, i in enumerate(ids)}, root=0)

if sys.argv[1] == "partial":
    if rank == 0:
        asked = np.array([10, 30, 50, 40, 99])
        scores = Federation(service, aggregator, model, peer_timeout=30).score(asked)
        plain = [sum(p[i] for p in products) if all(i in p for p in products) else None
                 for i in asked.tolist()]
        print(json.dumps({"z": [None if z != z else z for z in scores.z.tolist()],
                          "held": scores.held.tolist(), "plain": plain}), flush=True)
        Federation(service, aggregator, model, peer_timeout=30).stop()
    else:
        serve_passive(service, aggregator, model, max_batch=32)
else:
    if rank == 0:
        bad = np.array([wire.SCORE, 5, 10, 20], dtype=np.int64)
        for p in (1, 2):
            service.Send([bad, MPI.BYTE], dest=p, tag=wire.TAG_REQUEST)
        comm.Barrier()
    else:
        try:
            serve_passive(service, aggregator, model, max_batch=32)
        except ProtocolViolation as err:
            print(f"[party {rank}] {err}", flush=True)
        comm.Barrier()
aggregator.close()
service.Free()
