"""The data plane of one party: its threads and the dominated loop.

Threads:

* **communication thread** - the only receiver on the data communicator. It waits in one blocking
  ``Recv(ANY_SOURCE, ANY_TAG)`` (no ``Probe``: with more ranks than cores it costs an OS time slice per
  message; ``--label-privacy he`` polls), validates what arrived (:func:`~parties.messages.check_envelope`,
  then each kind's receiver) and serves it: secure-aggregation traffic (masked products for dominators'
  requests, tree sums), (ϑ, i) broadcasts (handed to a worker), the synchronous baselines' ACKs,
  heartbeats. With ``link_delay`` it hands messages to a :class:`~protocols.delay.DelayedDelivery` thread.
* **k worker threads** - apply collaborative updates (Alg. 3/5/7) to the shared block ``w`` lock-free
  with numba ``nogil`` kernels, so they really run in parallel. The ϑ stream of dominator r goes to
  worker ``r mod k`` (k = m: one worker per dominator stream, the paper's setting).
* **heartbeat thread** - tells the others this party is alive, ends the job when one is silent, and
  watches the partial sums this party's requests wait for (a heartbeat never counts as progress).
* **the dominated loop** (:meth:`DataPlane.dominate`, the main thread of an active party during a
  segment, ``parties/dominated.py``): sample rows, obtain ŵ·x by Algorithm 1 rooted here, compute ϑ,
  broadcast (ϑ, i), update its own block.

On the inline path (:func:`inline_path`: linear block, async, small B; docs/runtime.md, "The B = 1 hot
path") the communication thread runs the dominator's steps and applies the (ϑ, i) it receives itself:
no result or broadcast crosses to another thread.

What a party computes (its contribution to rows, its step from ϑ) is its *part*
(``parties/party_model.py``): the linear block with its lock-free kernels, or a network of
``vertical/nn`` (k values a row, one lock); the wire carries B·k values where the linear block has k = 1.

Every wait on a peer has a deadline (``--peer-timeout``; the rule, the levels and the control words'
checks: docs/runtime.md, "Liveness"): a request's partial sums (watched by the heartbeat thread), a
segment's ``DONE`` (:meth:`DataPlane.drain`), a synchronous step's acknowledgements, the closing STOPs.

Every data-plane message goes through one :class:`~protocols.transport.MpiTransport`: sends may come
from any thread (``MPI_THREAD_MULTIPLE``), never block, and are sealed there with ``--secure-channels``.
Under ``--label-privacy he`` the batches to passive parties are the label plane's (label_plane.py).
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from parties.dominated import TICK, DominatedLoop
from parties.lifecycle import guarded, stop_job
from parties.messages import (
    MAX_MESSAGE_WORDS,
    MESSAGE_KINDS,
    TAG_ACK,
    TAG_DONE,
    TAG_HE_BATCH,
    TAG_HE_DECRYPTED,
    TAG_HE_MASKED,
    TAG_HEARTBEAT,
    TAG_STOP,
    TAG_THETA,
    TAG_THETA_REQUEST,
    WORKER_BATCH,
    check_envelope,
)
from parties.options import RuntimeOptions
from parties.party_model import part_of
from protocols import label_he
from protocols.aggregation import HEADER_WORDS, AggregationNode, Completed, Kind, Requested
from protocols.channels import OVERHEAD_WORDS
from protocols.delay import DelayedDelivery
from protocols.dispatch import Inbox, split_piggyback
from protocols.errors import ProtocolViolation
from protocols.liveness import Liveness
from protocols.schedule import DominatorSchedule
from protocols.transport import AGGREGATION_TAG, MpiTransport

#: Most request ids of one dominator this party accepts beyond its oldest unfinished one: the job's
#: ``--inflight``, at most this (request ``rid`` comes only once ``rid - inflight`` is done here). At most
#: 256 × 2 partial sums of 8,192 words (32 MiB) per dominator; the rest of its schedule:
#: ``protocols/schedule.py``.
MAX_OPEN_REQUESTS = 256


#: Largest B the inline path takes: at small B a step costs less than handing it to another thread
#: (docs/runtime.md, "The B = 1 hot path"); larger batches go to the k workers, whose kernels run in
#: parallel and leave the communication thread free to answer other dominators.
INLINE_MAX_BATCH = 8
#: an injected straggler spins the last this many seconds of each wait and sleeps the rest (_straggle)
STRAGGLE_SPIN_S = 2e-4


def inline_path(options: RuntimeOptions, part, label) -> bool:
    """Whether the communication thread runs this party's steps and applies its (ϑ, i) itself: a linear
    block (lock-free kernels, one call per message), the asynchronous mode (no step waits for
    acknowledgements), B ≤ :data:`INLINE_MAX_BATCH`, no label plane, and none of the emulations that
    act between threads (a link delay's delivery thread, a straggler's slowed workers)."""
    straggler = options.straggler is not None and (options.slowdown or options.apply_delay)
    return (part.merges_messages and not options.synchronous and label is None
            and options.batch_size <= INLINE_MAX_BATCH and not straggler
            and not (options.link_delay or options.link_jitter))


class DataPlane(DominatedLoop):
    """One party's data communicator (a duplicate of ``comm``, collective), its threads and the
    dominated loop. ``control`` is the party's control plane (barriers, the ``sync-global``
    agreement), ``label`` its label plane under ``--label-privacy he`` (else None), ``records`` the
    audit transcript (None when not auditing), ``liveness`` the party's deadlines (the control plane's).
    :meth:`start` starts the threads, :meth:`stop` ends them, :meth:`free` frees the communicator."""

    #: ``--engine compiled``: the numba pump that serves the hot path (parties/compiled_pump.py)
    pump = None

    def __init__(self, comm: MPI.Comm, party, options: RuntimeOptions, *, tree_pairs, control,
                 label=None, records: list | None = None) -> None:
        self.party = party
        self.rank, self.q = comm.Get_rank(), comm.Get_size()
        self.liveness: Liveness = control.liveness
        self.data = self.liveness.dup(comm, "the set-up of the data plane")
        self.control = control
        self.label = label
        self.transcript = records
        self.active_ranks = list(options.active_ranks)
        self.synchronous = options.synchronous
        self.dispatch = options.dispatch
        self.batch_size = options.batch_size
        self.inflight = 1 if self.synchronous else options.inflight
        self.piggyback = options.piggyback and options.dispatch
        self.he = label is not None
        #: what this party computes with: its linear block or its network (k values a row)
        self.part = part_of(party)
        self.width = self.part.k
        self._lockstep = control.lockstep is not None  # sync-global: the dominators agree on each step
        #: --label-privacy he with passive parties: their batches go encrypted
        self._he_passive = self.he and len(self.active_ranks) < self.q
        #: sync modes: the most steps this dominator ever had broadcast but not fully acknowledged
        self.max_unacked = 0
        self.slowdown = options.slowdown if options.straggler == self.rank else 0.0
        #: seconds the straggler's workers wait before applying a batch (a collaborator slow to update)
        self.apply_delay = options.apply_delay if options.straggler == self.rank else 0.0
        self.node = AggregationNode(self.rank, self.q, tree_pairs, allow_leaky_q2=options.allow_two_parties,
                                     roots=options.active_ranks,  # only dominators root a request
                                     max_open=min(self.inflight, MAX_OPEN_REQUESTS),
                                     batch=options.batch_size, width=self.width)
        #: each dominator held to its schedule: requests ahead of its broadcasts, broadcasts of its requests
        self.schedule = DominatorSchedule(self.q, inflight=self.inflight, dispatch=options.dispatch)
        self.node_lock = threading.Lock()
        self.inbox = Inbox(self.q, width=self.width)
        self._label_state(label)
        if options.label_privacy == "dp-theta":
            self._protect_theta(options)
        self._transport(options)
        self._counters()
        #: per request of this dominator: who takes its scores (a waiting slot's put, or the inline step)
        self.results: dict[int, Callable[[np.ndarray], None]] = {}
        self._routing(options, label)
        #: this dominator's row sampler (not ``--epsilon``'s pass batches): its checkpoint keeps where it
        #: stands, so a resumed lock-step run draws the rows the uninterrupted one would have
        self.sampler = np.random.default_rng([options.seed, self.rank])
        self.peer_timeout = options.peer_timeout
        self.last_heard = np.zeros(self.q)
        self._stopping = threading.Event()
        self._guard = functools.partial(guarded, self.data, self.rank)
        self._link = (options.link_delay, options.link_jitter, options.seed + self.rank)
        self.compiled = options.engine == "compiled"  # the pump (below) is built at warm-up

    def _transport(self, options: RuntimeOptions) -> None:
        """The data plane's one transport (protocols/transport.py), every data-plane message both ways:
        sends from any thread; the communication thread is its one receiver. With keys every message
        between parties is sealed (authenticated encryption), per plane."""
        self.channels = None if options.keys is None else options.keys.channels(self.rank, b"data")
        wire_words = self.max_words + (0 if self.channels is None else OVERHEAD_WORDS)
        self.transport = MpiTransport(self.data, capacity_words=wire_words, max_message_words=wire_words,
                                      channels=self.channels, kinds=MESSAGE_KINDS, liveness=self.liveness,
                                      silent_tags=frozenset({TAG_HEARTBEAT}))

    def _routing(self, options: RuntimeOptions, label) -> None:
        """Who applies each dominator's (ϑ, i): the communication thread itself on the B = 1 hot path
        (docs/runtime.md, no hand-off to another thread), else worker r mod k for dominator r, each
        worker writing through its own writer slot."""
        self.inline = inline_path(options, self.part, label)
        self.inline_lock = threading.RLock()
        self._writer_of = [self.active_ranks.index(r) % options.threads + 1 if r in self.active_ranks else 0
                           for r in range(self.q)]
        self.queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(options.threads)]
        self._queue_of = [self.queues[self.active_ranks.index(r) % len(self.queues)]
                          if r in self.active_ranks else None for r in range(self.q)]

    def _counters(self) -> None:
        """What the control words of the data plane are checked against, per party."""
        self.applied = np.zeros(self.q, dtype=np.int64)
        self.applied_cond = threading.Condition()
        self.sent = 0
        #: per dominator: segments it has finished, and its cumulative (ϑ, i) broadcasts at that point
        self.done_segments = np.zeros(self.q, dtype=np.int64)
        self.done_sent = np.zeros(self.q, dtype=np.int64)
        self.segment = 0
        self._drained = 0  # segments this party has drained: a DONE is at most one ahead of it
        #: sync modes: per party, the ACKs received (each for the next of this dominator's (ϑ, i))
        self.acked = np.zeros(self.q, dtype=np.int64)
        self.acked_cond = threading.Condition()
        self._stopped = np.zeros(self.q, dtype=np.int64)  # STOP messages received, per party
        #: requests started here (its own and others') and when: the heartbeat thread watches their
        #: partial sums until they are done here (under node_lock)
        self._started: dict[tuple[int, int], float] = {}

    def _label_state(self, label) -> None:
        """What the hot path needs of the label plane, as plain attributes: the largest message, and under
        ``--epsilon`` the noise and the pass batches."""
        self.max_words = MAX_MESSAGE_WORDS if label is None else label.max_words
        b, k = self.batch_size, self.width
        #: a network's messages hold B·k values (a partial sum; each row's ϑ): the job fixes both
        self.max_words = max(self.max_words, HEADER_WORDS + b * k, 2 + b + b * k)
        if self.piggyback:  # a (ϑ, i) message of B rows and a request for B rows, behind a length word
            self.max_words = max(self.max_words, 1 + (2 + b + b * k) + (HEADER_WORDS + b))
        self._noise_std = 0.0 if label is None else label.noise_std
        self._batches = None if label is None else label.batches

    def _protect_theta(self, options: RuntimeOptions) -> None:
        """``--label-privacy dp-theta``: the label holder's top releases each row's ϑ clipped and noised
        (σ from the plan's accountant), and draws its batches a pass at a time, so that a row is in one
        release a pass (``vertical/nn/protection.py``). The noise comes from OS entropy: a seed the
        other parties know (the job's is in config.json) would let them subtract it."""
        from parties.label_plane import PassBatches
        from vertical.nn.protection import LabelProtection, RowNoise

        assert options.noise_multiplier is not None, "the launcher sizes σ (parties.plan.noise_multiplier)"
        if options.theta_noise == "per-row":
            if self.party.active:  # the label holder alone draws (and keeps) the rows' noise
                self.part.protection = RowNoise.drawn(self.party.block.n_rows, self.part.k,
                                                      options.noise_multiplier, np.random.default_rng())
        else:
            self.part.protection = LabelProtection(clip=1.0, noise_multiplier=options.noise_multiplier,
                                                   rng=np.random.default_rng())
        if self.party.active:
            self._batches = PassBatches(self.party.block.n_rows, self.batch_size, len(self.active_ranks),
                                        self.active_ranks.index(self.rank), options.seed)

    def start(self) -> None:
        """Warm up, wait until every party has (silence from then on means something), start the threads."""
        self._warm_up()
        self.control.barrier()
        self.liveness.timeout = self.peer_timeout  # up: from now on every wait has --peer-timeout
        self.last_heard[:] = time.monotonic()
        self._heartbeat = threading.Thread(target=self._guard(self._heartbeat_loop), name="heartbeat",
                                           daemon=True)
        self._heartbeat.start()
        delay, jitter, seed = self._link
        #: with an emulated link delay, received messages wait there before they are processed
        self.link = (DelayedDelivery(self._process, delay, jitter, seed=seed, wrap=self._guard)
                     if delay or jitter else None)
        self._comm_thread = threading.Thread(target=self._guard(self._comm_loop), name="comm", daemon=True)
        self._workers = [threading.Thread(target=self._guard(self._worker_loop), args=(qu, k + 1),
                                          name=f"worker-{k}", daemon=True)
                         for k, qu in enumerate(self.queues)]
        for t in [self._comm_thread, *self._workers]:
            t.start()

    def _warm_up(self) -> None:
        """Compile the numba kernels (or run a network once) now, so that it never counts as training."""
        self.part.warm_up()
        if self.compiled:
            from parties.compiled_pump import CompiledPump

            self.pump = CompiledPump(self)
            self.pump.warm_up()

    def stop(self) -> None:
        """End this party's threads once every party is done (call after a control-plane barrier).

        The heartbeat and the workers stop first; then this party tells every party, itself included,
        that it sends nothing more (STOP), and the communication thread ends when it has heard that from
        every party. MPI keeps one sender's messages in order, so nothing is in flight on the data
        communicator afterwards and :meth:`free` may free it.
        """
        self._stopping.set()
        self._heartbeat.join()
        for qu in self.queues:
            qu.put(None)
        for t in self._workers:
            t.join()
        stop = np.zeros(1, np.uint64)
        for dest in range(self.q):
            self.transport.send(dest, stop, TAG_STOP)
        since, level = time.monotonic(), self.liveness.exchange_level
        while self._comm_thread.is_alive():  # a party that never says STOP ends the job, named
            self._comm_thread.join(TICK)
            self.liveness.check({p: level for p in range(self.q) if not self._stopped[p]}, since,
                                "its STOP message")
        if self.link is not None:
            self.link.close()
        self.transport.flush(level)

    def free(self) -> None:
        """Free the data communicator (collective); afterwards it is ``MPI.COMM_NULL``."""
        if self.data != MPI.COMM_NULL:
            self.data.Free()

    # ---------------------------------------------------------------------------------- thread bodies

    def _comm_loop(self) -> None:
        # One blocking Recv(ANY_SOURCE, ANY_TAG) into a reused buffer (MpiTransport.recv_any): with ranks
        # outnumbering cores, Probe + Recv measured 1-8 ms per round trip here, a plain Recv 20-35 µs; HE
        # and a network part poll, sleeping up to 1 ms (their messages come milliseconds apart, and MPICH's
        # Recv spins: runtime.md; a network's epoch took 1.6-1.7x longer spinning, docs/vertical-networks.md).
        # Everything another party sends is validated here, before it can reach a kernel: the envelope by
        # check_envelope, the contents by Inbox (ϑ, i; DONE) and AggregationNode.receive (with this party's
        # n_rows for REQUEST indices); a ProtocolViolation names the sender, the thread's guard ends the job.
        if self.pump is not None:  # --engine compiled: the numba pump serves the hot path's tags
            return self.pump.serve()
        idle = (lambda: None,) if self.he or self.part.polls else ()
        while True:
            source, tag, msg = self.transport.recv_any(*idle)  # framing, sizes and seals checked there
            check_envelope(source, tag, msg.nbytes, rank=self.rank, active_ranks=self.active_ranks,
                           synchronous=self.synchronous, he=self.he)
            self.last_heard[source] = time.monotonic()
            if self.transcript is not None:
                self.transcript.append((source, tag, msg.copy()))
            if tag == TAG_STOP:
                if self._on_stop(source):
                    return
            elif self.link is not None:  # emulated latency: processed later
                self.link.submit(source, tag, msg)
            else:
                self._process(source, tag, msg)

    def _on_stop(self, source: int) -> bool:
        """Count ``source``'s STOP (one a party); whether every party has sent its own."""
        self._stopped[source] += 1
        if self._stopped[source] > 1:
            raise ProtocolViolation(source, "STOP message", "a second one")
        return bool(self._stopped.all())

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
            self._on_done(source, msg.view(np.int64))
        elif tag == TAG_ACK:
            self._on_ack(source, int(msg[0]))
        elif tag == TAG_HE_BATCH:
            seq, rows, payload = label_he.unpack_batch(source, msg, n_rows=self.party.block.n_rows,
                                                       batch=self.batch_size)
            self.inbox.next_sequence(source, seq, "encrypted batch")
            self._scheduled(source, seq, rows, "encrypted batch")
            self.label.arrived(source, seq, rows, payload, self.transport)  # masked at once, label_plane.py
            self._queue_of[source].put((source, rows, payload, seq))
        elif tag == TAG_HE_MASKED:
            self.label.decrypt_later(source, msg, self.sent, self.transport)  # answered by the label plane
        elif tag == TAG_HE_DECRYPTED:
            self.label.replies[source].put(msg)
        # TAG_HEARTBEAT: being heard from is all it says

    def _on_done(self, source: int, words: np.ndarray) -> None:
        """A dominator's ``[segment, count]``: the next segment of that dominator (a second DONE of one
        segment, or a replayed one, is refused), no more than one ahead of this party's drained segments,
        and a count of exactly the (ϑ, i) received from it (``Inbox.done``)."""
        segment = int(words[0])
        expected = int(self.done_segments[source]) + 1
        if segment != expected or segment > self._drained + 1:
            kind = "a second or replayed DONE" if segment < expected else "ahead of the segments run"
            raise ProtocolViolation(source, "DONE message", f"for segment {segment} where {expected} was "
                                    f"expected ({kind}; party {self.rank} has drained {self._drained})")
        count = self.inbox.done(source, words[1:])
        with self.applied_cond:
            self.done_segments[source] = segment
            self.done_sent[source] = count
            self.applied_cond.notify_all()

    def _on_ack(self, source: int, seq: int) -> None:
        """A collaborator acknowledges this dominator's (ϑ, i) number ``seq``: its next, and one sent."""
        with self.acked_cond:
            expected = int(self.acked[source])
            if seq != expected or seq >= self.sent:
                kind = "a replay" if seq < expected else "out of order, or for a step not sent"
                raise ProtocolViolation(source, "ACK message", f"acknowledges (ϑ, i) #{seq} where "
                                        f"#{expected} was expected ({kind}; {self.sent} sent)")
            self.acked[source] = expected + 1
            self.acked_cond.notify_all()

    def _on_theta(self, source: int, message: np.ndarray) -> None:
        """A dominator's (ϑ, i) broadcast: validated (protocols/dispatch.py), then to its worker."""
        rows, thetas = self.inbox.unpack(source, message, self.party.block.n_rows)
        self._scheduled(source, int(message[0]), rows, "(ϑ, i) message")
        if self.inline:  # its worker's writer slot; no worker runs meanwhile
            self.part.step(rows, thetas, self._writer_of[source])
            self._applied([source])
        else:
            self._queue_of[source].put((source, rows, thetas))

    def _scheduled(self, source: int, seq: int, rows: np.ndarray, what: str) -> None:
        """A broadcast is for the request of the same number, aggregated here, and for its rows."""
        with self.node_lock:
            self.schedule.broadcast(source, seq, rows, finished=self.node.finished(source, seq), what=what)

    def _heartbeat_loop(self) -> None:
        """Liveness: tell every other party this one is alive, end the job when one has been silent for
        ``peer_timeout`` seconds (heartbeats included: a party that is stopped, cut off or frozen would
        otherwise leave the others waiting forever; a crashed one is already handled: MPI ends the job),
        and when a child has not delivered a partial sum this party's request waits for
        (:meth:`_check_partial_sums`: heartbeats do not count there)."""
        beat = np.zeros(1, dtype=np.uint64)
        others = [r for r in range(self.q) if r != self.rank]
        every = min(self.peer_timeout / 4, 0.5)
        tick = min(self.peer_timeout / 10, 0.1)
        beaten = 0.0
        while not self._stopping.wait(tick):
            now = time.monotonic()
            if now - beaten >= every:
                for dest in others:
                    self.transport.send(dest, beat, TAG_HEARTBEAT)
                beaten = now
            silent = max(others, key=lambda r: now - self.last_heard[r])
            gap = now - self.last_heard[silent]
            if gap > self.peer_timeout:
                stop_job(self.data, self.rank, "failed",
                         f"party {silent} has been silent for {gap:.1f} s (stopped, unreachable or hung?); "
                         f"--peer-timeout is {self.peer_timeout:g} s")
            self._check_partial_sums()

    def _check_partial_sums(self) -> None:
        """Every request started here: a child that has delivered nothing for its limit (the level of
        its subtree's height) since this party started the request raises PeerTimeout naming it."""
        if self.pump is not None:
            return self.pump.check_partial_sums()
        with self.node_lock:
            waits = []
            for key, since in list(self._started.items()):
                awaited = self.node.awaited(*key)
                if awaited:
                    waits.append((key, since, awaited))
                elif not self.node.in_progress(*key):
                    del self._started[key]
        for (root, rid), since, awaited in waits:
            self.liveness.check(awaited, since, f"its partial sum of request ({root}, {rid})")

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
            with self.node_lock:
                self.schedule.request(event.root, event.rid, event.indices)
            values = self.part.contribute(event.indices)
            with self.node_lock:
                step = self.node.start(event.root, event.rid, values)
                self._started[(event.root, event.rid)] = time.monotonic()
            self._send_all(step.outgoing)
            event = step.event
        if isinstance(event, Completed):
            deliver = self.results.pop(event.rid, None)
            if deliver is None:
                raise ProtocolViolation(source, "tree sum", f"it completed request {event.rid}, which "
                                        f"party {self.rank} never made")
            deliver(event.result())  # to the waiting dominator, or (inline) its next step, here

    def _worker_loop(self, inbox: queue.SimpleQueue, writer: int) -> None:
        """Apply (ϑ, i) messages as they come; whatever has queued up meanwhile is applied in one
        kernel call (same order, same result), so the GIL-holding Python work per message stays
        small and k workers overlap in the ``nogil`` kernels."""
        party = self.party
        if self.he and not party.active:
            return self._he_worker_loop(inbox)
        while True:
            batch = [inbox.get()]
            while len(batch) < WORKER_BATCH and not inbox.empty():
                batch.append(inbox.get_nowait())
            stopping = batch[-1] is None
            items = batch[:-1] if stopping else batch
            if items:
                if self.apply_delay:
                    time.sleep(self.apply_delay)
                started = time.perf_counter()
                if self.part.merges_messages or not self.synchronous:
                    self.part.step(np.concatenate([rows for _, rows, _ in items]),
                                   np.concatenate([thetas for _, _, thetas in items]), writer,
                                   messages=len(items))
                else:  # a network in lock-step: each message is one step of its own batch
                    for _, rows, thetas in items:
                        self.part.step(rows, thetas, writer)
                self._straggle(started)
                self._applied([source for source, _, _ in items])
            if stopping:
                return

    def _he_worker_loop(self, inbox: queue.SimpleQueue) -> None:
        """Passive party under ``--label-privacy he``: for each encrypted batch, in order, the block
        gradient through the label plane, then one step."""
        party = self.party
        while (item := inbox.get()) is not None:
            source, rows, payload, seq = item
            gradient = self.label.passive_gradient(source, rows, payload, seq, self.transport)
            if self.apply_delay:
                time.sleep(self.apply_delay)
            started = time.perf_counter()
            party.rule.apply_gradient(party.w, gradient)
            self._straggle(started)
            self._applied([source])

    def _applied(self, sources: list[int]) -> None:
        """Count what a worker applied (``drain`` waits on it); the synchronous modes acknowledge each."""
        with self.applied_cond:
            numbers = []
            for source in sources:
                numbers.append(int(self.applied[source]))  # its sequence number: applied in order
                self.applied[source] += 1
            self.applied_cond.notify_all()
        if self.synchronous:
            for source, seq in zip(sources, numbers, strict=True):
                self.transport.send(source, np.array([seq], np.uint64), TAG_ACK)

    # ------------------------------------------------------------------------------- dominated updates

    def _straggle(self, started: float) -> None:
        """An injected straggler spends ``slowdown`` times longer on each piece of work: the bulk of a
        long wait slept, the last :data:`STRAGGLE_SPIN_S` (all of a microsecond one) spun, since sleep
        is far too coarse at microsecond scale. A slow party's own machine is slow, not this one's: a
        spun millisecond wait (a network's step) took a core from the other ranks of a shared host, and
        an asynchronous run with a 3x straggler took 2.9x the lock-step run's time an epoch on 2 cores."""
        if self.slowdown:
            deadline = time.perf_counter() + self.slowdown * (time.perf_counter() - started)
            while (remaining := deadline - time.perf_counter()) > STRAGGLE_SPIN_S:
                time.sleep(remaining - STRAGGLE_SPIN_S)
            while time.perf_counter() < deadline:
                pass

    def _send_all(self, outgoing) -> None:
        for message in outgoing:
            self.transport.send(message.dest, message.buffer, AGGREGATION_TAG)

    # ---------------------------------------------------------------------------------- main thread

    def drain(self) -> None:
        """Global barrier: every dominator has finished the segment and every (ϑ, i) it sent has been
        applied here. Waiting happens on a condition variable, not in a spinning MPI collective, so
        the waiting main thread costs no CPU while the segment runs."""
        self.segment += 1
        others = [r for r in self.active_ranks if r != self.rank]
        since, level = time.monotonic(), self.liveness.segment_level
        with self.applied_cond:
            while not all(self.done_segments[r] >= self.segment and self.applied[r] >= self.done_sent[r]
                          for r in others):
                # a dominator still in its segment delivers (ϑ, i) and requests: silence is the stall
                self.liveness.check([r for r in others if self.done_segments[r] < self.segment], since,
                                    f"its DONE of segment {self.segment}", level)
                self.applied_cond.wait(TICK)
            self._drained = self.segment  # the next segment's DONE may come from now on
        self.transport.flush(self.liveness.exchange_level)
        self.control.barrier()
        self.part.synchronize()  # nothing writes now: bring every coordinate up to date
