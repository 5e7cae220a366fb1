"""The client-contiguous data layout the horizontal-FL engines sample from (the partitions that decide
which rows a client owns are in :mod:`horizontal.partitions`).

:class:`FederatedData` stores the rows client-contiguously (client i owns rows ``offsets[i]:offsets[i+1]``)
so that the minibatches of all sampled clients are one gather. Minibatches are drawn i.i.d. uniformly
**with replacement** from the client's rows (the papers leave this unspecified; this matches the theory's
ξ ~ D_i i.i.d.). ``batch_size=None`` means the client's whole data set (deterministic gradients, σ = 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class FederatedData:
    """Training rows grouped by client: client i owns ``X[offsets[i]:offsets[i+1]]``."""

    X: torch.Tensor
    y: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def from_partition(cls, X: torch.Tensor | np.ndarray, y: torch.Tensor | np.ndarray,
                       parts: Sequence[np.ndarray], dtype: torch.dtype = torch.float32) -> FederatedData:
        """Regroup ``(X, y)`` client by client; features are cast to ``dtype``, float labels too."""
        X_t, y_t = torch.as_tensor(X), torch.as_tensor(y)
        if X_t.shape[0] != y_t.shape[0]:
            raise ValueError(f"X has {X_t.shape[0]} rows but y has {y_t.shape[0]}")
        if not parts:
            raise ValueError("a partition needs at least one client")
        sizes = [len(p) for p in parts]
        if min(sizes) == 0:
            raise ValueError(f"client {sizes.index(0)} holds no rows")
        order = torch.as_tensor(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))
        if int(order.min()) < 0 or int(order.max()) >= X_t.shape[0]:
            raise ValueError("partition indices out of range of the data")
        offsets = torch.zeros(len(parts) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(torch.as_tensor(sizes), 0)
        y_sorted = y_t[order]
        if y_sorted.is_floating_point():
            y_sorted = y_sorted.to(dtype)
        return cls(X_t[order].to(dtype).contiguous(), y_sorted.contiguous(), offsets)

    @property
    def n_clients(self) -> int:
        return self.offsets.numel() - 1

    @property
    def sizes(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def client(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.X[lo:hi], self.y[lo:hi]

    def sample_batches(self, clients: torch.Tensor, batch_size: int | None,
                       generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """One minibatch per client in ``clients``: ``X [S, B, p]``, ``y [S, B]`` (one gather for all)."""
        sizes = self.sizes[clients]
        if batch_size is None:
            if bool((sizes != sizes[0]).any()):
                raise ValueError("full-batch local steps (batch_size=None) need equal client sizes, got "
                                 f"{sorted(set(sizes.tolist()))}")
            rows = self.offsets[clients].unsqueeze(1) + torch.arange(int(sizes[0]))
        else:
            u = torch.rand((clients.numel(), batch_size), generator=generator, dtype=torch.float64)
            local = (u * sizes.unsqueeze(1)).long().minimum(sizes.unsqueeze(1) - 1)
            rows = self.offsets[clients].unsqueeze(1) + local
        rows = rows.to(self.X.device)
        return self.X[rows], self.y[rows]

    def to(self, device: torch.device | str) -> FederatedData:
        """The same data on ``device`` (offsets stay on the CPU: they index, they are not computed on)."""
        return FederatedData(self.X.to(device), self.y.to(device), self.offsets)
