"""The control plane of one party: every barrier-time exchange, each a named method.

The runtime's main thread meets the other parties here between training segments: barriers, the
leader's control words, the full ϑ vector, and under ``--label-privacy he`` the public keys, the
label-DP setup and the SVRG snapshot's encrypted full pass. All of it runs on the control
communicator (a duplicate of the job's; the data plane has its own), with buffer calls only. Each
exchange is one method, named in :data:`~parties.messages.CONTROL_KINDS`, so a reader finds every
message a party can get outside the data plane in this file.

Variable-length messages use one framing (:meth:`ControlPlane.send_framed`): their word count first,
bounded by the receiver before anything is allocated. Fixed-size ones are received into a buffer of
their exact size, and a message of any other size is refused naming the sender. What arrives is
recorded for the audit (``parties/audit.py``) under its ``AUDIT_*`` label.

The secure aggregation's full passes also run over the control communicator, through their own
duplicate (:meth:`~protocols.secure_aggregation.SecureAggregator.over_mpi`), which they free.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from parties.audit import AuditLog
from parties.messages import (
    AUDIT_CONTROL_WORD,
    AUDIT_FULL_THETA,
    AUDIT_HE_KEY,
    CONTROL_KINDS,
    TAG_FULL_THETA,
    TAG_HE_FULL,
    TAG_HE_FULL_DECRYPTED,
    TAG_HE_FULL_MASKED,
)
from protocols import label_he
from protocols.channels import OVERHEAD_WORDS, SecureChannels
from protocols.errors import ProtocolViolation


class ControlPlane:
    """The control communicator of one party (collective construction: it duplicates ``comm``).

    ``lockstep`` (``sync-global``): the dominators' own communicator, on which they agree on every
    step. ``theta_channels`` seals the full ϑ (``--secure-channels``). :meth:`close` frees both
    communicators (collective).
    """

    def __init__(self, comm: MPI.Comm, audit: AuditLog, *, lockstep_of: list[int] | None = None,
                 theta_channels: SecureChannels | None = None) -> None:
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.comm = comm.Dup()
        self.audit = audit
        self.theta_channels = theta_channels
        self.lockstep = None
        if lockstep_of is not None:
            self.lockstep = comm.Split(0 if self.rank in lockstep_of else MPI.UNDEFINED)
        self._status = MPI.Status()

    def close(self) -> None:
        """Free the communicators (collective); afterwards they are ``MPI.COMM_NULL``."""
        for comm in (self.comm, self.lockstep):
            if comm is not None and comm != MPI.COMM_NULL:
                comm.Free()

    # ------------------------------------------------------------------------------- collectives

    def barrier(self) -> None:
        self.comm.Barrier()

    def broadcast_word(self, value: int, root: int = 0) -> int:
        """One int64 from ``root`` to every party (control decisions: buffer call, never pickle)."""
        word = np.array([value], dtype=np.int64)
        self.comm.Bcast(word, root=root)
        self.audit.record(root, AUDIT_CONTROL_WORD, word)
        return int(word[0])

    def broadcast_float(self, value: float, root: int = 0) -> float:
        word = np.array([value], dtype=np.float64)
        self.comm.Bcast(word, root=root)
        self.audit.record(root, AUDIT_CONTROL_WORD, word)
        return float(word[0])

    def sum_word(self, value: int) -> int:
        """Σ over parties of one int64 each (every party learns the total)."""
        mine = np.array([value], dtype=np.int64)
        total = np.empty(1, dtype=np.int64)
        self.comm.Allreduce(mine, total, op=MPI.SUM)
        self.audit.record(-1, AUDIT_CONTROL_WORD, total)
        return int(total[0])

    def agree(self, go: bool) -> bool:
        """``sync-global``: whether every dominator goes on (one agreement per step: they stop together)."""
        assert self.lockstep is not None
        mine = np.array([int(go)], dtype=np.int64)
        every = np.empty(1, dtype=np.int64)
        self.lockstep.Allreduce(mine, every, op=MPI.MIN)
        return bool(every[0])

    def broadcast_public_key(self, root: int, mine: bytes | None) -> bytes:
        """``root``'s public key to every party (``mine`` at the root): its byte count first, bounded."""
        size = np.array([0 if mine is None else len(mine)], dtype=np.int64)
        self.comm.Bcast(size, root=root)
        if not 0 < size[0] <= label_he.MAX_KEY_BYTES:
            raise ProtocolViolation(root, CONTROL_KINDS["broadcast_public_key"],
                                    f"announced {int(size[0])} bytes")
        key = (np.frombuffer(mine, dtype=np.uint8).copy() if mine is not None
               else np.empty(int(size[0]), dtype=np.uint8))
        self.comm.Bcast(key, root=root)
        self.audit.record(root, AUDIT_HE_KEY, label_he.bytes_to_words(key.tobytes()))
        return key.tobytes()

    def gather_dp_setup(self, feature_bits: int, squared_bound: float) -> np.ndarray:
        """``--epsilon``: every party's (feature bits, c_l²), ``[q, 2]`` float64; the caller checks them."""
        every = np.empty((self.size, 2), dtype=np.float64)
        self.comm.Allgather(np.array([feature_bits, squared_bound], dtype=np.float64), every)
        return every

    def gather_row_norms(self, largest: float, quantile: float, spectral: float) -> np.ndarray:
        """Every party's :func:`vertical.step_size.block_smoothness`, ``[q, 3]`` float64: the largest and
        the 99.9th-percentile squared row norm of its block and its Gram matrix's top eigenvalue over n,
        what the default step is derived from. A triple that is not finite with 0 <= quantile <= largest
        and 0 <= eigenvalue <= largest would make every party's step wrong, so it ends the job naming its
        sender."""
        every = np.empty((self.size, 3), dtype=np.float64)
        self.comm.Allgather(np.array([largest, quantile, spectral], dtype=np.float64), every)
        for sender, (top, high, eigen) in enumerate(every):
            if not (np.isfinite(every[sender]).all() and 0 <= high <= top and 0 <= eigen <= top):
                raise ProtocolViolation(sender, CONTROL_KINDS["gather_row_norms"],
                                        f"largest {top!r}, 99.9th-percentile {high!r} squared row norms and "
                                        f"Gram eigenvalue {eigen!r}: expected finite numbers with "
                                        "0 <= percentile <= largest and 0 <= eigenvalue <= largest")
        return every

    # ------------------------------------------------------------------------------ the full ϑ

    def share_theta(self, theta: np.ndarray, root: int) -> None:
        """The full ϑ from ``root`` to every party, in place: one broadcast, or sealed point to point
        (a broadcast cannot be encrypted per receiver)."""
        if self.theta_channels is None:
            self.comm.Bcast(theta, root=root)
            self.audit.record(root, AUDIT_FULL_THETA, theta)
        elif self.rank == root:
            self.send_theta(theta, [p for p in range(self.size) if p != root])
        else:
            self.receive_theta(theta, root)

    def send_theta(self, theta: np.ndarray, dests: list[int]) -> None:
        """The full ϑ from this party to ``dests`` only, point to point, sealed when channels are on."""
        channels = self.theta_channels
        bufs = {p: theta if channels is None else channels.seal(p, TAG_FULL_THETA, theta) for p in dests}
        MPI.Request.Waitall([self.comm.Isend(buf, p, TAG_FULL_THETA) for p, buf in bufs.items()])

    def receive_theta(self, theta: np.ndarray, root: int) -> None:
        """The full ϑ of :meth:`send_theta`, into ``theta`` (its size is the one expected)."""
        channels = self.theta_channels
        if channels is None:
            self._recv_exact(theta, root, TAG_FULL_THETA)
        else:
            buf = np.empty(theta.size + OVERHEAD_WORDS, dtype=np.uint64)
            self._recv_exact(buf, root, TAG_FULL_THETA)
            theta[:] = channels.open(root, TAG_FULL_THETA, buf).view(np.float64)
        self.audit.record(root, AUDIT_FULL_THETA, theta)

    # ------------------------------------------------------- --label-privacy he: the full pass

    def send_he_full(self, dest: int, words: np.ndarray) -> None:
        """Leader: the encrypted ϑ_0 (``label_he.pack_bytes`` words) to passive party ``dest``."""
        self.send_framed(TAG_HE_FULL, dest, words)

    def recv_he_full(self, root: int, limit_words: int) -> bytes:
        return self.recv_framed(TAG_HE_FULL, root, limit_words)

    def send_he_full_masked(self, root: int, words: np.ndarray) -> None:
        """Passive party: its masked encrypted X_lᵀϑ_0 back to the leader."""
        self.send_framed(TAG_HE_FULL_MASKED, root, words)

    def recv_he_full_masked(self, source: int, limit_words: int) -> bytes:
        return self.recv_framed(TAG_HE_FULL_MASKED, source, limit_words)

    def send_he_full_decrypted(self, dest: int, words: np.ndarray) -> None:
        """Leader: the decryption, still masked, of ``dest``'s answer (a fixed 2 d_l words)."""
        self.comm.Send(words, dest, TAG_HE_FULL_DECRYPTED)

    def recv_he_full_decrypted(self, root: int, n_words: int) -> np.ndarray:
        words = np.empty(n_words, dtype=np.uint64)
        self._recv_exact(words, root, TAG_HE_FULL_DECRYPTED)
        return words

    # --------------------------------------------------------------------------------- framing

    def send_framed(self, tag: int, dest: int, words: np.ndarray) -> None:
        """A variable-length message: its word count first, then the words (both on ``tag``)."""
        self.comm.Send(np.array([words.size], dtype=np.uint64), dest, tag)
        self.comm.Send(words, dest, tag)

    def recv_framed(self, tag: int, source: int, limit_words: int) -> bytes:
        """The bytes of a :meth:`send_framed` message of ``label_he.pack_bytes`` words: the announced
        size is bounded before anything is allocated, the framing checked before it is parsed."""
        what = CONTROL_KINDS[tag]
        size = np.zeros(1, dtype=np.uint64)
        self._recv_exact(size, source, tag)
        if not 2 < int(size[0]) <= limit_words:
            raise ProtocolViolation(source, what, f"announced {int(size[0])} words (at most {limit_words})")
        framed = np.empty(int(size[0]), dtype=np.uint64)
        self._recv_exact(framed, source, tag)
        return label_he.unpack_bytes(source, framed, what)[1]

    def _recv_exact(self, buf: np.ndarray, source: int, tag: int) -> None:
        """A blocking ``Recv`` of exactly ``buf.nbytes`` bytes; any other size is the sender's fault."""
        what = CONTROL_KINDS[tag]
        try:
            self.comm.Recv(buf, source, tag, self._status)
        except MPI.Exception as error:
            if error.Get_error_class() != MPI.ERR_TRUNCATE:
                raise
            raise ProtocolViolation(source, what, f"longer than the {buf.nbytes} bytes expected") from None
        if self._status.Get_count(MPI.BYTE) != buf.nbytes:
            raise ProtocolViolation(source, what, f"{self._status.Get_count(MPI.BYTE)} bytes, expected "
                                                  f"{buf.nbytes}")
