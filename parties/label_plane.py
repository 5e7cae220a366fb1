"""The encrypted label plane of one party (``--label-privacy he``, with ``--epsilon`` label DP).

Passive parties never see ϑ: a dominator sends each batch encrypted under its own key, a passive party
answers with its masked encrypted block gradient, and the dominator returns the decryption, still
masked (protocols/label_he.py); under ``--epsilon`` what it encrypts, and what every party steps
with, is ϑ̃ = ϑ + N(0, σ²) (:meth:`LabelPlane.perturb`). The data plane carries the batches
(``parties/data_plane.py`` calls
:meth:`LabelPlane.encrypt_batch`, :meth:`LabelPlane.decrypt_later` and
:meth:`LabelPlane.passive_gradient`); the keys and the SVRG snapshot's encrypted
full pass go over the control plane (``parties/control_plane.py``).
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from parties.audit import AuditLog
from parties.control_plane import ControlPlane
from parties.lifecycle import guarded
from parties.messages import (
    AUDIT_HE_FULL_GRADIENT,
    AUDIT_HE_GRADIENT,
    MAX_MESSAGE_WORDS,
    TAG_HE_DECRYPTED,
    TAG_HE_FULL,
    TAG_HE_FULL_MASKED,
    TAG_HE_MASKED,
)
from protocols import label_he, label_he_pack
from protocols.errors import ProtocolViolation
from protocols.label_he_key_process import KeyProcess

#: Longest a worker waiting for a decryption sleeps before it looks at its deadline again (seconds).
REPLY_TICK = 0.05
#: ``--mode async``: encrypted batches a dominator may send beyond a passive party's answers. A passive
#: party steps one batch per round trip, so without a bound its backlog (and its staleness) grows with
#: the segment, and at the segment's barrier it would work through it sending nothing to the parties
#: that wait for it there (a deadline on silence would name it, docs/runtime.md "Liveness"). The bound is
#: also the staleness of the passive blocks in the dominator's ϑ's: at 16, once the dominator's
#: decryptions left its GIL (label_he_key_process.py) and it no longer slowed to its passive parties'
#: pace, a9a lost up to 40 points of accuracy on a loaded machine (docs/label-privacy.md); 4 keeps the
#: pipeline full and the accuracy of the throttled runs.
HE_AHEAD = 4


class PassBatches:
    """A dominator's batches under ``--label-privacy he --epsilon``: pass e is one permutation of the n
    rows cut into ⌊n/B⌋ batches, dealt to the m dominators in turn, so a row is in at most one batch a
    pass and its privacy loss composes over passes, not steps (vertical/label_privacy.py). The seed is the
    job's: every passive party sees each batch's rows anyway."""

    def __init__(self, n_rows: int, batch: int, dominators: int, index: int, seed: int) -> None:
        self.n_rows, self.batch, self.seed = n_rows, batch, seed
        self.dominators, self.index = dominators, index
        self.passes = 0
        self._ready = np.zeros((0, batch), dtype=np.int64)

    def take(self, count: int) -> np.ndarray:
        """The next ``count`` batches, ``[count, B]``."""
        while self._ready.shape[0] < count:
            perm = np.random.default_rng([self.seed, 0x1DB, self.passes]).permutation(self.n_rows)
            cut = perm[: (self.n_rows // self.batch) * self.batch].reshape(-1, self.batch)
            self._ready = np.concatenate([self._ready, cut[self.index::self.dominators]])
            self.passes += 1
        taken, self._ready = self._ready[:count], self._ready[count:]
        return taken


class LabelPlane:
    """One party's part of the encrypted label plane; all parties construct it collectively (the keys
    are exchanged here).

    ``stop(outcome, reason)`` ends the job (:func:`~parties.lifecycle.stop_job`): a value too large to
    encrypt means the model diverged.
    """

    def __init__(self, party, control: ControlPlane, audit: AuditLog, *, active_ranks: list[int],
                 batch_size: int, scheme: str, key_bits: int, stop: Callable[[str, str], None],
                 pack: bool = False) -> None:
        self.party = party
        self.rank, self.q = control.rank, control.size
        self.control = control
        self.audit = audit
        self.active_ranks = active_ranks
        self.batch_size = batch_size
        self.stop = stop
        #: --epsilon: σ, the noise on every ϑ (0: none); the dominators' batches of a pass
        self.noise_std = 0.0
        self.batches: PassBatches | None = None
        #: a dominator's key: its secret half in a process of its own (label_he_key_process.py)
        self.key = KeyProcess(scheme, key_bits) if party.active else None
        #: --he-pack: the batches' gradients go k values a decryption (the snapshot's full pass does not)
        self.layout = label_he_pack.layout(batch_size, key_bits) if pack else None
        self.gradients: dict[int, label_he.BlockGradient] = {}
        #: a passive party's decrypted answers, per dominator (put there by the communication thread)
        self.replies: dict[int, queue.SimpleQueue[np.ndarray]] = {r: queue.SimpleQueue()
                                                                  for r in active_ranks}
        #: a dominator's decryption threads' inboxes, per passive party (:meth:`decrypt_later`)
        self._decrypters: dict[int, queue.SimpleQueue] = {}
        #: a passive party's masking threads' inboxes and their results (masks and bounds), per dominator
        self._maskers: dict[int, queue.SimpleQueue] = {}
        self._pending: dict[int, queue.SimpleQueue[tuple[int, label_he.Pending]]] = {
            r: queue.SimpleQueue() for r in active_ranks}
        self._answered = np.zeros(self.q, dtype=np.int64)  # per passive party: replies decrypted
        self._answered_cond = threading.Condition()
        for root in active_ranks:
            mine = self.key.public_bytes() if self.rank == root and self.key is not None else None
            key = control.broadcast_public_key(root, mine)
            if not party.active and pack:
                self.gradients[root] = label_he_pack.PackedBlockGradient(root, key, block=party.block,
                                                                         batch=batch_size, key_bits=key_bits)
            elif not party.active:
                self.gradients[root] = label_he.BlockGradient(root, key, block=party.block, scheme=scheme,
                                                              key_bits=key_bits)
        #: the data plane's largest message: one encrypted batch
        self.max_words = max(MAX_MESSAGE_WORDS,
                             3 + batch_size + label_he.ciphertext_limit(key_bits, batch_size) // 8 + 1)

    def setup_noise(self, noise_multiplier: float, seed: int) -> None:
        """``--epsilon``: a dominator encrypts ϑ̃_i = ϑ_i + N(0, σ²), σ = ``noise_multiplier`` (one label
        moves the logistic ϑ by exactly 1), for every row of every batch, and every party, active ones
        included, steps with ϑ̃ (vertical/label_privacy.py says why both). Nothing is exchanged: the
        noise's size depends on no party's data, so no party can lower it. Only the label holders draw
        noise, from OS entropy: a seed the others know would let them subtract it."""
        self.noise_std = noise_multiplier
        if self.party.active:
            self.batches = PassBatches(self.party.block.n_rows, self.batch_size, len(self.active_ranks),
                                       self.active_ranks.index(self.rank), seed)
            self._noise = np.random.default_rng()  # the dominated loop's (the main thread)

    def perturb(self, thetas: np.ndarray) -> np.ndarray:
        """Dominator under ``--epsilon``: the ϑ̃ of a batch, what it encrypts, sends and steps with."""
        try:
            return label_he.noisy_thetas(thetas, self.noise_std, self._noise)
        except OverflowError as err:
            self.stop("diverged", str(err))
            raise

    # ---------------------------------------------------------------------- batches (data plane)

    def encrypt_batch(self, seq: int, rows: np.ndarray, thetas: np.ndarray) -> np.ndarray:
        """Dominator: the encrypted (ϑ, i) batch ``seq`` for the passive parties, numbered like the plain
        broadcast."""
        assert self.key is not None
        try:
            payload = self.key.encrypt(thetas)
        except OverflowError as err:
            self.stop("diverged", str(err))
        return label_he.pack_batch(seq, rows, payload)

    def decrypt_later(self, source: int, msg: np.ndarray, sent: int, transport) -> None:
        """Dominator (the communication thread): ``source``'s masked gradient goes to its decryption
        thread, which answers it (:meth:`decrypt_for`) and sends the reply. The communication thread
        goes back to its other messages (the dominated loop's own aggregation replies among them) instead
        of waiting for the key process's answer, which on a loaded machine waits for a core."""
        self._inbox(self._decrypters, source, self._decrypt_loop, "decrypt", transport).put((msg, sent))

    def _decrypt_loop(self, source: int, inbox: queue.SimpleQueue, transport) -> None:
        """``source``'s masked gradients in order: each checked, decrypted and answered."""
        while True:
            msg, sent = inbox.get()
            transport.send(source, self.decrypt_for(source, msg, sent), TAG_HE_DECRYPTED)

    def decrypt_for(self, source: int, msg: np.ndarray, sent: int) -> np.ndarray:
        """Dominator: the reply to a passive party's masked batch gradient (its batches in order, each
        once, only those of the ``sent`` this dominator sent): the decryption, still masked."""
        assert self.key is not None
        seq, payload = label_he.unpack_bytes(source, msg, "masked gradient")
        expected = int(self._answered[source])
        if seq != expected or seq >= sent:
            raise ProtocolViolation(source, "masked gradient", f"for batch #{seq} where #{expected} was "
                                    f"expected ({sent} sent)")
        if self.layout is None:
            words = self.key.decrypt_masked(source, payload, self.batch_size)
        else:
            words = label_he_pack.decrypt_packed(self.key, source, payload, self.batch_size, self.layout)
        with self._answered_cond:
            self._answered[source] = expected + 1
            self._answered_cond.notify_all()
        return np.concatenate([np.array([seq], dtype=np.uint64), words])

    def await_answers(self, upto: int) -> None:
        """Dominator, ``--mode async``: wait until every passive party has had batches ``0..upto - 1``
        decrypted (:data:`HE_AHEAD`). Its worker may first wait for another dominator's decryption:
        level 1 of the deadlines."""
        passive = [p for p in range(self.q) if p not in self.active_ranks]
        liveness, since = self.control.liveness, self.control.liveness.clock()
        with self._answered_cond:
            while late := [p for p in passive if self._answered[p] < upto]:
                liveness.check(late, since, f"its masked gradient of batch #{upto - 1}", level=1)
                self._answered_cond.wait(REPLY_TICK)

    def arrived(self, source: int, seq: int, rows: np.ndarray, payload: bytes, transport) -> None:
        """Passive party (the communication thread, for each validated encrypted batch, in order): the
        batch goes to ``source``'s masking thread, which sends its masked encrypted block gradient at
        once. The gradient depends on ϑ and this party's features only, not on its model, so it need not
        wait until the worker has applied the batches before (:meth:`passive_gradient`): the masking of
        batch t + 1 overlaps the dominator's decryption of batch t, and the steps stay exactly the same."""
        self._inbox(self._maskers, source, self._mask_loop, "mask", transport).put((seq, rows, payload))

    def _inbox(self, inboxes: dict, source: int, loop, role: str, transport) -> queue.SimpleQueue:
        """``source``'s inbox in ``inboxes``, its thread (``role-source``, running ``loop``) started on
        first use: one thread per peer, so one slow peer's work never waits behind another's."""
        if source not in inboxes:
            inbox: queue.SimpleQueue = queue.SimpleQueue()
            inboxes[source] = inbox
            guard = functools.partial(guarded, self.control.comm, self.rank)
            threading.Thread(target=guard(loop), args=(source, inbox, transport),
                             name=f"{role}-{source}", daemon=True).start()
        return inboxes[source]

    def _mask_loop(self, source: int, inbox: queue.SimpleQueue, transport) -> None:
        """``source``'s batches in order: the masked gradient to the dominator, the masks and bounds kept
        for the worker; while no batch waits, the next batch's masks are encrypted ahead."""
        gradients = self.gradients[source]
        mask = (gradients.masked_packed_batch if isinstance(gradients, label_he_pack.PackedBlockGradient)
                else gradients.masked_batch)
        while True:
            seq, rows, payload = inbox.get()
            masked, pending = mask(payload, rows)
            transport.send(source, label_he.pack_bytes(seq, masked), TAG_HE_MASKED)
            self._pending[source].put((seq, pending))
            if inbox.empty():
                gradients.prepare_masks()  # the next batch's, while the dominator decrypts this one

    def passive_gradient(self, source: int, rows: np.ndarray, payload: bytes, seq: int, transport
                         ) -> np.ndarray:
        """Passive party: for dominator ``source``'s encrypted batch ``seq`` (masked and sent by the
        masking thread when it arrived, :meth:`arrived`), the decryption back, the mask off (a worker
        thread, the batches in order)."""
        gradients = self.gradients[source]
        masked_seq, pending = self._pending[source].get()
        assert masked_seq == seq, f"batch #{seq} applied while #{masked_seq} was masked"
        reply = self._reply(source, seq)
        if reply.size < 1 or int(reply[0]) != seq:
            raise ProtocolViolation(source, "decrypted gradient", f"is not the answer for batch #{seq}")
        if isinstance(gradients, label_he_pack.PackedBlockGradient):
            gradient = gradients.unmask_packed_batch(reply[1:], pending)
        else:
            gradient = gradients.unmask_batch(reply[1:], pending)
        self.audit.record(source, AUDIT_HE_GRADIENT, gradient)
        return gradient

    def _reply(self, source: int, seq: int) -> np.ndarray:
        """Dominator ``source``'s decryption for batch ``seq`` (its decryption thread for this party
        answers at once, this party's earlier batches first: level 0 of the deadlines,
        protocols/liveness.py)."""
        liveness, since = self.control.liveness, self.control.liveness.clock()
        while True:
            try:
                return self.replies[source].get(timeout=REPLY_TICK)
            except queue.Empty:
                liveness.check((source,), since, f"its decryption of batch #{seq}")

    # --------------------------------------------------------- the snapshot's full pass (control)

    def full_pass_leader(self, theta: np.ndarray) -> None:
        """Leader: ϑ_0 encrypted to every passive party, then each one's masked X_lᵀϑ_0 decrypted for it
        (the passive parties compute theirs in parallel)."""
        assert self.key is not None
        n = theta.size
        passive = [p for p in range(self.q) if p not in self.active_ranks]
        try:  # a long encryption: a progress word per piece keeps the passive parties' deadlines
            payload = label_he.pack_bytes(0, self.key.encrypt(
                theta, lambda: self.control.send_progress(TAG_HE_FULL, passive)))
        except OverflowError as err:
            self.stop("diverged", str(err))
        for p in passive:
            self.control.send_he_full(p, payload)
        limit = label_he.ciphertext_limit(self.key.key_bits, n) // 8 + 3
        words = label_he.progress_words(n, label_he.MASK_ROWS)  # each one's masked pass reports progress
        for p in passive:
            masked = self.control.recv_he_full_masked(p, limit, words)
            self.control.send_he_full_decrypted(p, self.key.decrypt_masked(p, masked, n))

    def full_pass_passive(self, root: int) -> np.ndarray:
        """Passive party: X_lᵀϑ_0 from the leader's encrypted ϑ_0, ϑ_0 itself unseen."""
        gradients = self.gradients[root]
        n = self.party.block.n_rows
        limit = label_he.ciphertext_limit(gradients.key_bits, n) // 8 + 3
        payload = self.control.recv_he_full(root, limit, label_he.progress_words(n, label_he.HE_CHUNK))
        started = time.monotonic()
        masked = gradients.masked(payload, np.arange(n),
                                  lambda: self.control.send_progress(TAG_HE_FULL_MASKED, [root]))
        self.control.send_he_full_masked(root, label_he.pack_bytes(0, masked))
        # the leader may first wait for another passive party's masked pass, about as long as this one's
        work_s = 2 * (time.monotonic() - started)
        words = self.control.recv_he_full_decrypted(root, 2 * self.party.block.n_cols, work_s)
        gradient = gradients.unmask(words)
        self.audit.record(root, AUDIT_HE_FULL_GRADIENT, gradient)
        return gradient
