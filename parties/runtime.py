"""The runtime of one party (one MPI rank): asynchronous VFB² and its synchronous baselines.

:class:`PartyRuntime` composes the planes of a party, each its own module:

* the **data plane** (``parties/data_plane.py``): the communication thread, the workers, the heartbeat
  and the dominated loop, over the data communicator and one :class:`~protocols.transport.MpiTransport`;
* the **control plane** (``parties/control_plane.py``): every barrier-time exchange (barriers, control
  words, the full ϑ and the keys), one named method each, point to point on the control communicator;
  the secure aggregation's full passes (evaluations, SVRG snapshots, the SAGA initial
  pass) run beside it on a duplicate of their own;
* the **label plane** (``parties/label_plane.py``), under ``--label-privacy he``: encrypted batches and
  the SVRG snapshot's encrypted full pass, with label DP under ``--epsilon``;
* the **audit** recorder (``parties/audit.py``), under ``--audit``.

Every wait on a peer, in every thread and plane, has a deadline (:class:`~protocols.liveness.Liveness`,
one per party): a peer that delivers nothing the protocol expects within ``--peer-timeout`` ends the job
named, heartbeats or not (docs/runtime.md, "Liveness").

Message kinds and the data plane's envelope check are in ``parties/messages.py``, the options in
``parties/options.py`` (:class:`~parties.options.RuntimeOptions`). Everything a runtime duplicates is
freed by :meth:`PartyRuntime.close`, so ``parties.training.train`` may run any number of times in one
process.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
from mpi4py import MPI

from parties.audit import AuditLog
from parties.control_plane import ControlPlane
from parties.data_plane import DataPlane
from parties.label_plane import LabelPlane, PassBatches
from parties.lifecycle import OUT_OF_RANGE, name_os_thread, stop_job
from parties.messages import (
    AUDIT_CONTROL_WORD,
    AUDIT_CTRL_AGGREGATION,
    AUDIT_FULL_THETA,
    AUDIT_HE_FULL_GRADIENT,
    AUDIT_HE_GRADIENT,
    AUDIT_HE_KEY,
    AUDIT_LABELS,
    CONTROL_KINDS,
    MAX_MESSAGE_WORDS,
    MESSAGE_KINDS,
    TAG_ACK,
    TAG_DONE,
    TAG_FULL_THETA,
    TAG_HE_BATCH,
    TAG_HE_DECRYPTED,
    TAG_HE_FULL,
    TAG_HE_FULL_DECRYPTED,
    TAG_HE_FULL_MASKED,
    TAG_HE_MASKED,
    TAG_HEARTBEAT,
    TAG_STOP,
    TAG_THETA,
    TAG_THETA_REQUEST,
    WORKER_BATCH,
    check_envelope,
)
from parties.options import RuntimeOptions
from protocols.liveness import STARTUP_TIMEOUT_S, Liveness
from protocols.secure_aggregation import SecureAggregator
from protocols.trees import build_all_tree_pairs
from vertical.algorithms.vfb2 import Block, UpdateRule
from vertical.problems import Problem

__all__ = [
    "AUDIT_CONTROL_WORD", "AUDIT_CTRL_AGGREGATION", "AUDIT_FULL_THETA", "AUDIT_HE_FULL_GRADIENT",
    "AUDIT_HE_GRADIENT", "AUDIT_HE_KEY", "AUDIT_LABELS", "CONTROL_KINDS", "MAX_MESSAGE_WORDS",
    "MESSAGE_KINDS",
    "OUT_OF_RANGE", "TAG_ACK", "TAG_DONE", "TAG_FULL_THETA", "TAG_HEARTBEAT", "TAG_HE_BATCH",
    "TAG_HE_DECRYPTED", "TAG_HE_FULL", "TAG_HE_FULL_DECRYPTED", "TAG_HE_FULL_MASKED", "TAG_HE_MASKED",
    "TAG_STOP", "TAG_THETA", "TAG_THETA_REQUEST", "WORKER_BATCH", "PartyRuntime", "PartyState",
    "PassBatches", "RuntimeOptions", "check_envelope", "name_os_thread", "stop_job",
]


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
    #: the sample ids of its train and test rows, in row order (``vfl predict`` keys its output by them)
    train_ids: np.ndarray | None = None
    test_ids: np.ndarray | None = None
    #: ``--model mlp``: this party's network (a :class:`~vertical.nn.base.PartyModel`, in place of ``w``),
    #: and at the label holder the top network with the loss and the labels as class indices
    network: object | None = None
    top: object | None = None
    classes: np.ndarray | None = None

    @property
    def active(self) -> bool:
        return self.y is not None


class PartyRuntime:
    """Runs one party's planes for a VFB² job; all ranks of ``comm`` construct one collectively and
    :meth:`close` it collectively."""

    def __init__(self, comm: MPI.Comm, party: PartyState, options: RuntimeOptions) -> None:
        _check_options(party, options)
        self.party = party
        self.options = options
        self.rank, self.q = comm.Get_rank(), comm.Get_size()
        self.active_ranks = list(options.active_ranks)
        keys = options.keys
        self.audit = AuditLog(self.rank, options.audit)
        #: every wait on a peer has a deadline (protocols/liveness.py): the start-up's until the data
        #: plane is up (parties load, compile and make keys at their own pace), --peer-timeout after
        pairs = build_all_tree_pairs(self.q, options.seed, allow_leaky_q2=options.allow_two_parties)
        self.liveness = Liveness(self.rank, self.q, max(STARTUP_TIMEOUT_S, options.peer_timeout),
                                 depth=max(max(pair.t1.depth(), pair.t2.depth()) for pair in pairs))
        self.control = ControlPlane(
            comm, self.audit, self.liveness,
            lockstep_of=self.active_ranks if options.mode == "sync-global" else None,
            theta_channels=None if keys is None else keys.channels(self.rank, b"full-theta"))
        self.aggregator = SecureAggregator.over_mpi(
            self.control.comm, tree_pairs=pairs, allow_leaky_q2=options.allow_two_parties,
            channels=None if keys is None else keys.channels(self.rank, b"full-passes"),
            liveness=self.liveness)
        self._aggregation_comm = self.aggregator.transport.comm  # its own duplicate, freed by its close
        self.audit.watch(self.aggregator)
        #: --label-privacy he: passive parties get ϑ only encrypted under the dominator's key
        self.he = options.label_privacy == "he"
        self.label: LabelPlane | None = None
        if self.he:
            self.label = LabelPlane(party, self.control, self.audit, active_ranks=self.active_ranks,
                                    batch_size=options.batch_size, scheme=options.he_scheme,
                                    key_bits=options.he_key_bits, pack=options.he_pack,
                                    stop=partial(stop_job, comm, self.rank))
            if options.noise_multiplier:
                self.label.setup_noise(options.noise_multiplier, options.seed)
        self.plane = DataPlane(comm, party, options, tree_pairs=pairs, control=self.control,
                               label=self.label, records=self.audit.records)
        self.plane.start()

    # ------------------------------------------------------------------ the data plane, delegated

    def dominate(self, n_steps: int, deadline: float | None = None) -> int:
        """Run ``n_steps`` dominated updates (:meth:`DataPlane.dominate`); returns how many were done."""
        return self.plane.dominate(n_steps, deadline)

    def finish_segment(self) -> None:
        self.plane.finish_segment()

    @property
    def sampler(self) -> np.random.Generator:
        """This dominator's row sampler (:attr:`DataPlane.sampler`)."""
        return self.plane.sampler

    @sampler.setter
    def sampler(self, rng: np.random.Generator) -> None:
        self.plane.sampler = rng

    def drain(self) -> None:
        """The global barrier at the end of a segment (:meth:`DataPlane.drain`)."""
        self.plane.drain()

    @property
    def part(self):
        """What this party computes with (``parties/party_model.py``): its linear block or its network."""
        return self.plane.part

    @property
    def transport(self):
        return self.plane.transport

    @property
    def sent(self) -> int:
        return self.plane.sent

    @property
    def applied(self) -> np.ndarray:
        return self.plane.applied

    @property
    def transcript(self) -> list | None:
        return self.audit.records

    # ------------------------------------------------------------------ the control plane, delegated

    def barrier(self) -> None:
        self.control.barrier()

    def broadcast_word(self, value: int, root: int = 0) -> int:
        return self.control.broadcast_word(value, root)

    def broadcast_float(self, value: float, root: int = 0) -> float:
        return self.control.broadcast_float(value, root)

    def sum_word(self, value: int) -> int:
        return self.control.sum_word(value)

    def gather_row_norms(self, largest: float, quantile: float, spectral: float) -> np.ndarray:
        return self.control.gather_row_norms(largest, quantile, spectral)

    # ------------------------------------------------------------------------ the full passes

    def full_scores(self, test: bool = False, root: int = 0) -> np.ndarray | None:
        """w·x_i for every training (or test) sample, at ``root``, by batched secure aggregation."""
        block = self.party.test_block if test else self.party.block
        assert block is not None
        X = block.to_csr()
        indices = np.arange(X.shape[0]) if self.rank == root else None
        return self.aggregator.inner_product(self.party.w, X, indices, root=root)

    def full_embeddings(self, test: bool = False, root: int = 0) -> np.ndarray | None:
        """``z_i = Σ_l h_l(x_i)``, ``(n, k)``, for every training (or test) row at ``root`` (``--model
        mlp``): each party's network on its own rows, summed by the secure aggregation, so no party sees
        another's embeddings."""
        block = self.party.test_block if test else self.party.block
        assert block is not None
        part = self.plane.part
        total = self.aggregator.sum(part.embed(block.to_csr()).ravel(), root=root)
        return None if total is None else total.reshape(-1, part.k)

    def full_theta(self, root: int = 0) -> np.ndarray:
        """The n-vector ϑ at the current w, computed at the leader and given to every party."""
        z = self.full_scores(root=root)
        theta = np.empty(self.party.block.n_rows)
        if self.rank == root:
            assert self.party.problem is not None
            theta[:] = self.party.problem.theta(z, self.party.y)
        self.control.share_theta(theta, root)
        return theta

    def snapshot(self, root: int = 0) -> None:
        """SVRG's snapshot at every party: ϑ_0 at the current w and μ_l = (1/n) X_lᵀϑ_0.

        Under ``--label-privacy he`` only the label holders get ϑ_0; a passive party gets μ_l alone,
        through the batch protocol of protocols/label_he.py run once on all n rows (encrypted ϑ_0, its
        masked encrypted X_lᵀϑ_0, the masked decryption). n must exceed d_l, as B must (checked by
        the launcher), or X_lᵀϑ_0 would determine ϑ_0.
        """
        rule = self.party.rule
        if self.label is None or len(self.active_ranks) == self.q:
            rule.snapshot(self.full_theta(root))
            return
        z = self.full_scores(root=root)
        if self.rank == root:
            assert self.party.problem is not None
            theta = np.asarray(self.party.problem.theta(z, self.party.y), dtype=np.float64)
            self.control.send_theta(theta, [p for p in self.active_ranks if p != root])
            self.label.full_pass_leader(theta)
            rule.snapshot(theta)
        elif self.party.active:
            theta = np.empty(self.party.block.n_rows)
            self.control.receive_theta(theta, root)
            rule.snapshot(theta)
        else:
            rule.snapshot_mean(self.label.full_pass_passive(root) / self.party.block.n_rows)

    def regularizer_sum(self, root: int = 0) -> float | None:
        """λ Σ_l g(w_l) at ``root``, by secure aggregation of each party's own term."""
        rule = self.party.rule
        term = rule.lam * rule.regularizer.value(self.party.w) if rule.lam else 0.0
        total = self.aggregator.sum(np.array([term]), root=root)
        return None if total is None else float(total[0])

    # ------------------------------------------------------------------------------ the end

    def save_transcript(self, path) -> None:
        """Write what this party received (``audit`` mode) for the message-audit tests and users."""
        self.audit.save(path, sent=self.plane.sent, applied=self.plane.applied,
                        max_unacked=self.plane.max_unacked)

    def close(self) -> None:
        """Stop this party's threads and free every communicator it duplicated (collective with the
        other parties): afterwards ``communicators()`` are all ``MPI.COMM_NULL``."""
        self.control.barrier()
        self.plane.stop()
        self.aggregator.close()
        self.control.barrier()
        self.plane.free()
        self.control.close()

    def communicators(self) -> list[MPI.Comm]:
        """Every communicator this runtime duplicated (the leak test checks them after :meth:`close`)."""
        return [self.plane.data, self.control.comm, self._aggregation_comm]


def _check_options(party: PartyState, options: RuntimeOptions) -> None:
    writers = getattr(party.rule, "writers", options.threads + 1)
    if writers < options.threads + 1:  # the dominator and each worker need their own writer slot
        raise ValueError(f"the update rule has {writers} writer slot(s); a party with {options.threads} "
                         f"worker thread(s) needs {options.threads + 1} (build it with "
                         f"writers={options.threads + 1})")
    if options.piggyback and (options.synchronous or options.label_privacy == "he"):
        raise ValueError("piggybacking needs the asynchronous mode without --label-privacy he: a "
                         "synchronous step waits for its acknowledgements before the next request, "
                         "and passive parties get ϑ encrypted")
