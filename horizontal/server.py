"""The server's half of a flat-vector round (:class:`VectorServer`), run by the simulation
(:class:`horizontal.engine.FederatedSimulation`) and by the MPI server rank (:mod:`parties.hfl.server`) alike,
so that the two follow the same trajectory and write the same records by construction.

One round: sample S clients from the sampling stream; ``algorithm.broadcast`` → the sampled clients train
(:meth:`RoundClients.train`: in this process for the simulation, on the client processes under MPI) →
``server_update`` → the reply, possibly empty, goes back (:meth:`RoundClients.finish`) → the divergence
check. Where the clients run is all a :class:`RoundClients` decides: the server step itself has no
transport in it, and the MPI side only moves buffers.

Bits: downlink at full precision to every sampled client (the broadcast, and the reply when there is
one); uplink as the clients' side measures it (the messages' payload sizes in the simulation, the bytes
that crossed MPI there, which are the same number).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from horizontal.base import Algorithm, Downlink, FLConfig, Uplink, VectorState, wire_bits
from horizontal.rounds import check_finite, sample_clients

ServerT = TypeVar("ServerT", bound=VectorState)


@dataclass
class ClientReport:
    """What the round's sampled clients hand back to the server: their uplink messages (rows in the
    order of the sampled ids), the bits those took, the mean minibatch loss seen in local training and
    the per-client minibatch gradients computed (S per local gradient step)."""

    uplink: Uplink
    uplink_bits: int
    local_loss: float
    gradient_evaluations: int


class RoundClients(Protocol):
    """Where the sampled clients of a round run."""

    def train(self, round: int, clients: torch.Tensor, down: Downlink) -> ClientReport:
        """Run ``client_update`` of the sampled ``clients`` (increasing ids) from the broadcast ``down``."""
        ...

    def finish(self, reply: Downlink) -> None:
        """Hand the participants the server's reply (empty for most algorithms) and end their round."""
        ...


class VectorServer(Generic[ServerT]):
    """The server state of a flat-vector algorithm and its cumulative ledger (rounds, bits, gradients)."""

    def __init__(self, algorithm: Algorithm[ServerT, Any], state: ServerT, config: FLConfig,
                 sampling: torch.Generator) -> None:
        self.algorithm = algorithm
        self.state = state
        self.config = config
        self.sampling = sampling
        self.round = 0
        self.uplink_bits = 0
        self.downlink_bits = 0
        self.gradient_evaluations = 0   # per-client minibatch gradients in rounds (init pass excluded)

    def sample_clients(self) -> torch.Tensor:
        """This round's S clients, drawn from the sampling stream."""
        return sample_clients(self.config.n_clients, self.config.clients_per_round, self.sampling)

    def step(self, clients_side: RoundClients) -> dict[str, float]:
        """Run one round with the clients on ``clients_side``; return its metrics (without evaluation)."""
        started = time.perf_counter()
        clients = self.sample_clients()
        n_sampled = clients.numel()
        down = self.algorithm.broadcast(self.state)
        self.downlink_bits += n_sampled * _full_precision_bits(down)
        report = clients_side.train(self.round, clients, down)
        self.uplink_bits += report.uplink_bits
        self.gradient_evaluations += report.gradient_evaluations
        self.state, reply = self.algorithm.server_update(self.state, report.uplink, self.config)
        if reply:
            self.downlink_bits += n_sampled * _full_precision_bits(reply)
        clients_side.finish(reply)
        self.round += 1
        cfg = self.config
        check_finite(self.state.tensors(), owner=self.algorithm.name, what="server state", round=self.round,
                     advice=f"lower lr_local={cfg.lr_local} or lr_global={cfg.lr_global}")
        return {"round": self.round, "local_loss": report.local_loss, "uplink_bits": self.uplink_bits,
                "downlink_bits": self.downlink_bits, "round_seconds": time.perf_counter() - started,
                "gradient_evaluations": self.gradient_evaluations}


def _full_precision_bits(vectors: Downlink) -> int:
    return sum(wire_bits(v) for v in vectors.values())
