"""One serving round over real MPI with made-up parties (``tests/test_serving.py``).

``partial``: party 2 lacks id 30 and party 1 alone has id 50; the leader scores [10, 30, 50, 40, 99]
and prints the scores, the held flags and the plain sums to compare with. ``hostile``: the leader
sends a request whose count disagrees with its length; the passive parties must refuse it, naming it.

Sealed (``--secure-channels``, test keys and a real session): ``partial-sealed`` is ``partial`` over
sealed links; ``tampered-request``: the leader flips one bit of party 1's sealed request and sends
party 2 one sealed under training's data plane; both must refuse it, naming the leader.
``tampered-ack``: party 2 flips one bit of its sealed acknowledgement; the leader must name party 2.
"""

import hashlib
import json
import sys
import warnings

import numpy as np
import scipy.sparse as sp
from mpi4py import MPI

from parties.serving import wire
from parties.serving.federation import Federation, contribution, serve_passive
from parties.serving.sealing import open_session
from parties.serving.store import PartyModel
from protocols.channels import ChannelKeys, public_key
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
scenario = sys.argv[1]
keys = None
if scenario not in ("partial", "hostile"):
    privates = [hashlib.sha256(f"test key {r}".encode()).digest() for r in range(comm.Get_size())]
    keys = ChannelKeys(privates[rank], tuple(public_key(p) for p in privates), b"test job")
channels = open_session(comm, keys)
requests = None if channels is None else channels.requests
service = comm.Dup()
aggregator = SecureAggregator.over_mpi(comm, seed=0, max_batch=64,
                                       channels=None if channels is None else channels.passes)
# the plain products, gathered only to check the secure answer (a test, not the protocol)
products = comm.gather({i: float(rows[k] @ w) for k, i in enumerate(ids)}, root=0)



def tampered_ack() -> None:
    """Party 2: take one request honestly, acknowledge it with one bit flipped, add its part."""
    inbox = wire.RequestInbox(service, 32, requests)
    _, asked = inbox.receive(lambda: None)
    ack = wire.on_wire(requests, wire.LEADER, wire.TAG_ACK, np.array([asked.size], dtype=np.int64))
    ack[1] ^= np.uint64(1)
    sent = service.Isend([ack, MPI.BYTE], dest=wire.LEADER, tag=wire.TAG_ACK)
    aggregator.sum(contribution(model, asked), root=wire.LEADER)
    sent.Wait()
    assert inbox.receive(lambda: None)[0] == wire.STOP


if scenario in ("partial", "partial-sealed"):
    if rank == 0:
        asked = np.array([10, 30, 50, 40, 99])
        federation = Federation(service, aggregator, model, peer_timeout=30, channels=requests)
        scores = federation.score(asked)
        plain = [sum(p[i] for p in products) if all(i in p for p in products) else None
                 for i in asked.tolist()]
        sealed = federation.channels is not None and aggregator.transport.channels is not None
        print(json.dumps({"z": [None if z != z else z for z in scores.z.tolist()],
                          "held": scores.held.tolist(), "plain": plain, "sealed": sealed}), flush=True)
        federation.stop()
    else:
        serve_passive(service, aggregator, model, max_batch=32, channels=requests)
elif scenario == "tampered-ack":
    if rank == 0:
        federation = Federation(service, aggregator, model, peer_timeout=30, channels=requests)
        try:
            federation.score(np.array([10, 20]))
        except ProtocolViolation as err:
            print(f"[party {rank}] {err}", flush=True)
        federation.stop()
    elif rank == 1:
        serve_passive(service, aggregator, model, max_batch=32, channels=requests)
    else:
        tampered_ack()
elif scenario == "tampered-request":
    if rank == 0:
        request = wire.encode_request(np.array([10, 20]))
        flipped = wire.on_wire(requests, 1, wire.TAG_REQUEST, request)
        flipped[2] ^= np.uint64(1)
        service.Send([flipped, MPI.BYTE], dest=1, tag=wire.TAG_REQUEST)
        training = keys.channels(0, b"data").seal(2, wire.TAG_REQUEST, request)
        service.Send([training, MPI.BYTE], dest=2, tag=wire.TAG_REQUEST)
        comm.Barrier()
    else:
        try:
            serve_passive(service, aggregator, model, max_batch=32, channels=requests)
        except ProtocolViolation as err:
            print(f"[party {rank}] {err}", flush=True)
        comm.Barrier()
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
