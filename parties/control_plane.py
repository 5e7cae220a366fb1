"""The control plane of one party: every barrier-time exchange, each a named method.

The runtime's main thread meets the other parties here between training segments: barriers, the
leader's control words, the full ϑ vector, and under ``--label-privacy he`` the public keys and
the SVRG snapshot's encrypted full pass. All of it runs on the control
communicator (a duplicate of the job's; the data plane has its own), with buffer calls only. Each
exchange is one method, named in :data:`~parties.messages.CONTROL_KINDS`, so a reader finds every
message a party can get outside the data plane in this file.

Every exchange is point to point (``Isend``/``Irecv``, completed by polling,
:class:`~protocols.liveness.Pending`), never a blocking collective: a party that does not deliver its
part within ``--peer-timeout`` (at the barrier-time level, ``protocols/liveness.py``) ends the job named,
where a ``Barrier`` or ``Bcast`` would have waited for it forever without saying who was missing.

Variable-length messages use one framing (:meth:`ControlPlane.send_framed`): their word count first,
bounded by the receiver before anything is allocated. Fixed-size ones are received into a buffer of
their exact size, and a message of any other size is refused naming the sender. What arrives is
recorded for the audit (``parties/audit.py``) under its ``AUDIT_*`` label.

The secure aggregation's full passes also run over the control communicator, through their own
duplicate (:meth:`~protocols.secure_aggregation.SecureAggregator.over_mpi`), which they free.
"""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from parties.audit import AuditLog
from parties.messages import (
    AUDIT_CONTROL_WORD,
    AUDIT_FULL_THETA,
    AUDIT_HE_KEY,
    CONTROL_KINDS,
    TAG_AGREE,
    TAG_BARRIER,
    TAG_FULL_THETA,
    TAG_GATHER,
    TAG_HE_FULL,
    TAG_HE_FULL_DECRYPTED,
    TAG_HE_FULL_MASKED,
    TAG_KEY,
    TAG_WORD,
)
from protocols import label_he
from protocols.channels import OVERHEAD_WORDS, SecureChannels
from protocols.errors import ProtocolViolation
from protocols.liveness import Liveness, Pending


class ControlPlane:
    """The control communicator of one party (collective construction: it duplicates ``comm``).

    ``liveness`` holds the deadlines of every wait (``protocols/liveness.py``; None: no deadline, for a
    caller with nobody to wait for). ``lockstep_of``
    (``sync-global``): the dominators, which agree on every step. ``theta_channels`` seals the full ϑ
    (``--secure-channels``). :meth:`close` frees the communicator (collective).
    """

    def __init__(self, comm: MPI.Comm, audit: AuditLog, liveness: Liveness | None = None, *,
                 lockstep_of: list[int] | None = None, theta_channels: SecureChannels | None = None) -> None:
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.liveness = liveness if liveness is not None else Liveness(self.rank, self.size, None)
        self.comm = self.liveness.dup(comm, "the set-up of the control plane")
        self.audit = audit
        self.theta_channels = theta_channels
        #: sync-global: the dominators that agree on each step (None otherwise)
        self.lockstep = None if lockstep_of is None or self.rank not in lockstep_of else list(lockstep_of)
        self._barriers = 0  # barriers passed: each token carries its barrier's number

    def close(self) -> None:
        """Free the communicator (collective); afterwards it is ``MPI.COMM_NULL``."""
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()

    def _pending(self, tag: int | str, level: int | None = None) -> Pending:
        return Pending(self.comm, self.liveness, CONTROL_KINDS[tag],
                       self.liveness.exchange_level if level is None else level)

    def _others(self) -> list[int]:
        return [p for p in range(self.size) if p != self.rank]

    def _from_everyone(self, mine: np.ndarray, tag: int, parties: list[int] | None = None) -> np.ndarray:
        """``mine`` to every other party of ``parties`` (default: all) and theirs back: ``[q, *mine.shape]``
        (row p from party p; rows of parties not in ``parties`` are left zero)."""
        parties = list(range(self.size)) if parties is None else parties
        every = np.zeros((self.size, *mine.shape), dtype=mine.dtype)
        every[self.rank] = mine
        pending = self._pending(tag)
        for p in parties:
            if p != self.rank:
                pending.recv(every[p], p, tag)
                pending.send(mine, p, tag)
        pending.wait()
        return every

    def _from_root(self, buf: np.ndarray, root: int, tag: int, level: int | None = None) -> np.ndarray:
        """``buf`` from ``root`` to every other party, in place (the root sends; the others receive)."""
        pending = self._pending(tag, level)
        if self.rank == root:
            for p in self._others():
                pending.send(buf, p, tag)
        else:
            pending.recv(buf, root, tag)
        pending.wait()
        return buf

    # ------------------------------------------------------------------------------- collectives

    def barrier(self) -> None:
        """Every party is here: a numbered token to and from every other party (a token of another
        barrier is its sender's fault)."""
        self._barriers += 1
        every = self._from_everyone(np.array([self._barriers], dtype=np.int64), TAG_BARRIER)
        for sender, number in enumerate(every[:, 0].tolist()):
            if number != self._barriers:
                raise ProtocolViolation(sender, CONTROL_KINDS[TAG_BARRIER],
                                        f"#{number} at barrier #{self._barriers}")

    def broadcast_word(self, value: int, root: int = 0) -> int:
        """One int64 from ``root`` to every party (control decisions: buffer call, never pickle)."""
        word = self._from_root(np.array([value], dtype=np.int64), root, TAG_WORD)
        self.audit.record(root, AUDIT_CONTROL_WORD, word)
        return int(word[0])

    def broadcast_float(self, value: float, root: int = 0) -> float:
        word = self._from_root(np.array([value], dtype=np.float64), root, TAG_WORD)
        self.audit.record(root, AUDIT_CONTROL_WORD, word)
        return float(word[0])

    def sum_word(self, value: int) -> int:
        """Σ over parties of one int64 each (every party learns the total; the runtime sums public
        counts, the dominated updates each party did)."""
        every = self._from_everyone(np.array([value], dtype=np.int64), TAG_GATHER)
        total = np.array([int(every.sum())], dtype=np.int64)
        self.audit.record(-1, AUDIT_CONTROL_WORD, total)
        return int(total[0])

    def agree(self, go: bool) -> bool:
        """``sync-global``: whether every dominator goes on (one agreement per step: they stop together)."""
        assert self.lockstep is not None
        every = self._from_everyone(np.array([int(go)], dtype=np.int64), TAG_AGREE, self.lockstep)
        words = every[self.lockstep, 0]
        for sender, word in zip(self.lockstep, words.tolist(), strict=True):
            if word not in (0, 1):
                raise ProtocolViolation(sender, CONTROL_KINDS[TAG_AGREE], f"{word} is neither 0 nor 1")
        return bool(words.min())

    def broadcast_public_key(self, root: int, mine: bytes | None) -> bytes:
        """``root``'s public key to every party (``mine`` at the root): its byte count first, bounded."""
        size = self._from_root(np.array([0 if mine is None else len(mine)], dtype=np.int64), root, TAG_KEY)
        if not 0 < size[0] <= label_he.MAX_KEY_BYTES:
            raise ProtocolViolation(root, CONTROL_KINDS["broadcast_public_key"],
                                    f"announced {int(size[0])} bytes")
        key = (np.frombuffer(mine, dtype=np.uint8).copy() if mine is not None
               else np.empty(int(size[0]), dtype=np.uint8))
        self._from_root(key, root, TAG_KEY)
        self.audit.record(root, AUDIT_HE_KEY, label_he.bytes_to_words(key.tobytes()))
        return key.tobytes()

    def gather_row_norms(self, largest: float, quantile: float, spectral: float) -> np.ndarray:
        """Every party's :func:`vertical.step_size.block_smoothness`, ``[q, 3]`` float64: the largest and
        the 99.9th-percentile squared row norm of its block and its Gram matrix's top eigenvalue over n,
        what the default step is derived from. A triple that is not finite with 0 <= quantile <= largest
        and 0 <= eigenvalue <= largest would make every party's step wrong, so it ends the job naming its
        sender."""
        every = self._from_everyone(np.array([largest, quantile, spectral], dtype=np.float64), TAG_GATHER)
        for sender, (top, high, eigen) in enumerate(every):
            if not (np.isfinite(every[sender]).all() and 0 <= high <= top and 0 <= eigen <= top):
                raise ProtocolViolation(sender, CONTROL_KINDS["gather_row_norms"],
                                        f"largest {top!r}, 99.9th-percentile {high!r} squared row norms and "
                                        f"Gram eigenvalue {eigen!r}: expected finite numbers with "
                                        "0 <= percentile <= largest and 0 <= eigenvalue <= largest")
        return every

    # ------------------------------------------------------------------------------ the full ϑ

    def share_theta(self, theta: np.ndarray, root: int) -> None:
        """The full ϑ from ``root`` to every party, in place, point to point (sealed per receiver when
        channels are on)."""
        if self.rank == root:
            self.send_theta(theta, self._others())
        else:
            self.receive_theta(theta, root)

    def send_theta(self, theta: np.ndarray, dests: list[int]) -> None:
        """The full ϑ from this party to ``dests`` only, point to point, sealed when channels are on."""
        channels = self.theta_channels
        pending = self._pending(TAG_FULL_THETA)
        for p in dests:
            pending.send(theta if channels is None else channels.seal(p, TAG_FULL_THETA, theta), p,
                         TAG_FULL_THETA)
        pending.wait()

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

    def recv_he_full(self, root: int, limit_words: int, progress: int = 0) -> bytes:
        """``progress``: how many progress words the leader's encryption of ϑ_0 may send first."""
        return self.recv_framed(TAG_HE_FULL, root, limit_words, progress)

    def send_he_full_masked(self, root: int, words: np.ndarray) -> None:
        """Passive party: its masked encrypted X_lᵀϑ_0 back to the leader."""
        self.send_framed(TAG_HE_FULL_MASKED, root, words)

    def recv_he_full_masked(self, source: int, limit_words: int, progress: int = 0) -> bytes:
        return self.recv_framed(TAG_HE_FULL_MASKED, source, limit_words, progress)

    def send_he_full_decrypted(self, dest: int, words: np.ndarray) -> None:
        """Leader: the decryption, still masked, of ``dest``'s answer (a fixed 2 d_l words)."""
        pending = self._pending(TAG_HE_FULL_DECRYPTED)
        pending.send(words, dest, TAG_HE_FULL_DECRYPTED)
        pending.wait()

    def recv_he_full_decrypted(self, root: int, n_words: int, work_s: float = 0.0) -> np.ndarray:
        """The leader's decryption of this party's answer: exactly ``n_words`` words, checked before
        anything reads them (a short reply would leave words of the buffer unset). The leader may be
        decrypting another passive party's answer first: one level above the exchanges that wait."""
        words = np.empty(n_words, dtype=np.uint64)
        self._recv_exact(words, root, TAG_HE_FULL_DECRYPTED, self._allowing(work_s) + 1)
        return words

    def _allowing(self, work_s: float) -> int:
        """The level of a barrier-time exchange whose sender may first work ``work_s`` seconds without
        delivering anything: that much more time, in steps of the levels' stagger (protocols/liveness.py)."""
        return self.liveness.exchange_level + math.ceil(work_s / self.liveness.stagger)

    # --------------------------------------------------------------------------------- framing

    def send_progress(self, tag: int, dests: list[int]) -> None:
        """A progress word (a frame of size 0) to each of ``dests`` on ``tag``: one more piece of a long
        local step is done. It restarts the receiver's deadline; :meth:`recv_framed` takes no more of them
        than the step's work allows, so a party cannot stall the exchange by reporting progress forever."""
        pending = self._pending(tag)
        for dest in dests:
            pending.send(np.zeros(1, dtype=np.uint64), dest, tag)
        pending.wait()

    def send_framed(self, tag: int, dest: int, words: np.ndarray) -> None:
        """A variable-length message: its word count first, then the words (both on ``tag``)."""
        pending = self._pending(tag)
        pending.send(np.array([words.size], dtype=np.uint64), dest, tag)
        pending.send(words, dest, tag)
        pending.wait()

    def recv_framed(self, tag: int, source: int, limit_words: int, progress: int = 0) -> bytes:
        """The bytes of a :meth:`send_framed` message of ``label_he.pack_bytes`` words: the announced
        size is bounded before anything is allocated, the framing checked before it is parsed. Up to
        ``progress`` progress words (:meth:`send_progress`) may come first, each within the deadline."""
        what = CONTROL_KINDS[tag]
        size = np.zeros(1, dtype=np.uint64)
        for _ in range(progress + 1):
            self._recv_exact(size, source, tag)
            if int(size[0]) != 0:
                break
        else:
            raise ProtocolViolation(source, what, f"more than {progress} progress words: more than the "
                                    f"work of this step can take")
        if not 2 < int(size[0]) <= limit_words:
            raise ProtocolViolation(source, what, f"announced {int(size[0])} words (at most {limit_words})")
        framed = np.empty(int(size[0]), dtype=np.uint64)
        self._recv_exact(framed, source, tag)
        return label_he.unpack_bytes(source, framed, what)[1]

    def _recv_exact(self, buf: np.ndarray, source: int, tag: int, level: int | None = None) -> None:
        """Exactly ``buf.nbytes`` bytes from ``source``, polled under its deadline; any other size is
        the sender's fault."""
        pending = self._pending(tag, level)
        pending.recv(buf, source, tag)
        pending.wait()
