"""Training one party: ``train(comm, party, config)``, the library call behind ``vfl train``.

Every rank of ``comm`` calls it with its own :class:`~parties.runtime.PartyState`. Training runs in
segments of ``eval_every`` epochs separated by global barriers, where the evaluation and the
checkpoint happen. SVRG's snapshot is taken at such a barrier every ``snapshot_every`` epochs (a
segment never straddles one), so how often a run is evaluated does not change the algorithm.
Rank 0 is the leader: an active party that computes the full ϑ vectors, evaluates, logs metrics,
shows progress and decides when to stop.

The leader's decision reaches the others as one int64 word (a buffer broadcast, never pickle: a party
must not be able to run code on another); an unknown word ends the job naming the leader.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from mpi4py import MPI

from parties.checkpoint import (
    complete_epochs,
    load_checkpoint,
    mark_complete,
    metrics_before,
    sampler_from_words,
    sampler_words,
    save_checkpoint,
)
from parties.config import RunConfig
from parties.engine import engine_for
from parties.messages import TAG_IDS
from parties.outcomes import Outcome, worse_than_start_warning
from parties.plan import JobPlan, next_segment, segment_quota
from parties.runtime import PartyRuntime, PartyState, RuntimeOptions
from parties.step import choose_gamma
from parties.threads import configured
from protocols.errors import ProtocolViolation
from protocols.liveness import STARTUP_TIMEOUT_S, Liveness, Pending

LEADER = 0
#: A loss above this multiple of the initial loss (or non-finite) means the run diverged.
DIVERGENCE_FACTOR = 10.0


@dataclass
class TrainResult:
    """What ``train`` returns on every rank; ``record`` (the last evaluation) only on the leader."""

    outcome: Outcome
    epochs: float
    updates: int
    train_time: float
    record: dict | None


def train(comm: MPI.Comm, party: PartyState, config: JobPlan | RunConfig) -> TrainResult:
    """Train this party's block with the other ranks of ``comm`` (collective); returns the outcome.

    ``party.w`` holds the trained block afterwards; checkpoints and the leader's metrics go to
    ``config.out``. A plain :class:`RunConfig` (a program of one's own, with ``out`` set) is taken as
    the plan that resolves nothing (no f*, no DP noise, no channel keys).
    """
    if isinstance(config, RunConfig):
        config = JobPlan.of(config)
    check_aligned(comm, party)
    runtime = PartyRuntime(comm, party, RuntimeOptions.from_config(
        config, keys=config.sealing_keys(comm.Get_rank())))
    result = _Trainer(runtime, config).run()
    runtime.close()
    if config.audit:  # what this party received is its own: in its folder (--party-dir), not the run's
        folder = config.party_folder(runtime.rank)
        folder.mkdir(parents=True, exist_ok=True)
        runtime.save_transcript(folder / f"audit-{runtime.rank}.npz")
    return result


class MisalignedError(ValueError):
    """The parties' rows are not the same samples in the same order."""


def check_aligned(comm: MPI.Comm, party: PartyState, timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Every party's sample ids, in row order, must be the leader's (collective; digests only).

    Training on misaligned rows would silently fit noise, so it is refused on every rank, naming the
    parties whose rows differ. Only 32-byte digests cross: no party learns another's ids. Point to
    point under a deadline (the start-up's: parties load their data at their own pace), so a party that
    never shows up is named (protocols/liveness.py).
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = np.frombuffer(party.ids_digest, dtype=np.uint8)
    every = np.zeros((size, mine.size), dtype=np.uint8)
    every[rank] = mine
    pending = Pending(comm, Liveness(rank, size, timeout), "digest of its sample ids")
    for p in range(size):
        if p != rank:
            pending.recv(every[p], p, TAG_IDS)
            pending.send(mine, p, TAG_IDS)
    pending.wait()
    differ = [r for r in range(size) if not np.array_equal(every[r], every[LEADER])]
    if differ:
        raise MisalignedError(f"the rows of parties {differ} are not the same samples as party {LEADER}'s "
                              "(different sample ids or order): align the files first")


#: epochs: sums of segment lengths may miss a snapshot boundary by rounding; never by this much
SNAPSHOT_SLACK = 1e-9


class _Trainer:
    """The main thread of one rank: segments, barriers, evaluation, metrics, checkpoints."""

    def __init__(self, runtime: PartyRuntime, config: JobPlan) -> None:
        self.rt = runtime
        self.config = config
        self.party = runtime.party
        self.rank = runtime.rank
        self.epochs = 0.0
        self.train_time = 0.0
        self.updates = 0
        self.marked: float | None = None  # the last epoch the leader marked complete (none yet)
        self.initial_loss: float | None = None
        self.gamma = config.gamma  # the base step: derived from the data at start when None
        self.step = config.gamma   # the step of the current epoch (--gamma-decay decays it from gamma)
        self.out = Path(config.out)
        self.folder = config.party_folder(self.rank)
        self.log = None
        self.bar = None

    def run(self) -> TrainResult:
        config, party = self.config, self.party
        kept = self._resume() if config.resume else None
        self.gamma = choose_gamma(self.rt, config, kept)  # before any step (collective unless --gamma γ)
        self.step = config.gamma_at(self.epochs, self.gamma)
        if config.gamma_decay:  # before the (collective) evaluation: no (ϑ, i) of this run can come sooner
            self.rt.part.set_step(self.step)
        if self.rank == LEADER:
            self._open_outputs()
        record = self._evaluate()
        if party.rule.needs_initial_pass:
            started = time.perf_counter()
            party.rule.initialize(self.rt.full_theta(LEADER), party.w)
            self.rt.barrier()  # no (ϑ, i) may reach a party before its table is built
            self.train_time += time.perf_counter() - started
        outcome = self._decide(record)
        next_snapshot = self.epochs  # a resumed run rebuilds its snapshot from the restored blocks
        while outcome is Outcome.CONTINUE:
            next_snapshot = self._segment(next_snapshot)
            record = self._evaluate()
            save_checkpoint(self.folder, self.rank, party.w, self.epochs, self.train_time, self.updates,
                            keep=self.marked, gamma=self.gamma,
                            sampler=sampler_words(self.rt.sampler) if party.active else None,
                            network=None if party.network is None else self.rt.part.state())
            self.rt.barrier()  # every party has written this epoch's block: it is complete
            if self.rank == LEADER:
                mark_complete(self.out, self.epochs)
            self.marked = self._marked(self.epochs if self.rank == LEADER else 0.0)
            outcome = self._decide(record)
        if self.bar is not None:
            self.bar.close()
        if self.log is not None:
            self.log.close()
            self._summary(record, outcome)
        return TrainResult(outcome, self.epochs, self.updates, self.train_time,
                           record if self.rank == LEADER else None)

    def _resume(self) -> float | None:
        """Restore this party's block and counters from the newest epoch every party completed; returns
        the base step the checkpoint holds (None in one written before it was kept)."""
        epochs = self._marked(complete_epochs(self.out) if self.rank == LEADER else 0.0)
        self.marked = epochs
        network = None if self.party.network is None else self.rt.part.state_shapes()
        ckpt = load_checkpoint(self.folder, self.rank, self.party.block.n_cols, epochs, network)
        self.party.w[:] = ckpt.w
        if ckpt.network is not None:
            self.rt.part.load_state(ckpt.network)
        self.epochs, self.train_time, self.updates = ckpt.epochs, ckpt.train_time, ckpt.updates
        if ckpt.sampler is not None and self.party.active:  # the rows the run would have drawn next
            self.rt.sampler = sampler_from_words(ckpt.sampler, "this party's checkpoint")
        if self.rank == LEADER:
            print(f"resuming from epoch {ckpt.epochs:g}, the newest epoch every party completed "
                  f"({ckpt.updates} dominated updates, {ckpt.train_time:.2f} s of training so far)",
                  flush=True)
        return ckpt.gamma

    def _marked(self, epochs: float) -> float:
        """The leader's marked epoch to every party, once it is in the manifest: a party keeps the file
        holding it until it learns of a newer one (:func:`parties.checkpoint.save_checkpoint`)."""
        word = self.rt.broadcast_float(epochs, root=LEADER)
        if not math.isfinite(word) or word < 0:
            raise ProtocolViolation(LEADER, "complete epoch", f"{word!r} is no epoch count")
        return word

    def _open_outputs(self) -> None:
        """The leader's metrics log and progress bar (and a word when there is nothing to test on)."""
        config = self.config
        self.out.mkdir(parents=True, exist_ok=True)
        if self.party.test_block is None:  # said once, up front: a missing metric is not an oversight
            print("note: the data hold no test rows (no row is marked `test` in a `split` column), so "
                  "this run reports no test metric", flush=True)
        if config.resume:  # the resumed epoch is evaluated (and logged) again next
            metrics_before(self.out / "metrics.jsonl", self.epochs)
        self.log = open(self.out / "metrics.jsonl", "a" if config.resume else "w")  # noqa: SIM115
        if config.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=config.epochs, initial=self.epochs, unit="epoch",
                            desc=f"VFB²-{config.algorithm} {config.mode} q={config.parties}")

    def _segment(self, next_snapshot: float) -> float:
        """Train one segment of the schedule (collective); returns when the next snapshot is due."""
        config, party = self.config, self.party
        if config.gamma_decay:  # the step this segment trains with, set when the last one ended (below)
            self.step = config.gamma_at(self.epochs, self.gamma)
        started = time.perf_counter()
        # every rank sums the same words into self.epochs, so all agree on when a snapshot happens
        if party.rule.needs_snapshot and self.epochs >= next_snapshot - SNAPSHOT_SLACK:
            self.rt.snapshot(LEADER)
            # every party holds the new ϑ₀ and μ before any dominator sends a (ϑ, i) of this outer
            # loop: one applied with the previous snapshot's ϑ₀ would not be an SVRG step
            self.rt.barrier()
            next_snapshot = self.epochs + config.snapshot_every
        # the schedule the label-DP accounting counts (parties.plan.label_dp_releases)
        segment = next_segment(config.options, self.epochs,
                               next_snapshot if party.rule.needs_snapshot else None)
        n = party.block.n_rows
        done = 0
        if party.active:
            deadline = None if config.time_limit is None else started + config.time_limit - self.train_time
            done = self.rt.dominate(segment_quota(config.options, segment, n), deadline)
            self.rt.finish_segment()
        self.rt.drain()
        self.train_time += time.perf_counter() - started
        done_all = self.rt.sum_word(done)
        self.updates += done_all
        self.epochs += (done_all * config.batch_size / n if config.time_limit is not None
                        else segment)  # cut short?
        if config.gamma_decay:
            # the next segment's step, set now, with every coordinate up to date (drain): a dominator
            # may send its first (ϑ, i) as soon as the leader decides to go on, before this party's
            # main thread is back in _segment (the step changes only at whole epochs: next_segment)
            self.rt.part.set_step(config.gamma_at(self.epochs, self.gamma))
        return next_snapshot

    # ------------------------------------------------------------------------------------ the leader

    def _decide(self, record: dict | None) -> Outcome:
        """The leader decides whether to go on; every rank learns it from one broadcast word."""
        decision = 0
        if self.rank == LEADER:
            assert record is not None
            decision = self._outcome(record)
        word = self.rt.broadcast_word(decision, root=LEADER)
        try:
            return Outcome(word)
        except ValueError:
            raise ProtocolViolation(LEADER, "stop decision", f"{word} is no outcome") from None

    def _outcome(self, record: dict) -> Outcome:
        c = self.config
        loss = record["loss"]
        if self.initial_loss is None:
            self.initial_loss = loss
        if not math.isfinite(loss) or loss > DIVERGENCE_FACTOR * max(self.initial_loss, 1e-12):
            return Outcome.DIVERGED
        if (c.target_suboptimality is not None and "suboptimality" in record
                and record["suboptimality"] <= c.target_suboptimality):
            return Outcome.TARGET
        if self.epochs >= c.epochs - 1e-9 or (c.time_limit is not None and self.train_time >= c.time_limit):
            return Outcome.BUDGET
        return Outcome.CONTINUE

    def _summary(self, record: dict, outcome: Outcome) -> None:
        c = self.config
        rate = self.updates / self.train_time if self.train_time else 0.0
        shown = ", ".join(f"{k} {v:.6g}" for k, v in record.items()
                          if k in ("loss", "suboptimality", "test_accuracy", "test_rmse"))
        data = self._data_name()
        chosen = "--gamma" if c.gamma is not None else ("derived from the data" if c.model == "linear"
                                                         else "Adam's default")
        model = "" if c.model == "linear" else f" with networks {c.bottom} / top {c.top}"
        engine = engine_for(c)
        how = f"{c.mode}, compiled engine" if engine == "compiled" else c.mode
        print(f"VFB²-{c.algorithm}{model} ({how}) on {data}, "
              f"q={c.parties}, m={c.active}, γ = {self.gamma:.4g} ({chosen}): {self.epochs:g} epochs, "
              f"{self.updates} dominated updates in "
              f"{self.train_time:.2f} s of training ({rate:,.0f}/s); {shown}.\n"
              f"Metrics: {self.out / 'metrics.jsonl'}; each party's block: "
              f"{c.party_dir or self.out}/party-<rank>.ckpt.npz",
              flush=True)
        summary = {"outcome": outcome.name.lower(), "data": data, "epochs": self.epochs,
                   "updates": self.updates, "train_time": self.train_time, "gamma": self.gamma,
                   "engine": engine, "record": record}
        if configured() is not None:  # the leader's pools (parties.threads), what its time was measured on
            summary["compute_threads"] = configured()
        warning = self._worse_than_start(record, outcome)
        if warning is not None:
            print(warning, flush=True)
            summary["warning"] = warning
        (self.out / "result.json").write_text(json.dumps(summary) + "\n")

    def _worse_than_start(self, record: dict, outcome: Outcome) -> str | None:
        """The warning line when training ended above the loss of w = 0 (a diverged run has its own)."""
        problem, y = self.party.problem, self.party.y
        if outcome is Outcome.DIVERGED or problem is None or y is None or self.party.network is not None:
            return None
        start = float(np.mean(problem.loss.value(np.zeros_like(y), y)))  # every regularizer is 0 at w = 0
        if record["loss"] <= start:
            return None
        return worse_than_start_warning(record["loss"], start, self.gamma)

    def _data_name(self) -> str:
        """What the run trained on, as results show it: the dataset's name (``news20-standin`` for a
        stand-in), from the split's manifest when there is one, else the party-files folder."""
        c = self.config
        if c.party_files is None or Path(c.party_files) == self.out / "parties":
            return c.dataset
        from vertical.datasets.party_files import read_manifest
        from vertical.datasets.validation import DataValidationError

        try:
            return f"{read_manifest(c.party_files).dataset} ({c.party_files})"
        except DataValidationError:
            return str(c.party_files)

    # ---------------------------------------------------------------------------------- collectives

    def _evaluate(self) -> dict | None:
        """f(w), f(w) − f*, test accuracy / RMSE at the leader; not counted as training time."""
        if self.party.network is not None:
            return self._log(self._evaluate_network())
        z = self.rt.full_scores(root=LEADER)
        reg = self.rt.regularizer_sum(root=LEADER)
        has_test = self.rt.broadcast_word(int(self.party.test_block is not None), root=LEADER)
        z_test = self.rt.full_scores(test=True, root=LEADER) if has_test else None
        if self.rank != LEADER:
            return None
        problem = self.party.problem
        assert problem is not None and z is not None and reg is not None
        loss = float(np.mean(problem.loss.value(z, self.party.y)) + reg)
        record: dict = {"epoch": round(self.epochs, 6), "time": round(self.train_time, 6),
                        "updates": self.updates, "loss": loss}
        if self.config.gamma_decay:
            record["gamma"] = self.step  # the step of the epoch just finished
        if self.config.f_star is not None:
            record["suboptimality"] = loss - self.config.f_star
        if z_test is not None:
            key = "test_accuracy" if problem.task == "binary" else "test_rmse"
            record[key] = _score(problem.task, z_test, self.party.y_test)
        return self._log(record)

    def _evaluate_network(self) -> dict | None:
        """``--model mlp``: the training loss (mean log loss) and test accuracy of the top on the summed
        embeddings, at the leader (parties/party_model.py)."""
        z = self.rt.full_embeddings(root=LEADER)
        has_test = self.rt.broadcast_word(int(self.party.test_block is not None), root=LEADER)
        z_test = self.rt.full_embeddings(test=True, root=LEADER) if has_test else None
        if self.rank != LEADER:
            return None
        top, classes = self.party.top, self.party.classes
        assert z is not None and top is not None and classes is not None
        loss = top.loss(z, classes)  # the objective the top trains (corrected under label_flip)
        record: dict = {"epoch": round(self.epochs, 6), "time": round(self.train_time, 6),
                        "updates": self.updates, "loss": loss}
        if self.config.gamma_decay:
            record["gamma"] = self.step  # Adam's step in the epoch just finished
        if z_test is not None:
            from parties.party_model import as_classes

            predicted = np.argmax(top.predict_proba(z_test), axis=1)
            record["test_accuracy"] = float(np.mean(predicted == as_classes(self.party.y_test)))
        return record

    def _log(self, record: dict | None) -> dict | None:
        """The leader writes an evaluation to the metrics log and the progress bar."""
        if record is None:
            return None
        assert self.log is not None
        self.log.write(json.dumps(record) + "\n")
        self.log.flush()
        if self.bar is not None:
            self.bar.n = self.epochs
            self.bar.set_postfix({k: f"{v:.3g}" for k, v in record.items() if k in
                                  ("loss", "suboptimality", "test_accuracy", "test_rmse")})
        return record


def _score(task: str, z: np.ndarray, y: np.ndarray) -> float:
    from vertical.metrics import accuracy, rmse

    if task == "binary":
        return accuracy(y, np.where(z >= 0, 1.0, -1.0))
    return rmse(y, z)
