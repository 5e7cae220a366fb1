"""Sealed serving for a run trained with ``--secure-channels``: the run's keys, planes of its own.

Such a run pinned every party's public key and a job id in its ``config.json``, and each party keeps
its private key in its own folder (:meth:`parties.plan.JobPlan.sealing_keys`). The serving ranks seal
every message between parties with those keys, as training does (:mod:`protocols.channels`), on two
planes of their own: the requests and acknowledgements (:mod:`parties.serving.wire`), and the secure
sums. The key of a link is derived from the plane's label, and serving labels start with ``serving``,
which no training plane does: a serving frame never opens in training, nor a training frame here.
``vfl predict`` seals its secure sums the same way, on planes labelled ``predict``.

Each start of the service is a fresh *session*. The counters that number a link's messages restart at
0 with every start, so under the run's keys alone a recorded frame of an earlier service would open in
this one. Every party therefore draws 32 random bytes at the start; one ``Allgather`` shares them (in
clear: they are not secret), and the planes are labelled with the SHA-256 of all of them. A party's
own fresh bytes key every link it has, so nothing recorded earlier opens at it. Someone on the path who
alters the bytes only makes two parties' keys differ: the first message between them fails to open and
the service ends naming its sender, as for a tampered frame.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from protocols.channels import ChannelKeys, SecureChannels

#: random bytes each party contributes to a session
SESSION_BYTES = 32
#: what a session is for: its planes' labels start with it (``vfl serve``'s, ``vfl predict``'s); no
#: training plane's label does
USES = (b"serving", b"predict")


@dataclass(frozen=True)
class ServingChannels:
    """One party's sealed links for one session: the service's messages and the secure sums."""

    requests: SecureChannels
    passes: SecureChannels


def session_id(contributions: np.ndarray) -> bytes:
    """The session's digest of every party's contribution (a q × 32 uint8 array, in rank order)."""
    return hashlib.sha256(b"vfl-serving-session/1|" + np.ascontiguousarray(contributions).tobytes()).digest()


def planes(session: bytes, use: bytes = b"serving") -> tuple[bytes, bytes]:
    """The labels of the session's two planes (the requests', the sums')."""
    assert use in USES, use
    digest = session.hex().encode()
    return use + b"-requests|" + digest, use + b"-passes|" + digest


def open_session(comm: MPI.Comm, keys: ChannelKeys | None, use: bytes = b"serving") -> ServingChannels | None:
    """This party's links for one session of ``use`` (collective), or None for a run in clear."""
    if keys is None:
        return None
    rank = comm.Get_rank()
    mine = np.frombuffer(secrets.token_bytes(SESSION_BYTES), dtype=np.uint8)
    everyone = np.empty((comm.Get_size(), SESSION_BYTES), dtype=np.uint8)
    comm.Allgather([mine, MPI.BYTE], [everyone, MPI.BYTE])
    everyone[rank] = mine  # this party's own fresh bytes, whatever came back: they keep earlier frames out
    requests, passes = planes(session_id(everyone), use)
    return ServingChannels(keys.channels(rank, requests), keys.channels(rank, passes))
