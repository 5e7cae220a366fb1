"""The non-federated reference "NonF": the same problem solved centrally on the pooled data.

Its two uses are the paper's losslessness comparison (test accuracy / RMSE of a federated model vs a
model trained on all features in one place) and ``f*`` for sub-optimality curves ``f(w_t) − f*``.
The second makes precision matter: a curve is only meaningful down to the error of ``f*``.

Method (decided here; the paper only says "trained centrally"):

1. scipy's L-BFGS-B on ``f`` with its exact gradient, ``gtol = tol/√d`` (so the 2-norm of the
   gradient is ≤ ``tol`` when it stops on that test) and ``ftol = 0``: stopping on a small relative
   decrease of ``f`` is exactly what must not happen, since ``f`` stops resolving long before the
   gradient does (for λ-strongly convex ``f``, ``f − f* ≤ ‖∇f‖²/(2λ)``, e.g. 5e-17 at ‖∇f‖ = 1e-10,
   λ = 1e-4, below float64 resolution of ``f ≈ 0.3``).
2. If L-BFGS stops above ``tol`` (usually its line search failing on that roundoff), a few inexact
   Newton steps (conjugate gradients on Hessian-vector products) finish the job. Their acceptance test
   is a decrease of ‖∇f‖ (along a descent direction, with halving) with ``f`` not rising by more than
   its roundoff, not a resolvable decrease of ``f``, for the reason above.
   For a convex problem this converges quadratically to ``w*``.
3. Nonconvex problems (``"nonconvex-logistic"``, ``"robust"``) get a stationary point near where
   L-BFGS ends, from ``w0`` (zeros by default): a local solution, not a certified global one. The Newton
   polish only accepts descent steps, so it refines a local minimum and does not jump to another one.
   Report ``f*`` of those problems as "best stationary value found".

``converged`` is ``grad_norm <= tol`` with ``grad_norm`` the Euclidean norm of the full gradient at the
returned ``w``, recomputed there (never the solver's own estimate).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp
from scipy.optimize import minimize
from scipy.sparse.linalg import cg

from vertical.problems import FloatArray, Matrix, Problem

#: Upper bound on Newton-CG polishing steps after L-BFGS (quadratic convergence needs only a few).
MAX_NEWTON_STEPS = 30
#: Relative increase of ``f`` a Newton step may show: roundoff only (``f`` is flat to float64 near w*),
#: so that on nonconvex problems a step can never climb out of the basin L-BFGS found.
F_SLACK = 1e-13
#: Step halvings tried before a Newton step is declared useless (the gradient's roundoff floor).
MAX_HALVINGS = 10


@dataclass(frozen=True)
class ReferenceSolution:
    """Result of :func:`solve_reference`."""

    w: FloatArray
    #: ``f(w)`` at the returned point.
    f_star: float
    #: ``‖∇f(w)‖₂`` recomputed at the returned point.
    grad_norm: float
    #: L-BFGS iterations plus accepted Newton steps.
    n_iter: int
    #: ``grad_norm <= tol``.
    converged: bool
    #: Wall-clock seconds of the solve (validation excluded).
    seconds: float
    #: What each stage did, e.g. why L-BFGS stopped and how many Newton steps followed.
    message: str = ""


def solve_reference(problem: Problem, X: Matrix, y: npt.ArrayLike, *, tol: float = 1e-10,
                    max_iter: int = 10_000, w0: npt.ArrayLike | None = None,
                    newton_polish: bool = True) -> ReferenceSolution:
    """Minimise ``problem`` on all of ``(X, y)`` until ``‖∇f‖₂ ≤ tol`` (see the module docstring).

    ``w0`` warm-starts the solver (zeros by default). ``newton_polish=False`` keeps plain L-BFGS.
    """
    if not isinstance(problem, Problem):
        raise ValueError(f"problem must be a vertical.problems.Problem (see get_problem), got {problem!r}")
    if not (np.isfinite(tol) and tol > 0.0):
        raise ValueError(f"tol must be a positive number, got {tol!r}")
    if int(max_iter) < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter!r}")
    if sp.issparse(X) and X.format != "csr":
        X = X.tocsr()
    y = np.asarray(y)
    w_start = np.zeros(X.shape[1]) if w0 is None else np.array(w0, dtype=np.float64)
    problem.validate(w_start, X, y)
    y = y.astype(np.float64, copy=False)

    def value_and_gradient(w: FloatArray) -> tuple[float, FloatArray]:
        return problem.value_and_gradient(w, X, y, check=False)

    start = time.perf_counter()
    result = minimize(value_and_gradient, w_start, jac=True, method="L-BFGS-B",
                      options={"maxiter": int(max_iter), "maxfun": 2 * int(max_iter), "maxcor": 20,
                               "gtol": tol / np.sqrt(X.shape[1]), "ftol": 0.0})
    w = np.asarray(result.x, dtype=np.float64)
    f, grad = value_and_gradient(w)
    message = f"L-BFGS-B: {result.nit} iterations, {result.message}"
    newton_steps = 0
    if newton_polish and np.linalg.norm(grad) > tol:
        w, f, grad, newton_steps, why = _newton_polish(problem, X, y, w, grad, tol)
        message += f"; Newton-CG polish: {newton_steps} steps ({why})"
    grad_norm = float(np.linalg.norm(grad))
    return ReferenceSolution(w=w, f_star=f, grad_norm=grad_norm, n_iter=int(result.nit) + newton_steps,
                             converged=grad_norm <= tol, seconds=time.perf_counter() - start,
                             message=message)


def evaluate(problem: Problem, w: npt.ArrayLike, X_test: Matrix, y_test: npt.ArrayLike) -> dict[str, float]:
    """The paper's test metric of ``w``: ``{"accuracy": …}`` (binary) or ``{"rmse": …}`` (regression)."""
    w = np.asarray(w)
    y_test = np.asarray(y_test)
    problem.validate(w, X_test, y_test)
    metric = "accuracy" if problem.task == "binary" else "rmse"
    return {metric: problem.score(w, X_test, y_test, check=False)}


def _newton_polish(problem: Problem, X: Matrix, y: FloatArray, w: FloatArray, grad: FloatArray,
                   tol: float) -> tuple[FloatArray, float, FloatArray, int, str]:
    """Inexact Newton steps from ``w`` until ``‖∇f‖ ≤ tol`` or no step reduces ``‖∇f‖`` any more."""
    d = w.shape[0]
    grad_norm = float(np.linalg.norm(grad))
    f = problem.objective(w, X, y, check=False)
    for step in range(MAX_NEWTON_STEPS):
        if grad_norm <= tol:
            return w, f, grad, step, "reached tol"
        hessian = problem.hessian_operator(w, X, y, check=False)
        # Solve H p = −∇f only as well as the step needs: to 0.1·tol absolutely, or 1e-3 relatively
        # while far away (then the next step's quadratic convergence does the rest).
        direction, _ = cg(hessian, -grad, rtol=1e-3, atol=0.1 * tol, maxiter=max(100, 2 * d))
        if not np.dot(direction, grad) < 0.0:
            return w, f, grad, step, "no descent direction (nonpositive curvature)"
        alpha = 1.0
        for _ in range(MAX_HALVINGS):
            w_new = w + alpha * direction
            f_new, grad_new = problem.value_and_gradient(w_new, X, y, check=False)
            if np.linalg.norm(grad_new) < grad_norm and f_new <= f + F_SLACK * max(1.0, abs(f)):
                w, f, grad, grad_norm = w_new, f_new, grad_new, float(np.linalg.norm(grad_new))
                break
            alpha *= 0.5
        else:
            return w, f, grad, step, "gradient at its roundoff floor"
    return w, f, grad, MAX_NEWTON_STEPS, "step limit" if grad_norm > tol else "reached tol"
