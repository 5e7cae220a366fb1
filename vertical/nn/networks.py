"""Torch networks as party models: an MLP bottom per party, and the top network with its loss.

A bottom is ``h_l = MLP(widths)`` on the party's own columns, ReLU between layers and none after the
last (the cut layer is summed, not activated, at the party). The top takes ``z = Σ_l h_l`` and applies
ReLU first when it has layers, so z is the pre-activation of a hidden layer that spans every party's
features (without it, a linear top would make the model a sum of per-party functions, with no feature
of one party ever interacting with another's). A top of one width (``"10"``) is the identity: the sum
is the logits (with linear bottoms, multinomial logistic regression).

Losses: binary (``n_classes = 2``) is the logistic loss on one logit, labels 0/1; more classes are
softmax cross-entropy, labels 0..C−1. The loss is the batch mean; ϑ is per row (``docs`` of
:mod:`vertical.nn.base`).

Each party steps its own parameters with its own optimiser (:class:`OptimizerSpec`); Adam and SGD with
momentum act coordinate by coordinate, so q optimisers over q blocks are exactly one over the
assembled network (what makes the lock-step simulation equal the centralised reference:
``tests/test_vertical_nn.py``).

Initialisation is torch's default for ``nn.Linear``, drawn from a seed per model inside a forked RNG,
so building a model never disturbs the caller's global torch RNG.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from vertical.nn.base import PartyModel, TopModel, check_state, parse_spec
from vertical.nn.protection import LabelProtection, sensitivity_of_identity_top

DTYPES = {"float32": torch.float32, "float64": torch.float64}
#: A sparse block up to this size (dense) is densified at construction.
DENSE_BYTES = 1 << 28
#: Rows per chunk when embedding a whole data set (bounds the activations' memory).
EMBED_CHUNK = 8192


@dataclass(frozen=True)
class OptimizerSpec:
    """How a model steps its own parameters: ``"sgd"`` (with ``momentum``) or ``"adam"``, step ``lr``."""

    name: str = "adam"
    lr: float = 1e-3
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in ("sgd", "adam"):
            raise ValueError(f"optimizer must be 'sgd' or 'adam', got {self.name!r}")
        if not (np.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"the step lr must be a positive number, got {self.lr}")
        if not 0 <= self.momentum < 1 or not self.weight_decay >= 0:
            raise ValueError(f"need 0 <= momentum < 1 and weight_decay >= 0, got {self.momentum}, "
                             f"{self.weight_decay}")

    def build(self, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        """The optimiser over ``params``, in torch's fused CPU kernel (a quarter faster per step on
        these small layers than the default loop over tensors; the same update)."""
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum,
                                   weight_decay=self.weight_decay, fused=True)
        return torch.optim.Adam(params, lr=self.lr, weight_decay=self.weight_decay, fused=True)


#: The step every model takes unless told otherwise: Adam at 1e-3.
DEFAULT_OPTIMIZER = OptimizerSpec()


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run the block with torch's intra-op threads set to ``n`` (None: leave them), restored after."""
    before = torch.get_num_threads()
    if n is not None:
        if n < 1:
            raise ValueError(f"threads must be at least 1, got {n}")
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def dtype_of(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def mlp(widths: Sequence[int], *, input_activation: bool = False, seed: int = 0,
        dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """``Linear`` layers between consecutive widths with ReLU between them (and before the first when
    ``input_activation``); one width gives the identity. Seeded, in a forked RNG."""
    layers: list[nn.Module] = [nn.ReLU()] if input_activation and len(widths) > 1 else []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for position, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
            if position:
                layers.append(nn.ReLU())
            layers.append(nn.Linear(fan_in, fan_out))
    return nn.Sequential(*layers).to(dtype)


def _optimizer_state(opt: torch.optim.Optimizer | None) -> dict[str, np.ndarray]:
    if opt is None:
        return {}
    state = opt.state_dict()["state"]
    return {f"optim/{index}/{key}": value.detach().cpu().numpy().copy()
            for index, entries in state.items() for key, value in entries.items()
            if isinstance(value, torch.Tensor)}


def _load_optimizer_state(opt: torch.optim.Optimizer | None, state: dict[str, np.ndarray],
                          what: str) -> None:
    entries = {k: v for k, v in state.items() if k.startswith("optim/")}
    if opt is None:
        if entries:
            raise ValueError(f"{what}: optimiser state given for a model without parameters")
        return
    current = opt.state_dict()
    n_params = len(current["param_groups"][0]["params"])
    restored: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in entries.items():
        _, index, key = name.split("/", 2)
        if not index.isdigit() or int(index) >= n_params:
            raise ValueError(f"{what}: optimiser state {name!r} names no parameter")
        restored.setdefault(int(index), {})[key] = torch.as_tensor(np.array(value))
    opt.load_state_dict({"state": restored, "param_groups": current["param_groups"]})


def _parameter_state(net: nn.Module) -> dict[str, np.ndarray]:
    return {f"param/{name}": p.detach().cpu().numpy().copy() for name, p in net.named_parameters()}


def _load_parameter_state(net: nn.Module, state: dict[str, np.ndarray], what: str) -> None:
    expected = _parameter_state(net)
    check_state({k: v for k, v in state.items() if k.startswith("param/")}, expected, what)
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(torch.as_tensor(np.asarray(state[f"param/{name}"]), dtype=p.dtype))


class MLPBottom(PartyModel):
    """A party's MLP on its own training block ``X`` (dense; a CSR block above :data:`DENSE_BYTES` is
    kept sparse and densified per batch). ``optimizer=None`` builds a model for inference only (no
    step): a torch optimiser's first construction imports torch's compiler, seconds in every process."""

    def __init__(self, X, spec: str, *, optimizer: OptimizerSpec | None = DEFAULT_OPTIMIZER, seed: int = 0,
                 dtype: str = "float32") -> None:
        if X.ndim != 2 or X.shape[0] < 1:
            raise ValueError(f"a party's block must be a non-empty 2-D array, got shape {X.shape}")
        self.widths = parse_spec(spec, first=int(X.shape[1]), what="bottom")
        if len(self.widths) < 2:
            raise ValueError(f"bottom spec {spec!r}: a bottom needs at least one layer (input-output)")
        self.k = self.widths[-1]
        self.n_rows = int(X.shape[0])
        self.dtype = dtype_of(dtype)
        self.net = mlp(self.widths, seed=seed, dtype=self.dtype)
        self.optimizer = None if optimizer is None else optimizer.build(list(self.net.parameters()))
        # a sparse block is densified once when it is small: indexing CSR rows costs more than the layer
        self._sparse = sp.issparse(X) and X.shape[0] * X.shape[1] * self.dtype.itemsize > DENSE_BYTES
        if self._sparse:
            self.X = sp.csr_matrix(X)
        else:
            dense = X.toarray() if sp.issparse(X) else X
            # a copy in the model's dtype: a party's memory-mapped block is read-only, which torch warns of
            self.X = torch.from_numpy(np.array(dense, dtype=np.float32 if self.dtype == torch.float32
                                               else np.float64))

    def _inputs(self, rows: np.ndarray) -> torch.Tensor:
        rows = np.asarray(rows, dtype=np.int64)
        if self._sparse:
            return torch.as_tensor(self.X[rows].toarray(), dtype=self.dtype)
        return self.X[torch.as_tensor(rows)]

    def forward(self, rows):
        with torch.no_grad():
            return self.net(self._inputs(rows)).to(torch.float64).numpy()

    def gradients(self, rows, theta) -> dict[str, torch.Tensor]:
        """The gradient of the batch-mean loss for this party's parameters, from the rows' ϑ (no step)."""
        theta = np.asarray(theta, dtype=np.float64)
        if theta.shape != (np.size(rows), self.k):
            raise ValueError(f"ϑ must be (B, k) = ({np.size(rows)}, {self.k}), got {theta.shape}")
        self.optimizer.zero_grad(set_to_none=False)
        out = self.net(self._inputs(rows))
        out.backward(torch.as_tensor(theta / theta.shape[0], dtype=self.dtype))
        return {name: p.grad for name, p in self.net.named_parameters()}

    def backward(self, rows, theta, steps=1):
        self.gradients(rows, theta)
        for _ in range(steps):
            self.optimizer.step()

    def embed(self, X):
        if X.shape[1] != self.widths[0]:
            raise ValueError(f"X has {X.shape[1]} columns, this party's model takes {self.widths[0]}")
        parts = []
        with torch.no_grad():
            for start in range(0, X.shape[0], EMBED_CHUNK):
                chunk = X[start:start + EMBED_CHUNK]
                chunk = chunk.toarray() if sp.issparse(chunk) else np.asarray(chunk)
                parts.append(self.net(torch.as_tensor(chunk, dtype=self.dtype)).to(torch.float64).numpy())
        return np.concatenate(parts) if parts else np.zeros((0, self.k))

    def state_dict(self):
        return {**_parameter_state(self.net), **_optimizer_state(self.optimizer)}

    def load_state_dict(self, state):
        _load_parameter_state(self.net, state, "bottom")
        _load_optimizer_state(self.optimizer, state, "bottom")


class MLPTop(TopModel):
    """The top network on ``z`` (width k) and the loss: logistic on one logit for 2 classes, softmax
    cross-entropy for more. ``spec`` runs from k to the number of logits (``*`` for it); ``optimizer=None``:
    for inference only, as :class:`MLPBottom`. ``label_flip`` ρ > 0 (binary): the training labels were
    flipped with probability ρ, and the loss is theirs through the flip (the forward correction)."""

    def __init__(self, spec: str, n_classes: int, *, k: int | None = None,
                 optimizer: OptimizerSpec | None = DEFAULT_OPTIMIZER, seed: int = 0,
                 dtype: str = "float32", label_flip: float = 0.0) -> None:
        if n_classes < 2:
            raise ValueError(f"a classifier needs at least 2 classes, got {n_classes}")
        if not 0.0 <= label_flip < 0.5:
            raise ValueError(f"label_flip is a binary label's flip probability in [0, 0.5), got {label_flip}")
        if label_flip and n_classes != 2:
            raise ValueError(f"label_flip corrects flipped binary labels only, not {n_classes} classes")
        self.n_classes = int(n_classes)
        self.binary = n_classes == 2
        #: the training labels were flipped with this probability (randomized response): the loss is that
        #: of the flip applied to the network's probability (the forward correction), so the network
        #: itself estimates the true label's probability
        self.label_flip = float(label_flip)
        self.widths = parse_spec(spec, first=k, last=1 if self.binary else n_classes, what="top")
        self.k = self.widths[0]
        self.dtype = dtype_of(dtype)
        self.net = mlp(self.widths, input_activation=True, seed=seed, dtype=self.dtype)
        params = list(self.net.parameters())
        self.optimizer = optimizer.build(params) if params and optimizer is not None else None

    def _loss(self, logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        if self.binary and self.label_flip:
            rho = self.label_flip
            noisy = rho + (1 - 2 * rho) * torch.sigmoid(logits[..., 0])  # in [ρ, 1 − ρ]: finite logs
            return nn.functional.binary_cross_entropy(noisy, y.to(logits.dtype), reduction=reduction)
        if self.binary:
            return nn.functional.binary_cross_entropy_with_logits(logits[..., 0], y.to(logits.dtype),
                                                                  reduction=reduction)
        return nn.functional.cross_entropy(logits, y, reduction=reduction)

    def _labels(self, y) -> torch.Tensor:
        y = torch.as_tensor(np.asarray(y), dtype=torch.int64)
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= self.n_classes):
            raise ValueError(f"labels must be class indices in 0..{self.n_classes - 1}")
        return y

    def gradients(self, z, y) -> tuple[np.ndarray, dict[str, torch.Tensor], float]:
        """Per-row ϑ ``(B, k)``, the top's own gradient of the batch-mean loss and the loss (no step)."""
        z = np.asarray(z, dtype=np.float64)
        if z.ndim != 2 or z.shape[1] != self.k:
            raise ValueError(f"z must be (B, {self.k}), got {z.shape}")
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=False)
        z_t = torch.as_tensor(z, dtype=self.dtype).requires_grad_(True)
        loss = self._loss(self.net(z_t), self._labels(y))
        loss.backward()
        theta = z_t.grad.to(torch.float64).numpy() * z.shape[0]
        return theta, {name: p.grad for name, p in self.net.named_parameters()}, float(loss.detach())

    def step(self, z, y, protection: LabelProtection | None = None):
        if protection is not None:
            return self._protected_step(np.asarray(z, dtype=np.float64), y, protection)
        theta, _, loss = self.gradients(z, y)
        if self.optimizer is not None:
            self.optimizer.step()
        return theta, loss

    def _protected_step(self, z: np.ndarray, y, protection: LabelProtection) -> tuple[np.ndarray, float]:
        """The noisy ϑ̃ and DP-SGD at the top, one joint release (:mod:`vertical.nn.protection`): the
        per-row gradients of the top's loss, for z and for the top's parameters, by ``vmap``."""
        if z.ndim != 2 or z.shape[1] != self.k:
            raise ValueError(f"z must be (B, {self.k}), got {z.shape}")
        labels = self._labels(y)
        params = {name: p.detach() for name, p in self.net.named_parameters()}

        def one(p, zb, yb):
            return self._loss(functional_call(self.net, p, (zb[None],)), yb[None])

        z_t = torch.as_tensor(z, dtype=self.dtype)
        g_params, g_z = vmap(grad(one, argnums=(0, 1)), in_dims=(None, 0, 0))(params, z_t, labels)
        # an identity top's ϑ moves by exactly Δ with the label (protection.py decides if Δ beats 2C)
        exact = None if params else sensitivity_of_identity_top(self.k)
        theta = protection.release(g_z.to(torch.float64).numpy(), top_has_parameters=bool(params),
                                   sensitivity=exact)
        if self.optimizer is not None:
            squared = torch.zeros(z.shape[0], dtype=torch.float64)
            for g in g_params.values():
                squared += g.to(torch.float64).reshape(g.shape[0], -1).square().sum(dim=1)
            scale = torch.as_tensor(protection.scales(squared.numpy(), protection.top_clip))
            for name, p in self.net.named_parameters():
                total = torch.tensordot(scale, g_params[name].to(torch.float64), dims=1)
                total += torch.as_tensor(protection.noise(tuple(p.shape), protection.top_std))
                p.grad = (total / z.shape[0]).to(p.dtype)
            self.optimizer.step()
        with torch.no_grad():
            loss = float(self._loss(self.net(z_t), labels))
        return theta, loss

    def loss(self, z, y) -> float:
        """The batch-mean training loss on rows ``z`` with labels ``y`` (no gradient): the mean log loss,
        or under ``label_flip`` the corrected one the top trains, so that the run logs (and its
        divergence check watches) the objective it optimises, not the noisy labels' plain log loss."""
        with torch.no_grad():
            logits = self.net(torch.as_tensor(np.asarray(z), dtype=self.dtype)).to(torch.float64)
            return float(self._loss(logits, self._labels(y)))

    def predict_proba(self, z):
        with torch.no_grad():
            logits = self.net(torch.as_tensor(np.asarray(z), dtype=self.dtype)).to(torch.float64)
        if self.binary:
            positive = torch.sigmoid(logits[:, 0]).numpy()
            return np.column_stack([1.0 - positive, positive])
        return torch.softmax(logits, dim=1).numpy()

    def state_dict(self):
        return {**_parameter_state(self.net), **_optimizer_state(self.optimizer)}

    def load_state_dict(self, state):
        _load_parameter_state(self.net, state, "top")
        _load_optimizer_state(self.optimizer, state, "top")


def build_split_network(X, columns: Sequence[np.ndarray], bottom: str | Sequence[str], top: str,
                        n_classes: int, *, optimizer: OptimizerSpec = DEFAULT_OPTIMIZER, seed: int = 0,
                        dtype: str = "float32") -> tuple[list[MLPBottom], MLPTop]:
    """One :class:`MLPBottom` per column block of ``X`` and the :class:`MLPTop` on their sum.

    ``bottom`` is one spec for every party or one per party (each organisation may choose its own);
    every bottom must end at the same width k, the top's first. Party p's model is seeded
    ``seed + p``, the top ``seed + len(columns)``.
    """
    specs = [bottom] * len(columns) if isinstance(bottom, str) else list(bottom)
    if len(specs) != len(columns):
        raise ValueError(f"{len(specs)} bottom specs for {len(columns)} parties")
    bottoms = [MLPBottom(X[:, cols], spec, optimizer=optimizer, seed=seed + p, dtype=dtype)
               for p, (cols, spec) in enumerate(zip(columns, specs, strict=True))]
    widths = {b.k for b in bottoms}
    if len(widths) != 1:
        raise ValueError(f"every bottom must end at the same width k (the secure sum adds them), got "
                         f"{[b.k for b in bottoms]}")
    head = MLPTop(top, n_classes, k=widths.pop(), optimizer=optimizer, seed=seed + len(columns),
                  dtype=dtype)
    return bottoms, head
