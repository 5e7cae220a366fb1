"""Models as functions of a flat parameter vector, batched over clients.

A model never owns parameters: it maps a stack of flat vectors ``W [S, d]`` (one per sampled client) and
their minibatches ``X [S, B, p]``, ``y [S, B]`` to per-client losses ``[S]`` and gradients ``[S, d]`` in
one batched computation (``torch.bmm``), so one local step of all S clients costs one call and no Python
loop over clients. Forward and backward are written by hand: the gradient of each layer is written by
``bmm(..., out=view)`` straight into its slice of the flat ``[S, d]`` gradient, so there is no autograd
graph, no per-layer ``cat``, and the algorithms see the flat vectors they reason about.

:class:`TorchModel` is the same protocol for any stateless ``torch.nn`` module, by autograd through
``torch.func.vmap`` (FedDRO's models, and a CNN for the flat algorithms).

Parameter layout of :class:`MLP` (per layer, in order): weight ``[fan_in, fan_out]`` row-major, then bias
``[fan_out]``. The loss is the mean over the minibatch (cross-entropy for classifiers, ½ squared error for
:class:`LeastSquares`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, vmap

from horizontal.rounds import all_finite

EVAL_CHUNK = 8192
TORCH_EVAL_CHUNK = 4096


class BatchedModel(Protocol):
    """What the engine and the algorithms need from a model."""

    dim: int
    n_features: int

    def init(self, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A fresh flat parameter vector ``[d]``."""
        ...

    def loss_and_grad(self, W: torch.Tensor, X: torch.Tensor, y: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean minibatch loss ``[S]`` and its gradient ``[S, d]`` (a fresh tensor) for each row of ``W``."""
        ...

    def evaluate(self, w: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """Mean loss (and accuracy for classifiers) of one model ``w [d]`` on a whole data set."""
        ...

    def check_data(self, X: torch.Tensor, y: torch.Tensor, where: str) -> None:
        """Raise a clear error if ``(X, y)`` cannot be fed to this model."""
        ...


def _check_features(X: torch.Tensor, y: torch.Tensor, n_features: int, where: str) -> None:
    if X.ndim != 2 or X.shape[1] != n_features:
        raise ValueError(f"{where}: features must be (n, {n_features}), got {tuple(X.shape)}")
    if y.shape != (X.shape[0],):
        raise ValueError(f"{where}: labels must be ({X.shape[0]},), got {tuple(y.shape)}")
    if X.is_floating_point() and not all_finite(X):
        raise ValueError(f"{where}: features contain NaN or infinity")


class MLP:
    """Fully connected ReLU network ``p → hidden... → n_classes`` with softmax cross-entropy.

    ``MLP(784, (256, 128), 10)`` is the papers' network (d = 235,146); ``MLP(p, (), k)`` is multinomial
    logistic (softmax) regression. Initialisation follows ``torch.nn.Linear``: U(±1/√fan_in) for weights
    and biases.
    """

    def __init__(self, n_features: int, hidden: Sequence[int] = (256, 128), n_classes: int = 10) -> None:
        sizes = [n_features, *hidden, n_classes]
        if any(int(s) != s or s < 1 for s in sizes) or n_classes < 2:
            raise ValueError(f"layer sizes must be positive integers and n_classes >= 2, got {sizes}")
        self.n_features = n_features
        self.n_classes = n_classes
        self.sizes = tuple(int(s) for s in sizes)
        self._layers: list[tuple[int, int, int, int]] = []  # (weight offset, bias offset, fan_in, fan_out)
        offset = 0
        for fan_in, fan_out in zip(self.sizes[:-1], self.sizes[1:], strict=True):
            self._layers.append((offset, offset + fan_in * fan_out, fan_in, fan_out))
            offset += fan_in * fan_out + fan_out
        self.dim = offset

    def __repr__(self) -> str:
        return f"MLP({'-'.join(map(str, self.sizes))}, d={self.dim})"

    def init(self, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = torch.empty(self.dim, dtype=torch.float64)
        for w_off, b_off, fan_in, fan_out in self._layers:
            bound = 1.0 / math.sqrt(fan_in)
            w[w_off:b_off + fan_out].uniform_(-bound, bound, generator=generator)
        return w.to(dtype)

    def _views(self, W: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer: weight ``[S, fan_in, fan_out]`` and bias ``[S, fan_out]`` views into flat ``W``."""
        S = W.shape[0]
        return [(W[:, w_off:b_off].view(S, fan_in, fan_out), W[:, b_off:b_off + fan_out])
                for w_off, b_off, fan_in, fan_out in self._layers]

    def _forward(self, W: torch.Tensor, X: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Hidden activations (input first) and logits."""
        views = self._views(W)
        activations = [X]
        h = X
        for layer, (weight, bias) in enumerate(views):
            z = torch.baddbmm(bias.unsqueeze(1), h, weight)
            if layer == len(views) - 1:
                return activations, z
            h = z.clamp_min_(0.0)
            activations.append(h)
        raise AssertionError("unreachable: an MLP has at least one layer")

    def loss_and_grad(self, W: torch.Tensor, X: torch.Tensor, y: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        W = W.contiguous()
        batch = X.shape[1]
        activations, logits = self._forward(W, X)
        log_p = torch.log_softmax(logits, dim=-1)
        target = y.unsqueeze(-1)
        loss = -log_p.gather(-1, target).squeeze(-1).mean(dim=1)
        dz = log_p.exp_()                                   # softmax, reusing the buffer
        dz.scatter_add_(-1, target, torch.full_like(dz[..., :1], -1.0)).div_(batch)
        G = torch.empty_like(W)
        grads = self._views(G)
        weights = self._views(W)
        for layer in range(len(self._layers) - 1, -1, -1):
            h_in = activations[layer]
            g_weight, g_bias = grads[layer]
            torch.bmm(h_in.transpose(1, 2), dz, out=g_weight)
            torch.sum(dz, dim=1, out=g_bias)
            if layer > 0:
                dz = torch.bmm(dz, weights[layer][0].transpose(1, 2)).mul_(h_in > 0)
        return loss, G

    def evaluate(self, w: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        W = w.reshape(1, -1)
        total_loss, correct = 0.0, 0
        for start in range(0, X.shape[0], EVAL_CHUNK):
            xb, yb = X[start:start + EVAL_CHUNK].to(w.dtype), y[start:start + EVAL_CHUNK]
            _, logits = self._forward(W, xb.unsqueeze(0))
            logits = logits.squeeze(0)
            total_loss += float(torch.nn.functional.cross_entropy(logits, yb, reduction="sum"))
            correct += int((logits.argmax(dim=1) == yb).sum())
        n = X.shape[0]
        return {"loss": total_loss / n, "accuracy": correct / n}

    def check_data(self, X: torch.Tensor, y: torch.Tensor, where: str) -> None:
        _check_classes(X, y, self.n_features, self.n_classes, where)


def _check_classes(X: torch.Tensor, y: torch.Tensor, n_features: int, n_classes: int, where: str) -> None:
    _check_features(X, y, n_features, where)
    if y.dtype != torch.int64:
        raise TypeError(f"{where}: class labels must be int64, got {y.dtype}")
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= n_classes):
        raise ValueError(f"{where}: labels must lie in [0, {n_classes}), "
                         f"got range [{int(y.min())}, {int(y.max())}]")


def softmax_regression(n_features: int, n_classes: int) -> MLP:
    """Multinomial logistic regression: an MLP without hidden layers (convex)."""
    return MLP(n_features, (), n_classes)


class LeastSquares:
    """Linear least squares ``F(x; (a, b)) = ½(a·x − b)²`` (no bias), convex with a closed-form optimum:
    the deterministic heterogeneous quadratics of tests/test_hfl_algorithms.py are clients holding different
    ``(A_i, b_i)``."""

    def __init__(self, n_features: int) -> None:
        if n_features < 1:
            raise ValueError(f"n_features must be >= 1, got {n_features}")
        self.n_features = n_features
        self.dim = n_features

    def __repr__(self) -> str:
        return f"LeastSquares(d={self.dim})"

    def init(self, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(self.dim, generator=generator, dtype=torch.float64).to(dtype)

    def loss_and_grad(self, W: torch.Tensor, X: torch.Tensor, y: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = torch.bmm(X, W.unsqueeze(-1)).squeeze(-1) - y
        loss = 0.5 * residual.square().mean(dim=1)
        grad = torch.bmm(residual.unsqueeze(1), X).squeeze(1) / X.shape[1]
        return loss, grad

    def evaluate(self, w: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        residual = X.to(w.dtype) @ w - y
        return {"loss": float(0.5 * residual.square().mean())}

    def check_data(self, X: torch.Tensor, y: torch.Tensor, where: str) -> None:
        _check_features(X, y, self.n_features, where)
        if not y.is_floating_point():
            raise TypeError(f"{where}: regression targets must be floating point, got {y.dtype}")


class TorchModel:
    """A ``torch.nn`` classifier used as a function of a flat parameter vector ``[d]``, batched over
    clients with ``torch.func.vmap``: per-sample cross-entropy losses ``[K, B]`` for ``W [K, d]``,
    differentiable in ``W``. Parameters are laid out in ``module.named_parameters()`` order.

    It is a :class:`BatchedModel` (autograd through vmap where :class:`MLP` writes its backward by hand),
    so every flat-vector algorithm runs on any stateless module; FedDRO uses its per-sample losses. A
    module with BatchNorm has state besides its parameters and runs on the layered backbone instead
    (:mod:`horizontal.layered`)."""

    def __init__(self, module: nn.Module, n_features: int, n_classes: int) -> None:
        self.module = module
        self.n_features = n_features
        self.n_classes = n_classes
        self._layout = [(name, tuple(p.shape), p.numel()) for name, p in module.named_parameters()]
        self.dim = sum(n for _, _, n in self._layout)

    def __repr__(self) -> str:
        return f"TorchModel({type(self.module).__name__}, d={self.dim})"

    def init(self, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """U(±1/√fan_in) for every weight and the bias after it (torch.nn's default bounds), seeded."""
        pieces, bound = [], 1.0
        for _, shape, n in self._layout:
            if len(shape) > 1:
                bound = 1.0 / math.sqrt(math.prod(shape[1:]))
            pieces.append(torch.empty(n, dtype=torch.float64).uniform_(-bound, bound, generator=generator))
        return torch.cat(pieces).to(dtype)

    def _unflatten(self, W: torch.Tensor) -> dict[str, torch.Tensor]:
        lead = W.shape[:-1]
        params, offset = {}, 0
        for name, shape, n in self._layout:
            params[name] = W[..., offset:offset + n].reshape(*lead, *shape)
            offset += n
        return params

    def _losses_one(self, params: dict[str, torch.Tensor], X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = functional_call(self.module, params, (X,))
        return nn.functional.cross_entropy(logits, y, reduction="none")

    def per_sample_losses(self, W: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """ℓ(w_k; x_{k,j}) ``[K, B]`` for ``W [K, d]``, ``X [K, B, p]``, ``y [K, B]``."""
        return vmap(self._losses_one)(self._unflatten(W), X.to(W.dtype), y)

    @torch.no_grad()
    def losses_and_predictions(self, w: torch.Tensor, X: torch.Tensor, y: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample losses and predicted classes of one model ``w [d]`` on a whole data set."""
        params = self._unflatten(w)
        losses, predictions = [], []
        for start in range(0, X.shape[0], TORCH_EVAL_CHUNK):
            stop = start + TORCH_EVAL_CHUNK
            logits = functional_call(self.module, params, (X[start:stop].to(w.dtype),))
            losses.append(nn.functional.cross_entropy(logits, y[start:stop], reduction="none"))
            predictions.append(logits.argmax(dim=1))
        return torch.cat(losses), torch.cat(predictions)

    def loss_and_grad(self, W: torch.Tensor, X: torch.Tensor, y: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean minibatch loss ``[S]`` and its gradient ``[S, d]``, by autograd (:class:`BatchedModel`)."""
        leaf = W.detach().requires_grad_(True)
        loss = self.per_sample_losses(leaf, X, y).mean(dim=1)
        (grad,) = torch.autograd.grad(loss.sum(), leaf)
        return loss.detach(), grad

    def evaluate(self, w: torch.Tensor, X: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        losses, predictions = self.losses_and_predictions(w, X, y)
        return {"loss": float(losses.to(torch.float64).mean()),
                "accuracy": float((predictions == y).to(torch.float64).mean())}

    def check_data(self, X: torch.Tensor, y: torch.Tensor, where: str) -> None:
        _check_classes(X, y, self.n_features, self.n_classes, where)


def small_cnn(n_classes: int = 10, side: int = 28) -> TorchModel:
    """conv5×5(1→16)-ReLU-maxpool2 → conv5×5(16→32)-ReLU-maxpool2 → linear (18,378 parameters at 28×28):
    a CPU-sized stand-in for the paper's ResNet20 (no BatchNorm)."""
    flat = 32 * (((side - 4) // 2 - 4) // 2) ** 2
    module = nn.Sequential(nn.Unflatten(-1, (1, side, side)), nn.Conv2d(1, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
                           nn.Conv2d(16, 32, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(-3),
                           nn.Linear(flat, n_classes))
    return TorchModel(module, side * side, n_classes)


def torch_mlp(n_features: int, hidden: tuple[int, ...], n_classes: int) -> TorchModel:
    """Fully connected ReLU network (``hidden=()`` is softmax regression)."""
    sizes = [n_features, *hidden, n_classes]
    layers: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return TorchModel(nn.Sequential(*layers[:-1]), n_features, n_classes)


def least_squares_optimum(X: np.ndarray, y: np.ndarray, parts: Sequence[np.ndarray]) -> np.ndarray:
    """Minimiser of f(x) = (1/N) Σ_i f_i(x), f_i = mean over client i's rows of ½(a·x − b)²: every client
    weighs 1/N whatever its size (the SCAFCOM paper never weights by dataset size). Solves
    Σ_i A_iᵀA_i/n_i x = Σ_i A_iᵀb_i/n_i."""
    d = X.shape[1]
    H, r = np.zeros((d, d)), np.zeros(d)
    for rows in parts:
        A, b = X[rows].astype(np.float64), y[rows].astype(np.float64)
        H += A.T @ A / len(rows)
        r += A.T @ b / len(rows)
    return np.linalg.solve(H, r)
