"""What every rank builds the same way before round 0 (:class:`_Job`), including the control-variate
initialisations that need gradients: each process computes them for the clients it hosts and one
``Allreduce`` sums them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from horizontal import Algorithm, InitContext
from horizontal.engine import Streams
from horizontal.models import BatchedModel
from parties.hfl.client_files import Shard
from parties.hfl.config import HflConfig
from parties.hfl.round_context import StackBatches


@dataclass
class _Job:
    """What every rank builds the same way before round 0."""

    comm: Any
    config: HflConfig
    model: BatchedModel
    algorithm: Algorithm[Any, Any]
    streams: Streams
    shard: Shard | None   # None at the server

    @property
    def d(self) -> int:
        return self.model.dim

    def init_context(self, x0: torch.Tensor) -> InitContext:
        return InitContext(x0, self.config.clients, self._full_gradients, self._minibatch_gradients)

    def _full_gradients(self, x: torch.Tensor) -> torch.Tensor:
        """∇f_i(x) on each client's rows, computed where the rows are, summed into ``[N, d]``."""
        out = torch.zeros((self.config.clients, self.d), dtype=x.dtype)
        if self.shard is not None:
            for k, i in enumerate(self.shard.client_ids.tolist()):
                X, y = self.shard.data.client(k)
                out[i] = self.model.loss_and_grad(x.unsqueeze(0), X.unsqueeze(0), y.unsqueeze(0))[1][0]
        return self._sum_over_ranks(out)

    def _minibatch_gradients(self, x: torch.Tensor) -> torch.Tensor:
        """The engine's ``minibatch_local_gradients``: chunks of S clients in id order, one stack draw
        each from the data stream (every process draws, so the replicas stay in step)."""
        n, chunk = self.config.clients, self.config.per_round
        out = torch.zeros((n, self.d), dtype=x.dtype)
        if self.shard is not None:
            hosted = self.shard.client_ids
            for start in range(0, n, chunk):
                stack = torch.arange(start, min(start + chunk, n))
                positions = torch.isin(stack, hosted).nonzero().flatten()
                local = torch.searchsorted(hosted, stack[positions])
                batches = StackBatches(self.shard.data, positions, stack.numel())
                X, y = batches.sample_batches(local, self.config.batch_size, self.streams.data)
                if positions.numel():
                    grads = self.model.loss_and_grad(x.expand(positions.numel(), -1).contiguous(), X, y)[1]
                    out[stack[positions]] = grads
        return self._sum_over_ranks(out)

    def _sum_over_ranks(self, out: torch.Tensor) -> torch.Tensor:
        from mpi4py import MPI

        self.comm.Allreduce(MPI.IN_PLACE, out.numpy(), op=MPI.SUM)
        return out
