"""Losses, regularizers and the finite-sum problems of the VFB² paper (its problems (7) and (18)).

A problem is ``f(w) = (1/n) Σ_i L(w·x_i, y_i) + λ Σ_l g(w_l)``. The paper puts the regularizer inside
every ``f_i``; for the separable ``g`` used here that equals adding ``λ g(w)`` once, and the
per-sample block gradient is ``∇_{G_l} f_i(w) = ϑ_i x_i^(l) + λ ∇g(w_l)`` with ``ϑ_i = ∂L/∂z``. That
identity is the Backward Updating Mechanism: the only label-dependent number a passive party ever
needs is the scalar ``ϑ``.

Losses take the score ``z = w·x`` and the label ``y`` and work elementwise on scalars or arrays:

============  ======================  ==============================  =========================
loss          ``L(z, y)``             ``ϑ = ∂L/∂z``                    note
============  ======================  ==============================  =========================
logistic      ``log(1 + e^{−y z})``   ``−y · sigmoid(−y z)``           computed with logaddexp/expit
squared       ``(z − y)²``            ``2 (z − y)``                    no ½, as in the paper (17)
robust        ``log(r²/2 + 1)``       ``2 (z − y) / ((z − y)² + 2)``   ``r = y − z``, paper (18)
============  ======================  ==============================  =========================

Regularizers (applied to any block ``w_l``, hence to all of ``w``): ``L2`` ``½‖w‖²``,
``NonconvexL2`` ``½ Σ w²/(1 + w²)``, and ``NoRegularizer``.

Decisions (the paper is silent or ambiguous):

- ``"robust"`` (problem 18) has **no regularizer by default**, as printed; the paper also says λ = 1e-4
  for all experiments, so the other reading is available as
  ``get_problem("robust", regularizer="l2")``.
- Validation policy. Methods that take whole data sets (``objective``, ``gradient``,
  ``value_and_gradient``, ``hessian_operator``, ``block_gradient``, ``predict``, ``score``) check
  shapes, finiteness and (binary task) labels in ``{−1, +1}`` and raise ``ValueError``. The check is
  O(nnz), as costly as one pass over ``X``; callers that loop (the reference solver) validate once with
  :meth:`Problem.validate` and then pass ``check=False``. ``Problem.theta`` and the ``Loss`` /
  ``Regularizer`` methods are the per-sample hot path and never validate: NaN in, NaN out.
- ``predict`` maps a score of exactly 0 to +1.
- Every loss and regularizer also provides its second derivative (diagonal Hessian for the
  regularizers) so that the reference solver can polish with Newton-CG steps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp
from scipy.special import expit

from vertical.metrics import accuracy, rmse

if TYPE_CHECKING:  # imported where it is built: a rank never needs scipy.sparse.linalg (start-up time)
    from scipy.sparse.linalg import LinearOperator

FloatArray = npt.NDArray[np.float64]
#: A float or an array of floats; losses return the same kind they are given (a numpy scalar for scalars).
Scalars = float | np.floating | FloatArray
#: A design matrix: dense 2-D ndarray or any scipy sparse matrix/array (CSR is the fast path).
Matrix = np.ndarray | sp.spmatrix | sp.sparray
Task = Literal["binary", "regression"]
TASKS: tuple[Task, ...] = ("binary", "regression")


# ---------------------------------------------------------------------------------------- losses


class Loss(ABC):
    """A loss ``L(z, y)`` of the linear score ``z = w·x``; all methods are elementwise and unchecked."""

    name: str
    #: ``True`` when ``L`` is convex in ``z`` (decides whether Newton polishing is safe).
    convex: bool
    #: ``max_z ∂²L(z, y)/∂z²`` over every z and label: the loss's smoothness in the score, which with
    #: the rows' norms bounds the objective's (the default step, ``vertical.step_size``).
    curvature: float
    #: ``max |∂L/∂z|`` over every z and label, or None when ϑ is unbounded (the squared loss): with a
    #: bounded ϑ a step too long for a few rows adds bounded noise, with an unbounded one it grows
    #: geometrically, so only a bounded loss gets the default step's robust rows (``vertical.step_size``).
    derivative_bound: float | None

    @abstractmethod
    def value(self, z: Scalars, y: Scalars) -> Scalars:
        """Per-sample loss ``L(z, y)``."""

    @abstractmethod
    def derivative(self, z: Scalars, y: Scalars) -> Scalars:
        """``ϑ = ∂L(z, y)/∂z``: the only label-dependent quantity sent to other parties."""

    @abstractmethod
    def second_derivative(self, z: Scalars, y: Scalars) -> Scalars:
        """``∂²L(z, y)/∂z²`` (used for Hessian-vector products)."""


@dataclass(frozen=True)
class LogisticLoss(Loss):
    """``log(1 + exp(−y z))`` for labels ``y ∈ {−1, +1}``; stable for any finite ``z``."""

    name: str = field(default="logistic", init=False)
    convex: bool = field(default=True, init=False)
    curvature: float = field(default=0.25, init=False)  # σ(yz)σ(−yz) ≤ 1/4, at z = 0
    derivative_bound: float | None = field(default=1.0, init=False)  # |ϑ| = σ(−yz) < 1

    def value(self, z: Scalars, y: Scalars) -> Scalars:
        return np.logaddexp(0.0, -np.multiply(y, z))

    def derivative(self, z: Scalars, y: Scalars) -> Scalars:
        return -np.multiply(y, expit(-np.multiply(y, z)))

    def second_derivative(self, z: Scalars, y: Scalars) -> Scalars:
        # y²·σ(yz)·σ(−yz): both factors are computed directly, so neither tail cancels to 0 early.
        yz = np.multiply(y, z)
        return np.multiply(y, y) * expit(yz) * expit(-yz)


@dataclass(frozen=True)
class SquaredLoss(Loss):
    """``(z − y)²`` without the ½ factor, as in the paper's problem (17)."""

    name: str = field(default="squared", init=False)
    convex: bool = field(default=True, init=False)
    curvature: float = field(default=2.0, init=False)  # (z − y)² without the ½: 2 everywhere
    derivative_bound: float | None = field(default=None, init=False)  # ϑ = 2(z − y): unbounded

    def value(self, z: Scalars, y: Scalars) -> Scalars:
        return np.square(np.subtract(z, y))

    def derivative(self, z: Scalars, y: Scalars) -> Scalars:
        return 2.0 * np.subtract(z, y)

    def second_derivative(self, z: Scalars, y: Scalars) -> Scalars:
        return np.full_like(np.subtract(z, y), 2.0, dtype=np.float64)


@dataclass(frozen=True)
class RobustLoss(Loss):
    """``log(r²/2 + 1)`` with ``r = y − z`` (paper's robust regression, problem (18)); nonconvex."""

    name: str = field(default="robust", init=False)
    convex: bool = field(default=False, init=False)
    curvature: float = field(default=1.0, init=False)  # 2(2 − u²)/(u² + 2)², largest at u = z − y = 0
    derivative_bound: float | None = field(default=2 ** -0.5, init=False)  # 2u/(u² + 2), largest at u = √2

    def value(self, z: Scalars, y: Scalars) -> Scalars:
        r = np.subtract(y, z)
        return np.log1p(0.5 * r * r)

    def derivative(self, z: Scalars, y: Scalars) -> Scalars:
        u = np.subtract(z, y)
        return 2.0 * u / (u * u + 2.0)

    def second_derivative(self, z: Scalars, y: Scalars) -> Scalars:
        u2 = np.square(np.subtract(z, y))
        return 2.0 * (2.0 - u2) / np.square(u2 + 2.0)


# ---------------------------------------------------------------------------------------- regularizers


#: Codes by which the numba kernels (``vertical.kernels``) tell the regularizers apart; each class below
#: carries its own as ``kernel_code``, so a new regularizer is declared here only.
REG_NONE, REG_L2, REG_NONCONVEX = 0, 1, 2


class Regularizer(ABC):
    """A separable regularizer ``g``; applied to a block ``w_l`` or to all of ``w``. Unchecked."""

    name: str
    #: this regularizer's code in the kernels (``REG_*``); ``None``: the kernels cannot apply it
    kernel_code: int | None = None
    #: ``True`` when ``g`` is 1-strongly convex, so that ``λ g`` makes a convex loss λ-strongly convex.
    strongly_convex: bool

    @abstractmethod
    def value(self, w: FloatArray) -> float:
        """``g(w)``."""

    @abstractmethod
    def gradient(self, w: FloatArray) -> FloatArray:
        """``∇g(w)`` as a new array (callers may update it in place)."""

    @abstractmethod
    def hessian_diagonal(self, w: FloatArray) -> FloatArray:
        """Diagonal of ``∇²g(w)`` (every ``g`` here is separable, so the Hessian is diagonal)."""


@dataclass(frozen=True)
class L2(Regularizer):
    """``½‖w‖²``."""

    name: str = field(default="l2", init=False)
    strongly_convex: bool = field(default=True, init=False)
    kernel_code: int = field(default=REG_L2, init=False)

    def value(self, w: FloatArray) -> float:
        return 0.5 * float(np.dot(w, w))

    def gradient(self, w: FloatArray) -> FloatArray:
        return np.array(w, dtype=np.float64, copy=True)

    def hessian_diagonal(self, w: FloatArray) -> FloatArray:
        return np.ones_like(w, dtype=np.float64)


@dataclass(frozen=True)
class NonconvexL2(Regularizer):
    """``½ Σ_j w_j²/(1 + w_j²)``: bounded, smooth, nonconvex (the paper's nonconvex logistic problem)."""

    name: str = field(default="nonconvex", init=False)
    strongly_convex: bool = field(default=False, init=False)
    kernel_code: int = field(default=REG_NONCONVEX, init=False)

    def value(self, w: FloatArray) -> float:
        w2 = np.square(w)
        return 0.5 * float(np.sum(w2 / (1.0 + w2)))

    def gradient(self, w: FloatArray) -> FloatArray:
        return w / np.square(1.0 + np.square(w))

    def hessian_diagonal(self, w: FloatArray) -> FloatArray:
        w2 = np.square(w)
        return (1.0 - 3.0 * w2) / (1.0 + w2) ** 3


@dataclass(frozen=True)
class NoRegularizer(Regularizer):
    """``g = 0`` (the robust regression problem (18) as printed)."""

    name: str = field(default="none", init=False)
    strongly_convex: bool = field(default=False, init=False)
    kernel_code: int = field(default=REG_NONE, init=False)

    def value(self, w: FloatArray) -> float:
        return 0.0

    def gradient(self, w: FloatArray) -> FloatArray:
        return np.zeros_like(w, dtype=np.float64)

    def hessian_diagonal(self, w: FloatArray) -> FloatArray:
        return np.zeros_like(w, dtype=np.float64)


REGULARIZERS: Mapping[str, type[Regularizer]] = MappingProxyType(
    {"l2": L2, "nonconvex": NonconvexL2, "none": NoRegularizer})


# ---------------------------------------------------------------------------------------- problems


@dataclass(frozen=True)
class Problem:
    """``f(w) = (1/n) Σ_i L(w·x_i, y_i) + λ g(w)`` on a linear model; see the module docstring."""

    name: str
    loss: Loss
    regularizer: Regularizer
    lam: float
    task: Task

    def __post_init__(self) -> None:
        if not isinstance(self.loss, Loss):
            raise ValueError(f"loss must be a vertical.problems.Loss, got {type(self.loss).__name__}")
        if not isinstance(self.regularizer, Regularizer):
            raise ValueError(f"regularizer must be a vertical.problems.Regularizer, "
                             f"got {type(self.regularizer).__name__}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        lam = float(self.lam)
        if not (np.isfinite(lam) and lam >= 0.0):
            raise ValueError(f"lam must be a finite number >= 0, got {self.lam!r}")
        object.__setattr__(self, "lam", lam)

    @property
    def strongly_convex(self) -> bool:
        """``True`` when ``f`` is λ-strongly convex (unique minimiser ``w*``)."""
        return self.loss.convex and self.regularizer.strongly_convex and self.lam > 0.0

    @property
    def curvature(self) -> float:
        """The loss's largest second derivative in the score (:attr:`Loss.curvature`)."""
        return self.loss.curvature

    # -- validation ------------------------------------------------------------------------------

    def validate(self, w: npt.ArrayLike, X: Matrix, y: npt.ArrayLike | None = None) -> None:
        """Raise ``ValueError`` unless ``w``, ``X`` (and ``y``) fit together and are finite.

        ``X`` is a dense 2-D array or a scipy sparse matrix with ``n ≥ 1`` rows; ``w`` has one entry per
        column; ``y`` one entry per row, in ``{−1, +1}`` for the binary task.
        """
        n, d = _check_matrix(X, "X")
        _check_vector(w, d, "w", f"X has {d} columns")
        if y is not None:
            y = _check_vector(y, n, "y", f"X has {n} rows")
            if self.task == "binary" and not np.all(np.abs(y) == 1.0):
                bad = np.unique(y[np.abs(y) != 1.0])[:5]
                raise ValueError(f"problem {self.name!r} is binary: labels must be -1 or +1, found {bad}")

    # -- full objective --------------------------------------------------------------------------

    def objective(self, w: FloatArray, X: Matrix, y: FloatArray, *, check: bool = True) -> float:
        """``f(w)`` on the samples ``(X, y)``."""
        if check:
            self.validate(w, X, y)
        z = X @ w
        return float(np.mean(self.loss.value(z, y))) + self.lam * self.regularizer.value(w)

    def gradient(self, w: FloatArray, X: Matrix, y: FloatArray, *, check: bool = True) -> FloatArray:
        """``∇f(w) = (1/n) Xᵀϑ + λ∇g(w)``."""
        return self.value_and_gradient(w, X, y, check=check)[1]

    def value_and_gradient(self, w: FloatArray, X: Matrix, y: FloatArray, *,
                           check: bool = True) -> tuple[float, FloatArray]:
        """``(f(w), ∇f(w))`` sharing one product ``Xw`` (what quasi-Newton solvers want)."""
        if check:
            self.validate(w, X, y)
        n = X.shape[0]
        z = X @ w
        value = float(np.mean(self.loss.value(z, y))) + self.lam * self.regularizer.value(w)
        grad = np.asarray(X.T @ self.loss.derivative(z, y), dtype=np.float64) / n
        grad += self.lam * self.regularizer.gradient(w)
        return value, grad

    def hessian_operator(self, w: FloatArray, X: Matrix, y: FloatArray, *,
                         check: bool = True) -> LinearOperator:
        """``∇²f(w)`` as a linear operator ``v ↦ (1/n) Xᵀ diag(L''(Xw, y)) X v + λ ∇²g(w) v``.

        The curvature vector is computed once here, so each product costs two passes over ``X``.
        """
        from scipy.sparse.linalg import LinearOperator

        if check:
            self.validate(w, X, y)
        n, d = X.shape
        curvature = self.loss.second_derivative(X @ w, y) / n
        regularizer_diagonal = self.lam * self.regularizer.hessian_diagonal(w)

        def matvec(v: FloatArray) -> FloatArray:
            v = np.ravel(v)
            return np.asarray(X.T @ (curvature * (X @ v)), dtype=np.float64) + regularizer_diagonal * v

        return LinearOperator((d, d), matvec=matvec, rmatvec=matvec, dtype=np.float64)

    # -- BUM building blocks ---------------------------------------------------------------------

    def theta(self, z: Scalars, y: Scalars) -> Scalars:
        """``ϑ = ∂L(z, y)/∂z`` (same as ``loss.derivative``; unchecked hot path)."""
        return self.loss.derivative(z, y)

    def block_gradient(self, theta: Scalars, X_block: Matrix, w_block: FloatArray, *,
                       check: bool = True) -> FloatArray:
        """Mini-batch block gradient ``(1/B) X_blockᵀ ϑ + λ∇g(w_block)`` for ``B`` rows.

        With ``B = 1`` this is the paper's ``∇_{G_l} f_i = ϑ x_i^(l) + λ∇g(w_l)``; a 1-D ``X_block`` is
        read as that single row ``x_i^(l)`` and ``theta`` may then be a scalar.
        """
        if isinstance(X_block, np.ndarray) and X_block.ndim == 1:
            X_block = X_block[np.newaxis, :]
        theta = np.atleast_1d(np.asarray(theta, dtype=np.float64))
        if check:
            n, d = _check_matrix(X_block, "X_block")
            _check_vector(theta, n, "theta", f"X_block has {n} rows")
            _check_vector(w_block, d, "w_block", f"X_block has {d} columns")
        grad = np.asarray(X_block.T @ theta, dtype=np.float64) / X_block.shape[0]
        grad += self.lam * self.regularizer.gradient(w_block)
        return grad

    # -- prediction ------------------------------------------------------------------------------

    def predict(self, w: FloatArray, X: Matrix, *, check: bool = True) -> FloatArray:
        """``sign(Xw)`` in ``{−1, +1}`` (0 ↦ +1) for the binary task, ``Xw`` for regression."""
        if check:
            self.validate(w, X)
        z = np.asarray(X @ w, dtype=np.float64)
        return np.where(z >= 0.0, 1.0, -1.0) if self.task == "binary" else z

    def score(self, w: FloatArray, X: Matrix, y: FloatArray, *, check: bool = True) -> float:
        """Test accuracy in [0, 1] (binary) or RMSE (regression) of the linear model ``w``."""
        if check:
            self.validate(w, X, y)
        y_pred = self.predict(w, X, check=False)
        return accuracy(y, y_pred) if self.task == "binary" else rmse(y, y_pred)


@dataclass(frozen=True)
class ProblemSpec:
    """A named problem of the paper: its loss, default regularizer and task."""

    loss: Loss
    regularizer: Regularizer
    task: Task
    description: str


PROBLEMS: Mapping[str, ProblemSpec] = MappingProxyType({
    "logistic": ProblemSpec(LogisticLoss(), L2(), "binary",
                            "ℓ2-regularized logistic regression, paper (13); strongly convex"),
    "nonconvex-logistic": ProblemSpec(LogisticLoss(), NonconvexL2(), "binary",
                                      "logistic loss + ½Σw²/(1+w²), the paper's 'Problem (7)'; nonconvex"),
    "least-squares": ProblemSpec(SquaredLoss(), L2(), "regression",
                                 "(z−y)² + ℓ2, paper (17); strongly convex"),
    "robust": ProblemSpec(RobustLoss(), NoRegularizer(), "regression",
                          "log((y−z)²/2+1), paper (18), no regularizer as printed; nonconvex"),
})


def get_problem(name: str, lam: float = 1e-4, *, regularizer: Regularizer | str | None = None) -> Problem:
    """The paper's problem ``name`` with coefficient ``lam`` (the paper uses 1e-4 throughout).

    ``regularizer`` overrides the default one, as an instance or by name (``"l2"``, ``"nonconvex"``,
    ``"none"``); e.g. ``get_problem("robust", regularizer="l2")`` is the other reading of (18).
    """
    if name not in PROBLEMS:
        raise ValueError(f"unknown problem {name!r}; known problems: {', '.join(PROBLEMS)}")
    spec = PROBLEMS[name]
    if regularizer is None:
        reg = spec.regularizer
    elif isinstance(regularizer, str):
        if regularizer not in REGULARIZERS:
            raise ValueError(f"unknown regularizer {regularizer!r}; known: {', '.join(REGULARIZERS)}")
        reg = REGULARIZERS[regularizer]()
    else:
        reg = regularizer
    return Problem(name=name, loss=spec.loss, regularizer=reg, lam=lam, task=spec.task)


# ---------------------------------------------------------------------------------------- checks


def _check_matrix(X: Matrix, what: str) -> tuple[int, int]:
    """Shape of a finite, real, non-empty 2-D dense or sparse matrix; ``ValueError`` otherwise."""
    if sp.issparse(X):
        values = X.data if X.format in ("csr", "csc", "coo", "bsr") else X.tocsr().data
    elif isinstance(X, np.ndarray):
        values = X
    else:
        raise ValueError(f"{what} must be a numpy array or a scipy sparse matrix, got {type(X).__name__}")
    if X.ndim != 2:
        raise ValueError(f"{what} must be 2-D, got shape {X.shape}")
    if X.shape[0] == 0:
        raise ValueError(f"{what} has no rows")
    if not (np.issubdtype(values.dtype, np.floating) or np.issubdtype(values.dtype, np.integer)):
        raise ValueError(f"{what} must hold real numbers, got dtype {values.dtype}")
    if not np.all(np.isfinite(values)):
        raise ValueError(f"{what} contains NaN or infinite values")
    return X.shape


def _check_vector(v: npt.ArrayLike, length: int, what: str, reason: str) -> FloatArray:
    """``v`` as a finite float 1-D array of ``length`` entries; ``ValueError`` naming ``reason`` otherwise."""
    arr = np.asarray(v)
    if arr.ndim != 1 or arr.shape[0] != length:
        raise ValueError(f"{what} must be a 1-D array of length {length} ({reason}), got shape {arr.shape}")
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{what} must hold real numbers, got dtype {arr.dtype}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{what} contains NaN or infinite values")
    return arr
