"""The runtime of one party (one MPI rank): asynchronous VFB² and its synchronous baselines.

Threads of a rank:

* **communication thread** - the only receiver on the data communicator. It waits in one blocking
  ``Recv(ANY_SOURCE, ANY_TAG)`` (no Python polling, no ``Probe``: with more ranks than cores either
  costs an OS time slice per message), validates what arrived (:func:`check_envelope`, then the
  receivers of each kind) and serves it: secure-aggregation traffic (this party's masked products for
  other dominators' requests, tree sums), (ϑ, i) broadcasts (handed to a worker), the synchronous
  baselines' acknowledgements, heartbeats. With ``link_delay`` it hands messages to a
  :class:`~protocols.delay.DelayedDelivery` thread instead, which serves them after the delay.
* **k worker threads** - apply collaborative updates (Alg. 3/5/7) to the shared block ``w`` lock-free
  with numba ``nogil`` kernels, so they really run in parallel. The ϑ stream of dominator r goes to
  worker ``r mod k`` (k = m: one worker per dominator stream, the paper's setting).
* **heartbeat thread** - tells the others this party is alive, and ends the job when one is silent.
* **main thread** - segments of training separated by global barriers (SVRG snapshots, the SAGA
  initial pass, evaluations, through the collective secure aggregation on a separate communicator)
  and, on active parties, the dominated loop between them (:meth:`PartyRuntime.dominate`: sample
  rows, obtain ŵ·x by Algorithm 1 rooted here, compute ϑ, broadcast (ϑ, i), update its own block).

Every data-plane message goes through one :class:`~protocols.transport.MpiTransport` (the secure
aggregation's full passes use the same class on the control communicator): sends may come from any
thread (``MPI_THREAD_MULTIPLE``), never block, and are sealed there with ``--secure-channels``.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import math
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from parties.outcomes import EXIT_CODES, STOP_LINE
from protocols import label_he
from protocols.aggregation import HEADER_WORDS, AggregationNode, Completed, Kind, Requested
from protocols.channels import OVERHEAD_WORDS, ChannelKeys
from protocols.delay import DelayedDelivery
from protocols.dispatch import Inbox, pack, piggyback, split_piggyback
from protocols.errors import ProtocolViolation
from protocols.masking import AggregationOverflowError
from protocols.secure_aggregation import SecureAggregator
from protocols.transport import AGGREGATION_TAG, MpiTransport, RecordingTransport
from protocols.trees import build_all_tree_pairs
from vfl.algorithms.vfb2 import Block, UpdateRule
from vfl.label_privacy import clip_scales, row_norm_bound
from vfl.problems import Problem

TAG_THETA = 0x7E7A
#: --piggyback: step t's (ϑ, i) message and step t + 1's aggregation request in one buffer
#: (protocols/dispatch.py, ``piggyback``)
TAG_THETA_REQUEST = 0x7E7B
TAG_ACK = 0xAC4
TAG_STOP = 0x5709
TAG_DONE = 0xD0E
TAG_HEARTBEAT = 0xBEA7
TAG_FULL_THETA = 0xF7E7  # on the control communicator, only with sealed channels
#: --label-privacy he (protocols/label_he.py): encrypted batch to a passive party, its masked encrypted
#: gradient back to the dominator, and the dominator's decryption of it (still masked) to the party.
TAG_HE_BATCH = 0x4E7A
TAG_HE_MASKED = 0x4E3A
TAG_HE_DECRYPTED = 0x4E9A
#: --label-privacy he, SVRG snapshots (control communicator, point to point): the encrypted full ϑ_0 to
#: a passive party (its byte count first), its masked encrypted X_lᵀϑ_0 back, the masked decryption.
TAG_HE_FULL = 0xF4E7
TAG_HE_FULL_MASKED = 0xF4E3
TAG_HE_FULL_DECRYPTED = 0xF4E9
#: Audit labels of what arrives on the control communicator (collectives, not tagged messages there):
#: secure-aggregation traffic of the full passes, the full ϑ vector, and control words.
AUDIT_CTRL_AGGREGATION = 0x1C5EC
AUDIT_FULL_THETA = 0x1C7E7
AUDIT_CONTROL_WORD = 0x1C0DE
#: --label-privacy he: a dominator's public key (control plane), and what a passive party learns from
#: each batch once it removed its own mask: its block gradient Σ_i ϑ_i x_i (recorded so that attacks
#: on the transcript see everything the party knows; nothing crosses under this label).
AUDIT_HE_KEY = 0x1C4E0
AUDIT_HE_GRADIENT = 0x1C4E6
#: ... and from each SVRG snapshot's encrypted full pass: X_lᵀϑ_0 (n μ_l), the only thing it learns there.
AUDIT_HE_FULL_GRADIENT = 0x1C4E7
AUDIT_LABELS = (AUDIT_CTRL_AGGREGATION, AUDIT_FULL_THETA, AUDIT_CONTROL_WORD, AUDIT_HE_KEY, AUDIT_HE_GRADIENT,
                AUDIT_HE_FULL_GRADIENT)
#: What each data-plane tag carries, as error messages name it ("party 2 sent an invalid <kind>: ...").
MESSAGE_KINDS = {
    AGGREGATION_TAG: "aggregation message", TAG_THETA: "(ϑ, i) message",
    TAG_THETA_REQUEST: "piggybacked (ϑ, i) message", TAG_DONE: "DONE message", TAG_ACK: "ACK message",
    TAG_STOP: "STOP message", TAG_HEARTBEAT: "heartbeat", TAG_HE_BATCH: "encrypted batch",
    TAG_HE_DECRYPTED: "decrypted gradient", TAG_HE_MASKED: "masked gradient",
}
#: Largest message on the data communicator (the hot path sends B = 1 messages of a few words; the
#: batched full passes use the collective library call on a separate communicator).
MAX_MESSAGE_WORDS = 1 << 13
#: At most this many queued (ϑ, i) messages are applied by one kernel call.
WORKER_BATCH = 256


@dataclass
class PartyState:
    """What one party holds: its block of the training (and test) features, its model block, and -
    on active parties only - the labels and the loss (``problem``)."""

    rank: int
    block: Block
    w: np.ndarray
    rule: UpdateRule
    problem: Problem | None = None
    y: np.ndarray | None = None
    test_block: Block | None = None
    y_test: np.ndarray | None = None
    #: SHA-256 of the party's train and test sample ids, in order: equal at every party iff aligned.
    ids_digest: bytes = bytes(32)

    @property
    def active(self) -> bool:
        return self.y is not None


def stop_job(comm: MPI.Comm, rank: int, outcome: str, reason: str) -> None:
    """End the whole job for a reason the user must read (not a crash): one
    :data:`~parties.outcomes.STOP_LINE` that the launcher repeats, and the exit code of ``outcome``
    (:data:`parties.outcomes.EXIT_CODES`)."""
    import sys

    print(STOP_LINE.format(rank=rank, outcome=outcome, reason=reason), file=sys.stderr, flush=True)
    comm.Abort(EXIT_CODES[outcome])


#: Why a job stops when a score cannot be aggregated.
OUT_OF_RANGE = "the scores left the secure aggregation's range: the model diverged"


def name_os_thread(name: str) -> None:
    """Name the calling thread in the OS as well (Linux keeps 15 bytes), so that ``top -H`` and
    ``python -m experiments update_profile`` can tell a party's comm thread from its workers."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # no prctl in this libc: names are a convenience
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15 = PR_SET_NAME


class PassBatches:
    """A dominator's batches under ``--label-privacy he --epsilon``: pass e is one permutation of the n
    rows cut into ⌊n/B⌋ batches, dealt to the m dominators in turn, so a row is in at most one batch a
    pass and its privacy loss composes over passes, not steps (vfl/label_privacy.py). The seed is the
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


class PartyRuntime:
    """Runs one party's threads for a VFB² job; all ranks of ``comm`` construct one collectively."""

    def __init__(self, comm: MPI.Comm, party: PartyState, *, active_ranks: list[int], threads: int,
                 seed: int, mode: str = "async", dispatch: bool = True, batch_size: int = 1,
                 inflight: int = 1, piggyback: bool = False, straggler: int | None = None,
                 slowdown: float = 0.0, apply_delay: float = 0.0, peer_timeout: float = 30.0,
                 link_delay: float = 0.0, link_jitter: float = 0.0, keys: ChannelKeys | None = None,
                 allow_two_parties: bool = False, audit: bool = False, label_privacy: str = "none",
                 he_scheme: str = "ou", he_key_bits: int = 2048, noise_multiplier: float | None = None,
                 clip_quantile: float = 1.0) -> None:
        writers = getattr(party.rule, "writers", threads + 1)
        if writers < threads + 1:  # the dominator and each worker need their own writer slot
            raise ValueError(f"the update rule has {writers} writer slot(s); a party with {threads} "
                             f"worker thread(s) needs {threads + 1} (build it with writers={threads + 1})")
        self.party = party
        self.rank = comm.Get_rank()
        self.q = comm.Get_size()
        self.data = comm.Dup()
        self.ctrl = comm.Dup()
        self.active_ranks = active_ranks
        self.synchronous = mode != "async"
        self.dispatch = dispatch
        self.batch_size = batch_size
        self.inflight = 1 if self.synchronous else inflight
        if piggyback and (self.synchronous or label_privacy == "he"):
            raise ValueError("piggybacking needs the asynchronous mode without --label-privacy he: a "
                             "synchronous step waits for its acknowledgements before the next request, "
                             "and passive parties get ϑ encrypted")
        #: hold each step's (ϑ, i) back and send it inside the next step's request (one message fewer)
        self.piggyback = piggyback and dispatch
        #: sync-global: the dominators' own communicator, on which they agree to take each step together
        self.lockstep = (comm.Split(0 if self.rank in active_ranks else MPI.UNDEFINED)
                         if mode == "sync-global" else None)
        #: sync modes: the most steps this dominator ever had broadcast but not fully acknowledged
        self.max_unacked = 0
        self.slowdown = slowdown if straggler == self.rank else 0.0
        #: seconds the straggler's workers wait before applying a batch (a collaborator slow to update)
        self.apply_delay = apply_delay if straggler == self.rank else 0.0
        #: with keys, every message between parties is sealed (authenticated encryption), per plane
        self.channels = None if keys is None else keys.channels(self.rank, b"data")
        self._theta_channels = None if keys is None else keys.channels(self.rank, b"full-theta")
        pairs = build_all_tree_pairs(self.q, seed, allow_leaky_q2=allow_two_parties)
        self.node = AggregationNode(self.rank, self.q, pairs, allow_leaky_q2=allow_two_parties)
        self.node_lock = threading.Lock()
        self.aggregator = SecureAggregator.over_mpi(
            self.ctrl, tree_pairs=pairs, allow_leaky_q2=allow_two_parties,
            channels=None if keys is None else keys.channels(self.rank, b"full-passes"))
        #: With ``audit``, everything this party receives, on every communicator: (source, tag, words).
        #: Data-plane messages keep their tag; the control plane's are labelled ``AUDIT_*``.
        self.transcript: list[tuple[int, int, np.ndarray]] | None = [] if audit else None
        if audit:
            self.aggregator.transport = RecordingTransport(self.aggregator.transport)
        self.inbox = Inbox(self.q)
        #: --label-privacy he: passive parties get ϑ only encrypted under the dominator's key
        self.he = label_privacy == "he"
        self.max_words = MAX_MESSAGE_WORDS
        if self.piggyback:  # a (ϑ, i) message of B rows and a request for B rows, behind a length word
            self.max_words = max(self.max_words, 1 + (2 + 2 * batch_size) + (HEADER_WORDS + batch_size))
        #: --label-privacy he --epsilon: σC, the noise of every batch gradient (0: none); batches of a pass
        self._noise_std = 0.0
        self._batches: PassBatches | None = None
        #: --clip-quantile below 1: an active party's per-row gradient factors (its steps use ϑ_i·s_i)
        self._row_scale: np.ndarray | None = None
        if self.he:
            self._setup_he(he_scheme, he_key_bits)
            if noise_multiplier:
                self._setup_noise(noise_multiplier, seed, clip_quantile)
        #: every data-plane message, both ways (protocols/transport.py): sends from any thread, sealed
        #: with channels; the communication thread is its one receiver
        wire_words = self.max_words + (0 if self.channels is None else OVERHEAD_WORDS)
        self.transport = MpiTransport(self.data, capacity_words=wire_words, max_message_words=wire_words,
                                      channels=self.channels, kinds=MESSAGE_KINDS)
        self.applied = np.zeros(self.q, dtype=np.int64)
        self.applied_cond = threading.Condition()
        self.sent = 0
        #: per dominator: segments it has finished, and its cumulative (ϑ, i) broadcasts at that point
        self.done_segments = np.zeros(self.q, dtype=np.int64)
        self.done_sent = np.zeros(self.q, dtype=np.int64)
        self.segment = 0
        self.acks: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.results: dict[int, queue.SimpleQueue[np.ndarray]] = {}
        self.queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(threads)]
        self.failure: BaseException | None = None
        self._rng = np.random.default_rng([seed, self.rank])
        self.peer_timeout = peer_timeout
        self.last_heard = np.zeros(self.q)
        self._stopping = threading.Event()
        self._warm_up()
        self.ctrl.Barrier()  # every party is warm: silence from now on means something
        self.last_heard[:] = time.monotonic()
        self._heartbeat = threading.Thread(target=self._guard(self._heartbeat_loop), name="heartbeat",
                                           daemon=True)
        self._heartbeat.start()
        #: with an emulated link delay, received messages wait there before they are processed
        self.link = (DelayedDelivery(self._process, link_delay, link_jitter, seed=seed + self.rank,
                                     wrap=self._guard) if link_delay or link_jitter else None)
        self._threads = [threading.Thread(target=self._guard(self._comm_loop), name="comm", daemon=True)]
        self._threads += [threading.Thread(target=self._guard(self._worker_loop), args=(qu, k + 1),
                                           name=f"worker-{k}", daemon=True)
                          for k, qu in enumerate(self.queues)]
        for t in self._threads:
            t.start()

    def _warm_up(self) -> None:
        """Compile the numba kernels now, so that JIT time never counts as training time."""
        none = np.zeros(0, dtype=np.int64)
        self.party.rule.products(self.party.w, none)
        self.party.rule.apply(self.party.w.copy(), none, np.zeros(0))

    # ---------------------------------------------------------------------------------- thread bodies

    def _guard(self, body: Callable[..., None]) -> Callable[..., None]:
        """Any exception in a thread of this party ends the whole job with a message naming the party."""

        def run(*args) -> None:
            name_os_thread(f"p{self.rank}-{threading.current_thread().name}")
            try:
                body(*args)
            except AggregationOverflowError:
                stop_job(self.data, self.rank, "diverged", OUT_OF_RANGE)
            except ProtocolViolation as exc:  # the sender's fault, not this party's: no traceback
                import sys

                print(f"[party {self.rank}] {exc}", file=sys.stderr, flush=True)
                self.data.Abort(EXIT_CODES["failed"])
            except BaseException as exc:
                import sys
                import traceback

                print(f"[party {self.rank}] fatal error in thread {threading.current_thread().name}: "
                      f"{exc!r}", file=sys.stderr, flush=True)
                traceback.print_exc()
                self.data.Abort(EXIT_CODES["failed"])

        return run

    def _comm_loop(self) -> None:
        # One blocking Recv(ANY_SOURCE, ANY_TAG) into a reused buffer (MpiTransport.recv_any): with ranks
        # outnumbering cores, Probe + Recv measured 1-8 ms per round trip here, a plain Recv 20-35 µs.
        # Everything another party sends is validated here, before it can reach a kernel: the envelope
        # by check_envelope, the contents by Inbox (ϑ, i; DONE) and AggregationNode.receive (with this
        # party's n_rows for REQUEST indices). A bad message raises ProtocolViolation naming the sender,
        # and _guard ends the job with it.
        while True:
            source, tag, msg = self.transport.recv_any()  # framing, sizes and seals checked there
            check_envelope(source, tag, msg.nbytes, rank=self.rank, active_ranks=self.active_ranks,
                           synchronous=self.synchronous, he=self.he)
            self.last_heard[source] = time.monotonic()
            if self.transcript is not None:
                self.transcript.append((source, tag, msg.copy()))
            if tag == TAG_STOP:
                return
            if self.link is not None:  # emulated latency: processed later
                self.link.submit(source, tag, msg)
            else:
                self._process(source, tag, msg)

    def _process(self, source: int, tag: int, msg: np.ndarray) -> None:
        """Act on one validated data-plane message (the communication or the link-delay thread)."""
        if tag == AGGREGATION_TAG:
            self._on_aggregation(source, msg)
        elif tag == TAG_THETA:
            self._on_theta(source, msg.view(np.float64))
        elif tag == TAG_THETA_REQUEST:  # ϑ first: the request's products may then already include it
            theta, request = split_piggyback(source, msg)
            if request.size < HEADER_WORDS or int(request[0]) != Kind.REQUEST:
                raise ProtocolViolation(source, "piggybacked request", "is not an aggregation REQUEST")
            self._on_theta(source, theta)
            self._on_aggregation(source, request)
        elif tag == TAG_DONE:
            count = self.inbox.done(source, msg.view(np.int64))
            with self.applied_cond:
                self.done_segments[source] += 1
                self.done_sent[source] = count
                self.applied_cond.notify_all()
        elif tag == TAG_ACK:
            self.acks.put(source)
        elif tag == TAG_HE_BATCH:
            seq, rows, payload = label_he.unpack_batch(source, msg, n_rows=self.party.block.n_rows,
                                                       batch=self.batch_size)
            self.inbox.next_sequence(source, seq, "encrypted batch")
            self.queues[self.active_ranks.index(source) % len(self.queues)].put((source, rows, payload, seq))
        elif tag == TAG_HE_MASKED:
            self._decrypt_for(source, msg)
        elif tag == TAG_HE_DECRYPTED:
            self._he_replies[source].put(msg)
        # TAG_HEARTBEAT: being heard from is all it says

    def _on_theta(self, source: int, message: np.ndarray) -> None:
        """A dominator's (ϑ, i) broadcast: validated (protocols/dispatch.py), then to its worker."""
        rows, thetas = self.inbox.unpack(source, message, self.party.block.n_rows)
        self.queues[self.active_ranks.index(source) % len(self.queues)].put((source, rows, thetas))

    def _heartbeat_loop(self) -> None:
        """Liveness: tell every other party this one is alive, and end the job when one has been
        silent for ``peer_timeout`` seconds. A party that is stopped, cut off or frozen would otherwise
        leave the others waiting forever (a crashed one is already handled: MPI ends the job)."""
        beat = np.zeros(1, dtype=np.uint64)
        others = [r for r in range(self.q) if r != self.rank]
        while not self._stopping.wait(min(self.peer_timeout / 4, 0.5)):
            for dest in others:
                self.transport.send(dest, beat, TAG_HEARTBEAT)
            now = time.monotonic()
            silent = max(others, key=lambda r: now - self.last_heard[r])
            gap = now - self.last_heard[silent]
            if gap > self.peer_timeout:
                stop_job(self.data, self.rank, "failed",
                         f"party {silent} has been silent for {gap:.1f} s (stopped, unreachable or hung?); "
                         f"--peer-timeout is {self.peer_timeout:g} s")

    def _on_aggregation(self, source: int, buf: np.ndarray) -> None:
        started = time.perf_counter()
        self._handle_aggregation(source, buf)
        self._straggle(started)  # a slow party is slow at everything, forwarding included

    def _handle_aggregation(self, source: int, buf: np.ndarray) -> None:
        with self.node_lock:  # validates the header, lengths and (against n_rows) REQUEST indices
            step = self.node.receive(source, buf, n_rows=self.party.block.n_rows)
        self._send_all(step.outgoing)
        event = step.event
        if isinstance(event, Requested):
            values = self.party.rule.products(self.party.w, event.indices)
            with self.node_lock:
                step = self.node.start(event.root, event.rid, values)
            self._send_all(step.outgoing)
            event = step.event
        if isinstance(event, Completed):
            slot = self.results.pop(event.rid, None)
            if slot is None:
                raise ProtocolViolation(source, "tree sum", f"it completed request {event.rid}, which "
                                        f"party {self.rank} never made")
            slot.put(event.result())

    def _worker_loop(self, inbox: queue.SimpleQueue, writer: int) -> None:
        """Apply (ϑ, i) messages as they come; whatever has queued up meanwhile is applied in one
        kernel call (same order, same result), so the GIL-holding Python work per message stays
        small and k workers overlap in the ``nogil`` kernels."""
        party = self.party
        if self.he and not party.active:
            return self._he_worker_loop(inbox, writer)
        noise = np.random.default_rng() if self._noise_std else None  # this thread's own, OS entropy
        while True:
            batch = [inbox.get()]
            while len(batch) < WORKER_BATCH and not inbox.empty():
                batch.append(inbox.get_nowait())
            stopping = batch[-1] is None
            items = batch[:-1] if stopping else batch
            if items:
                rows = np.concatenate([rows for _, rows, _ in items])
                thetas = np.concatenate([thetas for _, _, thetas in items])
                if self.apply_delay:
                    time.sleep(self.apply_delay)
                started = time.perf_counter()
                party.rule.apply(party.w, rows, self._clipped(rows, thetas), writer=writer)
                if noise is not None:  # one draw for len(items) steps: the sum of their noises
                    scale = self._noise_std * math.sqrt(len(items))
                    party.rule.apply_noise(party.w, noise.normal(0.0, scale, party.w.size))
                self._straggle(started)
                with self.applied_cond:
                    for source, _, _ in items:
                        self.applied[source] += 1
                    self.applied_cond.notify_all()
                if self.synchronous:
                    for source, _, _ in items:
                        self.transport.send(source, np.zeros(1, np.uint64), TAG_ACK)
            if stopping:
                return

    # --------------------------------------------------------------------- --label-privacy he

    def _setup_he(self, scheme: str, key_bits: int) -> None:
        """Each dominator makes its key pair and gives every party its public key (collective, control
        plane, buffers only); receive buffers grow to hold one encrypted batch."""
        party = self.party
        self._he_key = label_he.LabelKey(scheme, key_bits) if party.active else None
        self._he_gradients: dict[int, label_he.BlockGradient] = {}
        self._he_replies: dict[int, queue.SimpleQueue[np.ndarray]] = {r: queue.SimpleQueue()
                                                                       for r in self.active_ranks}
        self._he_answered = np.zeros(self.q, dtype=np.int64)  # per passive party: replies decrypted
        for root in self.active_ranks:
            mine = (np.frombuffer(self._he_key.public_bytes(), dtype=np.uint8)
                    if self.rank == root and self._he_key is not None else None)
            size = np.array([0 if mine is None else mine.size], dtype=np.int64)
            self.ctrl.Bcast(size, root=root)
            if not 0 < size[0] <= label_he.MAX_KEY_BYTES:
                raise ProtocolViolation(root, "public key", f"announced {int(size[0])} bytes")
            key = mine.copy() if mine is not None else np.empty(int(size[0]), dtype=np.uint8)
            self.ctrl.Bcast(key, root=root)
            self._record(root, AUDIT_HE_KEY, label_he.bytes_to_words(key.tobytes()))
            if not party.active:
                self._he_gradients[root] = label_he.BlockGradient(root, key.tobytes(), block=party.block,
                                                                  scheme=scheme, key_bits=key_bits)
        b = self.batch_size
        self.max_words = max(MAX_MESSAGE_WORDS, 3 + b + label_he.ciphertext_limit(key_bits, b) // 8 + 1)

    def _setup_noise(self, noise_multiplier: float, seed: int, clip_quantile: float) -> None:
        """``--epsilon``: every party bounds its block's row norms (c_l: the largest, or the
        ``--clip-quantile`` with the gradients computed from rows clipped to it) and tells the others (one
        buffer collective) c_l² and the fixed-point feature bits of its block; C = √(Σ_l c_l²) bounds
        every full row's gradient, and each block's batch gradient gets N(0, (σC)²) per coordinate
        (vfl/label_privacy.py). Only the label holders draw noise, from OS entropy: a seed the others
        know would let them subtract it. Semi-honest parties: a passive party that understated its
        bound would lower the noise every party gets."""
        party, block = self.party, self.party.block
        squares = np.bincount(np.repeat(np.arange(block.n_rows), np.diff(block.indptr)),
                              weights=np.asarray(block.data, dtype=np.float64) ** 2, minlength=block.n_rows)
        norms = np.sqrt(squares)
        bound = row_norm_bound(norms, clip_quantile)
        if bound < norms.max(initial=0.0):
            scale = clip_scales(norms, bound)
            if party.active:
                self._row_scale = scale
            for gradients in self._he_gradients.values():
                gradients.clip_rows(scale)
        bits = 0 if party.active else next(iter(self._he_gradients.values())).feature_bits
        every = np.empty((self.q, 2), dtype=np.float64)
        self.ctrl.Allgather(np.array([bits, bound**2]), every)
        for rank, (their_bits, square) in enumerate(every.tolist()):
            if their_bits not in (0, label_he.FEATURE_BITS) or not 0 <= square < math.inf:
                raise ProtocolViolation(rank, "label-DP setup", f"feature bits {their_bits}, squared norm "
                                        f"{square}")
        self._fraction_bits = label_he.THETA_BITS + every[:, 0].astype(np.int64)
        self._noise_std = noise_multiplier * math.sqrt(float(every[:, 1].sum()))
        if party.active:
            self._batches = PassBatches(block.n_rows, self.batch_size, len(self.active_ranks),
                                        self.active_ranks.index(self.rank), seed)
            self._own_noise = np.random.default_rng()  # the main thread's; the comm thread's below
            self._reply_noise = np.random.default_rng()

    def _encrypt_batch(self, rows: np.ndarray, thetas: np.ndarray) -> np.ndarray:
        """The encrypted (ϑ, i) batch for the passive parties, numbered like the plain broadcast."""
        assert self._he_key is not None
        try:
            payload = self._he_key.encrypt(thetas)
        except OverflowError as err:
            stop_job(self.data, self.rank, "diverged", str(err))
        return label_he.pack_batch(self.sent, rows, payload)

    def _decrypt_for(self, source: int, msg: np.ndarray) -> None:
        """Dominator: decrypt a passive party's masked batch gradient (its batches in order, each once)
        and return it, still masked."""
        assert self._he_key is not None
        seq, payload = label_he.unpack_bytes(source, msg, "masked gradient")
        expected = int(self._he_answered[source])
        if seq != expected or seq >= self.sent:
            raise ProtocolViolation(source, "masked gradient", f"for batch #{seq} where #{expected} was "
                                    f"expected ({self.sent} sent)")
        words = self._he_key.decrypt_masked(source, payload, self.batch_size)
        if self._noise_std:
            noise = self._reply_noise.normal(0.0, self._noise_std, words.size // 2)
            try:
                words = label_he.add_noise(words, noise, int(self._fraction_bits[source]))
            except OverflowError as err:
                stop_job(self.data, self.rank, "diverged", str(err))
        self._he_answered[source] = expected + 1
        reply = np.concatenate([np.array([seq], dtype=np.uint64), words])
        self.transport.send(source, reply, TAG_HE_DECRYPTED)

    def _he_worker_loop(self, inbox: queue.SimpleQueue, writer: int) -> None:
        """Passive party: for each encrypted batch, in order, its masked encrypted block gradient to the
        dominator, the decryption back, the mask off, one step (protocols/label_he.py)."""
        party = self.party
        while (item := inbox.get()) is not None:
            source, rows, payload, seq = item
            gradients = self._he_gradients[source]
            masked = gradients.masked(payload, rows)
            self.transport.send(source, label_he.pack_bytes(seq, masked), TAG_HE_MASKED)
            reply = self._he_replies[source].get()
            if reply.size < 1 or int(reply[0]) != seq:
                raise ProtocolViolation(source, "decrypted gradient", f"is not the answer for batch #{seq}")
            gradient = gradients.unmask(reply[1:])
            self._record(source, AUDIT_HE_GRADIENT, gradient)
            if self.apply_delay:
                time.sleep(self.apply_delay)
            started = time.perf_counter()
            party.rule.apply_gradient(party.w, gradient)
            self._straggle(started)
            with self.applied_cond:
                self.applied[source] += 1
                self.applied_cond.notify_all()
            if self.synchronous:
                self.transport.send(source, np.zeros(1, np.uint64), TAG_ACK)

    # ------------------------------------------------------------------------------- dominated updates

    def _straggle(self, started: float) -> None:
        """An injected straggler spends ``slowdown`` times longer on each piece of work (busy, like a
        slower CPU would; sleeping is far too coarse at microsecond scale)."""
        if self.slowdown:
            deadline = time.perf_counter() + self.slowdown * (time.perf_counter() - started)
            while time.perf_counter() < deadline:
                pass

    def _send_all(self, outgoing) -> None:
        for message in outgoing:
            self.transport.send(message.dest, message.buffer, AGGREGATION_TAG)

    def aggregate(self, rows: np.ndarray) -> np.ndarray:
        """ŵ·x_i for ``rows`` by Algorithm 1 rooted at this party (blocks only on this result)."""
        return self.request(rows).get()

    def request(self, rows: np.ndarray, theta: np.ndarray | None = None) -> queue.SimpleQueue[np.ndarray]:
        """Start Algorithm 1 for ``rows`` rooted here; the scores arrive in the returned slot.

        ``theta``, a held (ϑ, i) message (``--piggyback``), rides along with the announcements.
        """
        slot: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        with self.node_lock:
            rid, announcements = self.node.announce(rows)
            self.results[rid] = slot
        if theta is None:
            self._send_all(announcements)
        else:
            for message in announcements:
                self.transport.send(message.dest, piggyback(theta, message.buffer), TAG_THETA_REQUEST)
            announced = {message.dest for message in announcements}
            self._broadcast_theta(theta, [r for r in range(self.q) if r != self.rank and r not in announced])
        started = time.perf_counter()
        values = self.party.rule.products(self.party.w, rows)
        with self.node_lock:
            step = self.node.start(self.rank, rid, values)
        self._straggle(started)
        self._send_all(step.outgoing)
        if isinstance(step.event, Completed):  # q = 1 never happens; kept exact for a leaf-less tree
            self.results.pop(rid).put(step.event.result())
        return slot

    def dominate(self, n_steps: int, deadline: float | None = None) -> int:
        """Run ``n_steps`` dominated updates (Alg. 2/4/6) of ``batch_size`` rows each; returns how many
        were done.

        Up to ``inflight`` aggregation requests are outstanding, each reading ŵ when it is served, so
        link latency overlaps instead of adding up; the (ϑ, i) broadcasts still go out in request order,
        numbered, and every party applies each exactly once. What it costs: a step's ŵ may miss the
        updates of this dominator's ``inflight − 1`` previous steps, so the bounded delay τ of the
        analysis grows by ``inflight − 1`` per dominator. The synchronous modes keep one step in flight
        and wait for every collaborator's acknowledgement; ``sync-global`` also makes all dominators
        take each step together. With ``piggyback`` each step's (ϑ, i) waits for the next request and
        rides inside it (docs/runtime.md); when no request follows it goes alone at once.
        """
        party = self.party
        assert party.problem is not None and party.y is not None
        rows = (self._rng.integers(0, party.block.n_rows, size=(n_steps, self.batch_size))
                if self._batches is None else self._batches.take(n_steps))
        others = [r for r in range(self.q) if r != self.rank]
        pending: collections.deque[tuple[np.ndarray, queue.SimpleQueue[np.ndarray]]] = collections.deque()
        issued = done = 0
        acked = 0
        held: np.ndarray | None = None  # --piggyback: the last step's (ϑ, i), waiting for a request
        while done < n_steps:
            while issued < n_steps and len(pending) < self.inflight and self._may_start(issued, deadline):
                pending.append((rows[issued], self.request(rows[issued], held)))
                held = None
                issued += 1
            if held is not None:  # no request to ride on: it goes alone, now
                self._broadcast_theta(held, others)
                held = None
            if not pending:
                break
            step_rows, slot = pending.popleft()
            z = slot.get()
            thetas = np.asarray(party.problem.theta(z, party.y[step_rows]), dtype=np.float64)
            if self.dispatch:
                if self.synchronous:
                    self.max_unacked = max(self.max_unacked,
                                           done - (acked + self.acks.qsize()) // max(len(others), 1))
                buf = pack(self.sent, step_rows, thetas)
                sealed = (self._encrypt_batch(step_rows, party.rule.summed_values(step_rows, thetas))
                          if self.he and len(self.active_ranks) < self.q else None)
                self.sent += 1
                if self.piggyback:
                    held = buf
                else:
                    for dest in others:
                        if sealed is not None and dest not in self.active_ranks:
                            self.transport.send(dest, sealed, TAG_HE_BATCH)
                        else:
                            self.transport.send(dest, buf, TAG_THETA)
            started = time.perf_counter()
            party.rule.apply(party.w, step_rows, self._clipped(step_rows, thetas), writer=0)
            if self._noise_std:
                party.rule.apply_noise(party.w, self._own_noise.normal(0.0, self._noise_std, party.w.size))
            self._straggle(started)
            if self.synchronous and self.dispatch:
                for _ in others:
                    self.acks.get()
                    acked += 1
            done += 1
        if held is not None:
            self._broadcast_theta(held, others)
        return done

    def _clipped(self, rows: np.ndarray, thetas: np.ndarray) -> np.ndarray:
        """The ϑ's an active party steps with: ϑ_i·s_i under row clipping (the gradient of the clipped
        row; an SGD step is linear in ϑ), ϑ itself otherwise."""
        return thetas if self._row_scale is None else thetas * self._row_scale[rows]

    def _broadcast_theta(self, message: np.ndarray, dests: list[int]) -> None:
        for dest in dests:
            self.transport.send(dest, message, TAG_THETA)

    def _may_start(self, step: int, deadline: float | None) -> bool:
        """Whether to start another step: within the time budget, and under ``sync-global`` only when
        every dominator starts it too (one agreement per step: they stop together)."""
        go = deadline is None or step % 64 != 0 or time.perf_counter() <= deadline
        if self.lockstep is None:
            return go
        mine = np.array([int(go)], dtype=np.int64)
        every = np.empty(1, dtype=np.int64)
        self.lockstep.Allreduce(mine, every, op=MPI.MIN)
        return bool(every[0])

    # ---------------------------------------------------------------------------------- main thread

    def finish_segment(self) -> None:
        """Tell every other party that this dominator is done with the segment, and how many (ϑ, i)
        it has broadcast so far (they wait for exactly that many before the barrier)."""
        buf = np.array([self.sent], dtype=np.int64)
        for dest in range(self.q):
            if dest != self.rank:
                self.transport.send(dest, buf, TAG_DONE)

    def drain(self) -> None:
        """Global barrier: every dominator has finished the segment and every (ϑ, i) it sent has been
        applied here. Waiting happens on a condition variable, not in a spinning MPI collective, so
        the waiting main thread costs no CPU while the segment runs."""
        self.segment += 1
        others = [r for r in self.active_ranks if r != self.rank]
        with self.applied_cond:
            self.applied_cond.wait_for(lambda: all(
                self.done_segments[r] >= self.segment and self.applied[r] >= self.done_sent[r]
                for r in others))
        self.transport.flush()
        self.ctrl.Barrier()
        self.party.rule.synchronize(self.party.w)  # nothing writes now: bring every coordinate up to date

    def full_scores(self, test: bool = False, root: int = 0) -> np.ndarray | None:
        """w·x_i for every training (or test) sample, at ``root``, by batched secure aggregation."""
        block = self.party.test_block if test else self.party.block
        assert block is not None
        X = block.to_csr()
        indices = np.arange(X.shape[0]) if self.rank == root else None
        return self.aggregator.inner_product(self.party.w, X, indices, root=root)

    def full_theta(self, root: int = 0) -> np.ndarray:
        """The n-vector ϑ at the current w, computed at the leader and given to every party."""
        z = self.full_scores(root=root)
        theta = np.empty(self.party.block.n_rows)
        if self.rank == root:
            assert self.party.problem is not None
            theta[:] = self.party.problem.theta(z, self.party.y)
        if self._theta_channels is None:
            self.ctrl.Bcast(theta, root=root)
            self._record(root, AUDIT_FULL_THETA, theta)
        elif self.rank == root:  # sealed, so point to point: a broadcast cannot be encrypted per receiver
            self._send_theta(theta, [p for p in range(self.q) if p != root])
        else:
            self._receive_theta(theta, root)
        return theta

    def snapshot(self, root: int = 0) -> None:
        """SVRG's snapshot at every party: ϑ_0 at the current w and μ_l = (1/n) X_lᵀϑ_0.

        Under ``--label-privacy he`` only the label holders get ϑ_0; a passive party gets μ_l alone,
        through the batch protocol of protocols/label_he.py run once on all n rows (encrypted ϑ_0, its
        masked encrypted X_lᵀϑ_0, the masked decryption). n must exceed d_l, as B must (checked by
        the launcher), or X_lᵀϑ_0 would determine ϑ_0.
        """
        rule = self.party.rule
        if not (self.he and len(self.active_ranks) < self.q):
            rule.snapshot(self.full_theta(root))
            return
        z = self.full_scores(root=root)
        n = self.party.block.n_rows
        if self.rank == root:
            assert self.party.problem is not None
            theta = np.asarray(self.party.problem.theta(z, self.party.y), dtype=np.float64)
            self._send_theta(theta, [p for p in self.active_ranks if p != root])
            self._he_full_pass(theta)
            rule.snapshot(theta)
        elif self.party.active:
            theta = np.empty(n)
            self._receive_theta(theta, root)
            rule.snapshot(theta)
        else:
            gradients = self._he_gradients[root]
            limit = label_he.ciphertext_limit(gradients.key_bits, n) // 8 + 3
            payload = self._recv_framed(root, TAG_HE_FULL, limit, "encrypted full pass")
            self._send_framed(label_he.pack_bytes(0, gradients.masked(payload, np.arange(n))), root,
                              TAG_HE_FULL_MASKED)
            words = np.empty(2 * self.party.block.n_cols, dtype=np.uint64)
            self.ctrl.Recv(words, root, TAG_HE_FULL_DECRYPTED)
            gradient = gradients.unmask(words)
            self._record(root, AUDIT_HE_FULL_GRADIENT, gradient)
            rule.snapshot_mean(gradient / n)

    def _he_full_pass(self, theta: np.ndarray) -> None:
        """Leader: ϑ_0 encrypted to every passive party, then each one's masked X_lᵀϑ_0 decrypted for it
        (the passive parties compute theirs in parallel)."""
        assert self._he_key is not None
        n = theta.size
        try:
            payload = label_he.pack_bytes(0, self._he_key.encrypt(theta))
        except OverflowError as err:
            stop_job(self.data, self.rank, "diverged", str(err))
        passive = [p for p in range(self.q) if p not in self.active_ranks]
        for p in passive:
            self._send_framed(payload, p, TAG_HE_FULL)
        limit = label_he.ciphertext_limit(self._he_key.key_bits, n) // 8 + 3
        for p in passive:
            masked = self._recv_framed(p, TAG_HE_FULL_MASKED, limit, "masked full gradient")
            self.ctrl.Send(self._he_key.decrypt_masked(p, masked, n), p, TAG_HE_FULL_DECRYPTED)

    def _send_framed(self, words: np.ndarray, dest: int, tag: int) -> None:
        """A variable-length message on the control plane: its word count first."""
        self.ctrl.Send(np.array([words.size], dtype=np.uint64), dest, tag)
        self.ctrl.Send(words, dest, tag)

    def _recv_framed(self, source: int, tag: int, limit_words: int, what: str) -> bytes:
        """The bytes of a :meth:`_send_framed` message of ``label_he.pack_bytes`` words: the announced
        size is bounded before anything is allocated, the framing checked before it is parsed."""
        size = np.zeros(1, dtype=np.uint64)
        self.ctrl.Recv(size, source, tag)
        if not 2 < int(size[0]) <= limit_words:
            raise ProtocolViolation(source, what, f"announced {int(size[0])} words (at most {limit_words})")
        framed = np.empty(int(size[0]), dtype=np.uint64)
        self.ctrl.Recv(framed, source, tag)
        return label_he.unpack_bytes(source, framed, what)[1]

    def _send_theta(self, theta: np.ndarray, dests: list[int]) -> None:
        """The full ϑ from this party to ``dests`` only, point to point, sealed when channels are on."""
        channels = self._theta_channels
        bufs = {p: theta if channels is None else channels.seal(p, TAG_FULL_THETA, theta) for p in dests}
        MPI.Request.Waitall([self.ctrl.Isend(buf, p, TAG_FULL_THETA) for p, buf in bufs.items()])

    def _receive_theta(self, theta: np.ndarray, root: int) -> None:
        channels = self._theta_channels
        if channels is None:
            self.ctrl.Recv(theta, root, TAG_FULL_THETA)
        else:
            buf = np.empty(theta.size + OVERHEAD_WORDS, dtype=np.uint64)
            self.ctrl.Recv(buf, root, TAG_FULL_THETA)
            theta[:] = channels.open(root, TAG_FULL_THETA, buf).view(np.float64)
        self._record(root, AUDIT_FULL_THETA, theta)

    def broadcast_word(self, value: int, root: int = 0) -> int:
        """One int64 from ``root`` to every party (control decisions: buffer call, never pickle)."""
        word = np.array([value], dtype=np.int64)
        self.ctrl.Bcast(word, root=root)
        self._record(root, AUDIT_CONTROL_WORD, word)
        return int(word[0])

    def broadcast_float(self, value: float, root: int = 0) -> float:
        word = np.array([value], dtype=np.float64)
        self.ctrl.Bcast(word, root=root)
        self._record(root, AUDIT_CONTROL_WORD, word)
        return float(word[0])

    def sum_word(self, value: int) -> int:
        """Σ over parties of one int64 each (every party learns the total)."""
        mine = np.array([value], dtype=np.int64)
        total = np.empty(1, dtype=np.int64)
        self.ctrl.Allreduce(mine, total, op=MPI.SUM)
        self._record(-1, AUDIT_CONTROL_WORD, total)
        return int(total[0])

    def _record(self, source: int, label: int, values: np.ndarray) -> None:
        """Audit what arrived from ``source`` (-1: from everyone) by a collective on the control plane."""
        if self.transcript is not None and source != self.rank:
            self.transcript.append((source, label, np.ascontiguousarray(values).view(np.uint64).copy()))

    def regularizer_sum(self, root: int = 0) -> float | None:
        """λ Σ_l g(w_l) at ``root``, by secure aggregation of each party's own term."""
        rule = self.party.rule
        term = rule.lam * rule.regularizer.value(self.party.w) if rule.lam else 0.0
        total = self.aggregator.sum(np.array([term]), root=root)
        return None if total is None else float(total[0])

    def save_transcript(self, path) -> None:
        """Write what this party received (``audit`` mode) for the message-audit tests and users."""
        assert self.transcript is not None
        records = list(self.transcript)
        if isinstance(self.aggregator.transport, RecordingTransport):
            records += [(source, AUDIT_CTRL_AGGREGATION, words)
                        for source, words in self.aggregator.transport.received]
        np.savez(path, sources=np.array([r[0] for r in records], dtype=np.int64),
                 tags=np.array([r[1] for r in records], dtype=np.int64),
                 lengths=np.array([r[2].size for r in records], dtype=np.int64),
                 words=np.concatenate([r[2] for r in records]) if records else np.zeros(0, np.uint64),
                 sent=self.sent, applied=self.applied, max_unacked=self.max_unacked)

    def close(self) -> None:
        """Stop this party's threads (collective with the other parties)."""
        self.ctrl.Barrier()
        self._stopping.set()
        self._heartbeat.join()
        for qu in self.queues:
            qu.put(None)
        self.transport.send(self.rank, np.zeros(1, np.uint64), TAG_STOP)
        for t in self._threads:
            t.join()
        if self.link is not None:
            self.link.close()
        self.transport.flush()
        self.aggregator.close()
        self.ctrl.Barrier()


def check_envelope(source: int, tag: int, nbytes: int, *, rank: int, active_ranks: list[int],
                   synchronous: bool, he: bool = False) -> None:
    """Check what MPI says about one data-plane message (sender, tag, size) before its words are read.

    Contents are checked by their own receivers (``Inbox``, ``AggregationNode.receive``); this catches
    what they cannot: an unknown tag, a sender that may not send that kind (only dominators send ϑ and
    DONE, only this party itself sends STOP), and sizes that are not the kind's exact word count.
    """
    what = MESSAGE_KINDS.get(tag)
    if what is None:
        raise ProtocolViolation(source, "message", f"unknown tag {tag:#x}")
    if tag == AGGREGATION_TAG:
        allowed, words = source != rank, None
    elif tag == TAG_THETA:
        allowed, words = source != rank and source in active_ranks, None
    elif tag == TAG_THETA_REQUEST:
        allowed, words = source != rank and source in active_ranks and not synchronous and not he, None
    elif tag == TAG_DONE:
        allowed, words = source != rank and source in active_ranks, 1
    elif tag == TAG_ACK:
        allowed, words = source != rank and synchronous, 1
    elif tag == TAG_STOP:
        allowed, words = source == rank, 1
    elif tag == TAG_HEARTBEAT:
        allowed, words = source != rank, 1
    elif tag in (TAG_HE_BATCH, TAG_HE_DECRYPTED):  # dominator → passive party
        allowed, words = he and source in active_ranks and rank not in active_ranks, None
    else:  # TAG_HE_MASKED: passive party → dominator
        allowed, words = he and source not in active_ranks and rank in active_ranks, None
    if not allowed:
        raise ProtocolViolation(source, what, f"party {source} may not send it to party {rank}")
    if nbytes <= 0 or nbytes % 8:
        raise ProtocolViolation(source, what, f"{nbytes} bytes is not a whole, non-zero number of words")
    if words is not None and nbytes != 8 * words:
        raise ProtocolViolation(source, what, f"{nbytes // 8} words, expected {words}")
