"""Simulation engine for horizontal FL: N clients in one process, vectorised across the sampled clients.

One round is :meth:`horizontal.server.VectorServer.step` (the server's half, which the MPI server rank runs
too): sample S of N clients uniformly without replacement; ``algorithm.broadcast`` → the clients' half,
here :class:`_LocalClients`: gather the sampled clients' persistent state rows, ``client_update`` (local
training of all S clients as stacked ``[S, d]`` tensors, one batched model call per local step) →
``server_update`` → optional reply → write the clients' rows back. Non-sampled clients' rows are never
touched.

Randomness: one ``numpy.random.SeedSequence(seed)`` spawns independent streams for the initial model,
client sampling, minibatches and compression; the compression stream spawns one ``torch.Generator`` per
client, so each client's compressor draws are independent of the others' (SCALLION's Theorem 1 needs
mutually independent compressors) and of which other clients are sampled. The same seed gives the same
trajectory, and two algorithms run with the same seed see the same initial model, the same client samples
and (when they draw as many minibatches) the same minibatches.

Memory: each persistent per-client vector is an ``[N, d]`` store; for N = 200 and the 784-256-128-10 MLP
(d = 235,146) that is 188 MB in float32 per vector (SCAFFOLD: c_i; SCAFCOM: c_i and v_i, 376 MB).

Metrics per round: the mean minibatch loss seen by the sampled clients during local training
(``local_loss``, free), cumulative uplink and downlink bits (uplink from the messages' real payload
sizes; downlink at full precision, 32 bits per entry in float32), cumulative per-client minibatch
gradient evaluations (ISCA/ISCAM take K + 1 per round, the others K), wall time; every ``eval_every``
rounds also loss/accuracy of the global model on the full training set and on the test set.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np
import torch
from tqdm.auto import tqdm

from horizontal.base import (
    Algorithm,
    Compressor,
    Downlink,
    FLConfig,
    InitContext,
    LocalResult,
    Message,
    Solver,
    VectorState,
)
from horizontal.data import FederatedData
from horizontal.models import BatchedModel
from horizontal.rounds import check_finite
from horizontal.server import ClientReport, VectorServer

METRIC_COLUMNS = ("round", "local_loss", "uplink_bits", "downlink_bits", "round_seconds",
                  "train_loss", "train_accuracy", "test_loss", "test_accuracy", "gradient_evaluations")


class MinibatchSource(Protocol):
    """Where a :class:`LocalSolver` draws minibatches: :class:`~horizontal.data.FederatedData` for the whole
    stack, or an MPI client process's view of the same shared stream for the clients it hosts."""

    def sample_batches(self, clients: torch.Tensor, batch_size: int | None, generator: torch.Generator
                       ) -> tuple[torch.Tensor, torch.Tensor]: ...


class LocalSolver:
    """Local SGD of the S sampled clients as one batched computation per step.

    Step k: ``y ← y − η_l·(g(y; ξ^k) + correction)`` with a fresh minibatch ξ^k per client; the
    correction (−c_i + c for SCAFFOLD, −δ_j for FedCOMGATE, none for FedAvg) is constant in the round.
    """

    def __init__(self, model: BatchedModel, data: MinibatchSource, clients: torch.Tensor,
                 batch_size: int | None, config: FLConfig, generator: torch.Generator) -> None:
        self.model = model
        self.data = data
        self.clients = clients
        self.batch_size = batch_size
        self.config = config
        self.generator = generator
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self.gradient_evaluations = 0   # per-client minibatch gradients computed so far (S per call)

    def gradient(self, Y: torch.Tensor) -> torch.Tensor:
        """Minibatch gradient ``[S, d]`` at the rows of ``Y``, on a fresh minibatch per client."""
        X, y = self.data.sample_batches(self.clients, self.batch_size, self.generator)
        loss, G = self.model.loss_and_grad(Y, X, y)
        self.gradient_evaluations += self.clients.numel()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._loss_count += 1
        return G

    def run(self, x: torch.Tensor, correction: torch.Tensor | None = None) -> LocalResult:
        """K = ``config.local_steps`` steps from the shared start ``x [d]`` (or per-client ``[S, d]``)."""
        lr, steps = self.config.lr_local, self.config.local_steps
        Y = x.expand(self.clients.numel(), -1).clone()
        shift = None if correction is None else lr * correction
        grad_sum: torch.Tensor | None = None
        for _ in range(steps):
            G = self.gradient(Y)
            grad_sum = G if grad_sum is None else grad_sum.add_(G)  # G is fresh each call
            Y.add_(G, alpha=-lr)
            if shift is not None:
                Y.sub_(shift)
        assert grad_sum is not None  # steps >= 1 (FLConfig)
        return LocalResult(Y, grad_sum.div_(steps))

    @property
    def mean_loss(self) -> float:
        """Mean minibatch loss over every gradient evaluated so far this round (NaN if none)."""
        return math.nan if self._loss_sum is None else float(self._loss_sum.mean()) / self._loss_count


@dataclass
class ClientRound:
    """The :class:`horizontal.base.RoundContext` handed to ``client_update``, by the engine for the whole
    stack and by an MPI client process for the sampled clients it hosts."""

    round: int
    clients: torch.Tensor
    config: FLConfig
    solver: Solver
    generators: list[torch.Generator]

    def compress(self, compressor: Compressor, X: torch.Tensor) -> Message:
        # diverged mid-round: the same signal as the server's check, numbered as the round's record
        check_finite({"uplink": X}, owner="a sampled client", what="message", round=self.round + 1,
                     advice=f"lower lr_local={self.config.lr_local} or lr_global={self.config.lr_global}")
        return Message.compressed(compressor, X, self.generators)


@dataclass
class Streams:
    """Independent random streams derived from one seed (see the module docstring)."""

    init: torch.Generator
    sampling: torch.Generator
    data: torch.Generator
    compression: list[torch.Generator] = field(repr=False)

    @classmethod
    def from_seed(cls, seed: int, n_clients: int) -> Streams:
        init, sampling, data, compression = np.random.SeedSequence(seed).spawn(4)

        def generator(seq: np.random.SeedSequence) -> torch.Generator:
            return torch.Generator().manual_seed(int(seq.generate_state(1, np.uint64)[0] >> np.uint64(1)))

        return cls(generator(init), generator(sampling), generator(data),
                   [generator(s) for s in compression.spawn(n_clients)])


class FederatedSimulation:
    """Run a horizontal-FL ``algorithm`` on ``data`` (one ``FederatedData`` row block per client).

    ``test`` (features, labels) is evaluated every ``eval_every`` rounds of :meth:`run`, as is the
    training set (``train_eval`` overrides which rows; default: all training rows).
    """

    def __init__(self, algorithm: Algorithm[Any, Any], model: BatchedModel, data: FederatedData,
                 config: FLConfig, *, batch_size: int | None = 32, seed: int = 0,
                 test: tuple[torch.Tensor, torch.Tensor] | None = None,
                 train_eval: tuple[torch.Tensor, torch.Tensor] | None = None,
                 x0: torch.Tensor | None = None) -> None:
        if data.n_clients != config.n_clients:
            raise ValueError(f"config.n_clients={config.n_clients} but the data has {data.n_clients} clients")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None (full local batch), got {batch_size}")
        model.check_data(data.X, data.y, "training data")
        if test is not None:
            model.check_data(test[0], test[1], "test data")
        self.algorithm = algorithm
        self.model = model
        self.data = data
        self.config = config
        self.batch_size = batch_size
        self.test = test
        self.train_eval = train_eval if train_eval is not None else (data.X, data.y)
        self.streams = Streams.from_seed(seed, config.n_clients)
        dtype = data.X.dtype
        if x0 is None:
            x0 = model.init(self.streams.init, dtype)
        elif x0.shape != (model.dim,):
            raise ValueError(f"x0 must have shape ({model.dim},), got {tuple(x0.shape)}")
        x0 = x0.to(dtype=dtype, device=data.X.device).clone()
        server, self.clients = algorithm.init(
            InitContext(x0, config.n_clients, self.full_local_gradients, self.minibatch_local_gradients))
        self.device = x0.device
        self.core = VectorServer(algorithm, server, config, self.streams.sampling)
        self.last_clients = torch.empty(0, dtype=torch.int64)   # who took part in the latest round
        self._local_clients = _LocalClients(self)

    def full_local_gradients(self, x: torch.Tensor) -> torch.Tensor:
        """∇f_i(x) on each client's whole local data set, ``[N, d]`` (control-variate initialisation)."""
        out = torch.empty((self.config.n_clients, x.numel()), dtype=x.dtype, device=x.device)
        for i in range(self.config.n_clients):
            X, y = self.data.client(i)
            out[i] = self.model.loss_and_grad(x.unsqueeze(0), X.unsqueeze(0), y.unsqueeze(0))[1][0]
        return out

    def minibatch_local_gradients(self, x: torch.Tensor) -> torch.Tensor:
        """One fresh-minibatch gradient per client at ``x``, ``[N, d]`` (from the minibatch stream),
        computed S clients at a time to bound memory."""
        n, chunk = self.config.n_clients, self.config.clients_per_round
        out = torch.empty((n, x.numel()), dtype=x.dtype, device=x.device)
        for start in range(0, n, chunk):
            clients = torch.arange(start, min(start + chunk, n))
            X, y = self.data.sample_batches(clients, self.batch_size, self.streams.data)
            out[start:start + clients.numel()] = self.model.loss_and_grad(
                x.expand(clients.numel(), -1).contiguous(), X, y)[1]
        return out

    def sample_clients(self) -> torch.Tensor:
        """S distinct clients, uniformly without replacement, in increasing id order."""
        return self.core.sample_clients()

    def step(self) -> dict[str, float]:
        """Run one round (:meth:`horizontal.server.VectorServer.step` with every client in this process);
        return its metrics (without evaluation)."""
        return self.core.step(self._local_clients)

    def evaluate(self) -> dict[str, float]:
        """Loss (and accuracy) of the global model on the training rows and the test set."""
        x = self.server.x
        out = {f"train_{k}": v for k, v in self.model.evaluate(x, *self.train_eval).items()}
        if self.test is not None:
            out |= {f"test_{k}": v for k, v in self.model.evaluate(x, *self.test).items()}
        return out

    def run(self, rounds: int, *, eval_every: int = 1, log: MetricsLog | None = None,
            progress: bool = True) -> list[dict[str, float]]:
        """Run ``rounds`` rounds, evaluating every ``eval_every`` rounds and after the last one."""
        if rounds < 1 or eval_every < 1:
            raise ValueError(f"rounds and eval_every must be >= 1, got {rounds} and {eval_every}")
        records = []
        bar = tqdm(range(rounds), desc=self.algorithm.name, disable=not progress, leave=False)
        for t in bar:
            record = self.step()
            if (t + 1) % eval_every == 0 or t + 1 == rounds:
                record |= self.evaluate()
                bar.set_postfix({k: f"{v:.4g}" for k, v in record.items()
                                 if k in ("train_loss", "test_accuracy")})
            records.append(record)
            if log is not None:
                log.write(record)
        return records

    @property
    def server(self) -> VectorState:
        """The algorithm's server state (x, and c, ... for the algorithms that keep more)."""
        return self.core.state

    @server.setter
    def server(self, state: VectorState) -> None:
        """Replace the server state (a test replaying one round from a saved state)."""
        self.core.state = state

    @property
    def round(self) -> int:
        return self.core.round

    @property
    def uplink_bits(self) -> int:
        return self.core.uplink_bits

    @property
    def downlink_bits(self) -> int:
        return self.core.downlink_bits

    @property
    def gradient_evaluations(self) -> int:
        """Per-client minibatch gradients in rounds (the init pass excluded)."""
        return self.core.gradient_evaluations


class _LocalClients:
    """The simulation's :class:`~horizontal.server.RoundClients`: the whole stack of sampled clients trained
    as one batched computation in this process, their state rows gathered before and written back after
    (the other clients' rows are never touched)."""

    def __init__(self, sim: FederatedSimulation) -> None:
        self.sim = sim
        self._pending: tuple[torch.Tensor, VectorState] | None = None

    def train(self, round: int, clients: torch.Tensor, down: Downlink) -> ClientReport:
        sim = self.sim
        streams = sim.streams
        states = sim.clients.rows(clients.to(sim.device))
        solver = LocalSolver(sim.model, sim.data, clients, sim.batch_size, sim.config, streams.data)
        generators = [streams.compression[i] for i in clients.tolist()]
        ctx = ClientRound(round, clients, sim.config, solver, generators)
        up, states = sim.algorithm.client_update(down, states, ctx)
        self._pending = clients, states
        return ClientReport(up, sum(sum(message.bits) for message in up.values()), solver.mean_loss,
                            solver.gradient_evaluations)

    def finish(self, reply: Downlink) -> None:
        assert self._pending is not None, "finish() without train()"
        (clients, states), self._pending = self._pending, None
        sim = self.sim
        if reply:
            states = sim.algorithm.client_finish(reply, states, sim.config)
        sim.clients.put_rows(clients.to(sim.device), states)
        sim.last_clients = clients


class MetricsLog:
    """Per-round metrics to JSONL (one object per line) and/or CSV (fixed columns, blanks when a metric
    was not evaluated that round). Use as a context manager."""

    def __init__(self, jsonl: Path | str | None = None, csv_path: Path | str | None = None,
                 extra: dict[str, object] | None = None) -> None:
        self.extra = dict(extra or {})
        self._files: list[IO[str]] = []
        self._jsonl = self._open(jsonl)
        csv_file = self._open(csv_path)
        self._csv = None
        if csv_file is not None:
            self._csv = csv.DictWriter(csv_file, fieldnames=[*self.extra, *METRIC_COLUMNS],
                                       extrasaction="ignore")
            self._csv.writeheader()

    def _open(self, path: Path | str | None) -> IO[str] | None:
        if path is None:
            return None
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "w", encoding="utf-8", newline="")  # noqa: SIM115 (closed in close())
        self._files.append(handle)
        return handle

    def write(self, record: dict[str, float]) -> None:
        row = {**self.extra, **record}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(row) + "\n")
        if self._csv is not None:
            self._csv.writerow(row)

    def close(self) -> None:
        for handle in self._files:
            handle.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
