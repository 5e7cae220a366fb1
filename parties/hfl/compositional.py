"""FedDRO under MPI (``--algorithm feddro``): the compositional round, which exchanges at every local step,
run by a server rank and client processes with :class:`horizontal.feddro.CompositionalSimulation`'s
trajectory.

Every client takes part in every iteration. A client process runs the simulation's own ``step`` on the
stack of the clients it hosts; the simulation's two exchange points become MPI messages:

    inner estimates  (y_sync "step" every iteration, "round" at a model round's first, "never" not at all)
        client process → server: INNER, its clients' y_k rows (float64); server → all: AVERAGE, ȳ
    models           (every I iterations)
        client process → server: MODEL, its clients' x_k rows; server → all: AVERAGE, x̄

Both sides know the schedule from the configuration (:meth:`FedDRO.shares_inner`,
:meth:`FedDRO.averages_models`), so no control message is sent; every message is raw floats of a length
the receiver knows, checked for that length and for finiteness before use. Minibatches: the simulation
draws one ``[K, B]`` matrix per sample for all clients from one stream; every process keeps a replica,
draws the whole matrix and uses its clients' rows. Evaluation (every ``--eval-every`` model rounds and
after the last): each process sends its clients' loss sums, correct counts and the objective's
per-client summaries (:meth:`LossComposition.client_summary`); the server combines them into Φ and tests
x̄ on its own test set. The learning rate is constant (``--lr-local``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from horizontal.dro_objectives import FLOAT, LossComposition
from horizontal.feddro import CompositionalSimulation, FedDRO, FederatedDRO
from horizontal.models import TorchModel
from parties.hfl.client_files import Shard
from parties.hfl.config import HflConfig
from parties.hfl.round_context import StackBatches
from parties.hfl.wire import SERVER, Kind, WireError, body_limit, recv_frame, send_frame

# --------------------------------------------------------------------------------------- messages


def _rows_body(rows: torch.Tensor) -> np.ndarray:
    return rows.detach().contiguous().numpy().reshape(-1).view(np.uint8)


def _read_rows(body: np.ndarray, rows: int, width: int, dtype: torch.dtype, what: str) -> torch.Tensor:
    """``rows × width`` floats of ``dtype`` from a body whose length must match exactly; all finite."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if body.nbytes != rows * width * itemsize:
        raise WireError(f"{what}: {body.nbytes} bytes where {rows} x {width} {dtype} take "
                        f"{rows * width * itemsize}")
    numpy_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    values = torch.from_numpy(body.view(numpy_dtype).copy()).reshape(rows, width)
    if not bool(torch.isfinite(values).all()):
        raise WireError(f"{what}: non-finite entries")
    return values


# ------------------------------------------------------------------------------------------ client


class _HostedProblem(FederatedDRO):
    """The hosted clients' part of the federated DRO problem: minibatches from this process's replica of
    the shared stream (one ``[K, B]`` draw, its clients' rows)."""

    def __init__(self, model: TorchModel, objective: LossComposition, shard: Shard, n_clients: int,
                 batch_size: int) -> None:
        super().__init__(model, objective, shard.data, batch_size)
        self._stack = StackBatches(shard.data, shard.client_ids, n_clients)

    def sample(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return self._stack.sample_batches(self._clients, self.batch_size, generator)


class _ProcessSimulation(CompositionalSimulation):
    """The simulation's iterations on this process's clients; its exchanges go through the server."""

    def __init__(self, comm: Any, algorithm: FedDRO, problem: _HostedProblem, lr: float, seed: int,
                 x0: torch.Tensor) -> None:
        self.comm = comm
        super().__init__(algorithm, problem, lr, seed=seed, x0=x0)

    def _all_reduce_inner(self, local: torch.Tensor) -> torch.Tensor:
        """This process's share of the exchange (its rows up, the mean down); its ledger counts its own."""
        sent = send_frame(self.comm, SERVER, Kind.INNER, None, _rows_body(local.to(FLOAT)))
        frame = recv_frame(self.comm, SERVER, Kind.AVERAGE, max_body=body_limit(self.problem.d_g, 1))
        self.ledger.inner_uplink_bits += 8 * sent
        self.ledger.inner_downlink_bits += local.shape[0] * 8 * frame.body.nbytes
        self.ledger.inner_exchanges += 1
        return _read_rows(frame.body, 1, self.problem.d_g, FLOAT, "the server's mean inner estimate")[0]

    def _average_models(self, X: torch.Tensor) -> torch.Tensor:
        sent = send_frame(self.comm, SERVER, Kind.MODEL, None, _rows_body(X))
        frame = recv_frame(self.comm, SERVER, Kind.AVERAGE, max_body=body_limit(self.problem.dim, 1))
        self.ledger.model_uplink_bits += 8 * sent
        self.ledger.model_downlink_bits += X.shape[0] * 8 * frame.body.nbytes
        self.ledger.model_rounds += 1
        mean = _read_rows(frame.body, 1, self.problem.dim, X.dtype, "the server's mean model")[0]
        return mean.expand(X.shape[0], -1).clone()


def serve_client(comm: Any, config: HflConfig, algorithm: FedDRO, model: TorchModel,
                 objective: LossComposition, shard: Shard, x0: torch.Tensor) -> None:
    """A client process: every iteration of the job on its clients, then done (the schedule is known)."""
    problem = _HostedProblem(model, objective, shard, config.clients, config.batch_size)
    sim = _ProcessSimulation(comm, algorithm, problem, config.lr_local, config.seed, x0)
    for _ in range(config.iterations):
        sim.step()
        model_round = sim.iteration // algorithm.period
        if algorithm.averages_models(sim.iteration - 1) and _evaluates(model_round, config):
            send_frame(comm, SERVER, Kind.EVAL_RESULT, _evaluation(problem, sim.state.x[0]))


def _evaluates(model_round: int, config: HflConfig) -> bool:
    return model_round % config.eval_every == 0 or model_round == config.rounds


def _evaluation(problem: FederatedDRO, x: torch.Tensor) -> dict[str, Any]:
    """Loss sum, correct predictions and the objective's per-client summaries on this process's rows."""
    data = problem.data
    losses, predictions = problem.model.losses_and_predictions(x, data.X, data.y)
    per_client = torch.split(losses, data.sizes.tolist())
    return {"rows": int(data.X.shape[0]), "loss_sum": float(losses.to(FLOAT).sum()),
            "correct": int((predictions == data.y).sum()),
            "summaries": [problem.objective.client_summary(ell).tolist() for ell in per_client]}


# ------------------------------------------------------------------------------------------ server


class CompositionalServer:
    """Rank 0: averages what the client processes send at the schedule's exchange points, keeps the
    ledger of real bytes, and evaluates x̄ (the objective from the processes' summaries, the test set
    itself)."""

    def __init__(self, comm: Any, config: HflConfig, algorithm: FedDRO, model: TorchModel,
                 objective: LossComposition, hosts: list[list[int]], x0: torch.Tensor,
                 test: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.comm = comm
        self.config = config
        self.algorithm = algorithm
        self.model = model
        self.objective = objective
        self.hosts = hosts                      # hosts[p]: the clients of rank p + 1, increasing
        self.test = test
        self.x = x0.clone()
        self.iteration = 0
        self.model_rounds = 0
        self.inner_uplink_bits = self.inner_downlink_bits = 0
        self.model_uplink_bits = self.model_downlink_bits = 0
        self.ybar = float("nan")
        if algorithm.shares_initial_inner():
            self._average(Kind.INNER, objective.d_g, FLOAT)

    @property
    def uplink_bits(self) -> int:
        return self.inner_uplink_bits + self.model_uplink_bits

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"x": self.x}

    def _average(self, kind: Kind, width: int, dtype: torch.dtype) -> torch.Tensor:
        """Receive every process's rows of one exchange, average them in client order, send the mean back."""
        stacked = torch.empty((self.config.clients, width), dtype=dtype)
        received = 0
        for p, hosted in enumerate(self.hosts):
            frame = recv_frame(self.comm, p + 1, kind, max_body=body_limit(width, len(hosted)))
            stacked[hosted] = _read_rows(frame.body, len(hosted), width, dtype,
                                         f"client process rank {p + 1}'s {kind.name.lower()} rows")
            received += frame.body.nbytes
        mean = stacked.mean(0)
        body = _rows_body(mean)
        for p in range(len(self.hosts)):
            send_frame(self.comm, p + 1, Kind.AVERAGE, None, body)
        downlink = self.config.clients * 8 * body.nbytes
        if kind == Kind.INNER:
            self.inner_uplink_bits += 8 * received
            self.inner_downlink_bits += downlink
            self.ybar = float(mean[0])
        else:
            self.model_uplink_bits += 8 * received
            self.model_downlink_bits += downlink
        return mean

    def step(self) -> dict[str, float]:
        """One model round: I iterations, with the exchanges the schedule puts in them."""
        started = time.perf_counter()
        alg, dtype = self.algorithm, self.config.torch_dtype
        while True:
            t = self.iteration
            if alg.shares_inner(t):
                self._average(Kind.INNER, self.objective.d_g, FLOAT)
            self.iteration += 1
            if alg.averages_models(t):
                self.x = self._average(Kind.MODEL, self.model.dim, dtype)
                break
        self.model_rounds += 1
        return {"round": self.model_rounds, "iteration": self.iteration, "lr": self.config.lr_local,
                "ybar": self.ybar, "inner_uplink_bits": self.inner_uplink_bits,
                "model_uplink_bits": self.model_uplink_bits, "uplink_bits": self.uplink_bits,
                "downlink_bits": self.inner_downlink_bits + self.model_downlink_bits,
                "round_seconds": time.perf_counter() - started}

    def evaluate(self) -> dict[str, float]:
        rows, loss_sum, correct, summaries = 0, 0.0, 0, torch.empty((self.config.clients, 0), dtype=FLOAT)
        for p, hosted in enumerate(self.hosts):
            meta = recv_frame(self.comm, p + 1, Kind.EVAL_RESULT, max_body=0).meta
            try:
                part = torch.tensor(meta["summaries"], dtype=FLOAT)
                if part.dim() != 2 or part.shape[0] != len(hosted) or not bool(torch.isfinite(part).all()):
                    raise ValueError("one finite summary row per hosted client")
                if summaries.shape[1] == 0:
                    summaries = torch.empty((self.config.clients, part.shape[1]), dtype=FLOAT)
                summaries[hosted] = part
                rows += int(meta["rows"])
                loss_sum += float(meta["loss_sum"])
                correct += int(meta["correct"])
            except (KeyError, TypeError, ValueError, RuntimeError) as err:
                raise WireError(f"client process rank {p + 1} sent an invalid evaluation: {err}") from None
        out = {"train_loss": loss_sum / rows, "train_accuracy": correct / rows,
               "train_objective": self.objective.value_from_summaries(summaries)}
        if self.test is not None:
            losses, predictions = self.model.losses_and_predictions(self.x, *self.test)
            out |= {"test_loss": float(losses.to(FLOAT).mean()),
                    "test_accuracy": float((predictions == self.test[1]).to(FLOAT).mean())}
        return out

    def stop(self) -> None:
        """Nothing to send: the client processes stop after the configured number of iterations."""
