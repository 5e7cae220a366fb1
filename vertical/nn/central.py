"""The centralised reference: the same network on all columns in one place, trained by plain autograd.

What NonF (:mod:`vertical.reference`) is for the linear models: the number a federated run is judged
against. The assembled network is exactly the federated model, ``top(Σ_l bottom_l(X[:, cols_l]))``,
with one optimiser over all of its parameters and the same batches (one permutation per pass,
:func:`~vertical.nn.simulate.epoch_batches`), so a federated run with no staleness must reproduce it to
rounding, and its accuracy and time per epoch are the baseline of ``python -m experiments vnn``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from vertical.nn.networks import DEFAULT_OPTIMIZER, EMBED_CHUNK, MLPBottom, MLPTop, OptimizerSpec
from vertical.nn.simulate import epoch_batches


class AssembledNetwork(nn.Module):
    """``top(Σ_l bottom_l(x[cols_l]))`` as one module over all columns."""

    def __init__(self, bottoms: Sequence[nn.Module], columns: Sequence[np.ndarray], top: nn.Module, *,
                 binary: bool) -> None:
        super().__init__()
        if len(bottoms) != len(columns):
            raise ValueError(f"{len(bottoms)} bottoms for {len(columns)} column blocks")
        self.bottoms = nn.ModuleList(bottoms)
        self.top = top
        self.binary = binary
        self.columns = [torch.as_tensor(np.asarray(c, dtype=np.int64)) for c in columns]

    @classmethod
    def from_parties(cls, bottoms: Sequence[MLPBottom], columns: Sequence[np.ndarray], top: MLPTop
                     ) -> AssembledNetwork:
        """A copy of the parties' networks (same parameters, independent from then on)."""
        return cls([copy.deepcopy(b.net) for b in bottoms], columns, copy.deepcopy(top.net),
                   binary=top.binary)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        z = self.bottoms[0](X[:, self.columns[0]])
        for bottom, cols in zip(self.bottoms[1:], self.columns[1:], strict=True):
            z = z + bottom(X[:, cols])
        return self.top(z)

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.binary:
            return nn.functional.binary_cross_entropy_with_logits(logits[:, 0], y.to(logits.dtype))
        return nn.functional.cross_entropy(logits, y)

    def predict_proba(self, X) -> np.ndarray:
        dtype = next(self.parameters()).dtype
        parts = []
        with torch.no_grad():
            for start in range(0, X.shape[0], EMBED_CHUNK):
                chunk = X[start:start + EMBED_CHUNK]
                chunk = chunk.toarray() if sp.issparse(chunk) else np.asarray(chunk)
                logits = self(torch.as_tensor(chunk, dtype=dtype)).to(torch.float64)
                if self.binary:
                    p = torch.sigmoid(logits[:, 0]).numpy()
                    parts.append(np.column_stack([1.0 - p, p]))
                else:
                    parts.append(torch.softmax(logits, dim=1).numpy())
        return np.concatenate(parts)


def train_central(model: AssembledNetwork, X, y: np.ndarray, *, epochs: int, batch_size: int,
                  optimizer: OptimizerSpec = DEFAULT_OPTIMIZER, seed: int = 0,
                  evaluate: Callable[[int], dict] | None = None) -> list[dict]:
    """Train ``model`` on ``(X, y)`` (labels as class indices) with the simulator's batches; returns one
    row per epoch (``epoch``, mean training ``loss``, cumulative training ``seconds`` and ``cpu_seconds``,
    and whatever ``evaluate(epoch)`` adds, outside the timed part)."""
    dtype = next(model.parameters()).dtype
    dense = torch.as_tensor(X.toarray() if sp.issparse(X) else np.asarray(X), dtype=dtype)
    labels = torch.as_tensor(np.asarray(y), dtype=torch.int64)
    opt = optimizer.build(list(model.parameters()))
    rng = np.random.default_rng(seed)
    history, elapsed, cpu = [], 0.0, 0.0
    for epoch in range(1, epochs + 1):
        start, cpu_start, losses = time.perf_counter(), time.process_time(), []
        for rows in epoch_batches(rng, dense.shape[0], batch_size):
            index = torch.as_tensor(rows)
            opt.zero_grad(set_to_none=False)
            loss = model.loss(model(dense[index]), labels[index])
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        elapsed += time.perf_counter() - start
        cpu += time.process_time() - cpu_start
        row = {"epoch": epoch, "loss": float(np.mean(losses)), "seconds": elapsed, "cpu_seconds": cpu}
        if evaluate is not None:
            row.update(evaluate(epoch))
        history.append(row)
    return history
