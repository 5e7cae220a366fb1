"""A client process's view of the shared minibatch stream (:class:`StackBatches`): the engine draws one
``[S, B]`` uniform matrix per local gradient for the whole stack of sampled clients; every client process
keeps a replica of that stream and draws the same matrices, using the rows of the clients it hosts."""

from __future__ import annotations

import torch

from horizontal import FederatedData


class StackBatches:
    """Minibatches of the sampled clients a process hosts (a :class:`horizontal.engine.MinibatchSource`),
    drawn from its replica of the shared data stream exactly as the engine draws them for the whole stack
    (row j of each matrix for the stack's j-th client)."""

    def __init__(self, data: FederatedData, positions: torch.Tensor, stack_size: int) -> None:
        self.data = data
        self.positions = positions
        self.stack_size = stack_size
        self.draws = 0

    def sample_batches(self, clients: torch.Tensor, batch_size: int | None, generator: torch.Generator
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        assert batch_size is not None, "the MPI runtime always draws minibatches"
        self.draws += 1
        u = draw_stack_uniforms(self.stack_size, batch_size, generator)[self.positions]
        sizes = self.data.sizes[clients].unsqueeze(1)
        rows = self.data.offsets[clients].unsqueeze(1) + (u * sizes).long().minimum(sizes - 1)
        return self.data.X[rows], self.data.y[rows]


def draw_stack_uniforms(stack_size: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """The engine's draw for one gradient of a stack (``FederatedData.sample_batches``)."""
    return torch.rand((stack_size, batch_size), generator=generator, dtype=torch.float64)
