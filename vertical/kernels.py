"""Numba kernels for the per-step block updates of VFB² (SGD, SVRG, SAGA), eager and lazy.

Why numba ``nogil``: a party's k worker threads apply collaborative updates to the *shared* block
``w_l`` lock-free (Hogwild-style). Plain Python threads would serialise on the GIL; these kernels
release it, so k threads really run in parallel. Each kernel applies a *batch* of (ϑ, i) pairs in
order, which pays the Python→numba call (~2.5 µs) once per batch.

A party's feature block is always held as CSR arrays ``(indptr, indices, data)``: dense tabular data
is stored the same way, so there is one code path.

Mini-batches: every kernel takes ``batch`` = B. ``rows.size`` must be a multiple of B; each group of
B consecutive pairs is one *step*: the average of the B per-sample loss parts, plus the dense part
(λ∇g(w) and, for SVRG / SAGA-scalar, μ) once per step, evaluated at w at the start of the step.
B = 1 is exactly the per-sample update, bit for bit the same floating-point operations as before
mini-batches existed (``tests/test_lazy_kernels.py`` keeps a copy of those formulas).

Two families:

* **eager** (``sgd_apply``, ``svrg_apply``, ``saga_table_apply``, ``saga_scalar_apply``): the dense
  part touches all d_l coordinates every step, O(d_l) per step. They are the reference.
* **lazy** (``lazy_apply``, ``lazy_row_dots``, ``lazy_synchronize``): O(nnz of the step's rows).
  Between two touches of coordinate j the only thing that happens to w_j is the dense step
  ``w_j ← w_j − γ(μ_j + λ∇g(w_j))`` with a constant μ_j (μ changes only at coordinates of applied
  rows, which are caught up first). So we keep ``last[j]``, the step count up to which w_j is
  current, and catch w_j up in closed form (L2, none) or by a bounded-error integrator (nonconvex)
  just before it is read or written. See ``docs/lazy-updates.md``.

Step counting with several writers: ``counters[s, 0]`` is the number of steps writer slot s has
applied (only slot s writes it, so no increment is lost); the global clock is their sum. One row of 8
int64 per slot keeps two writers' counters off the same cache line.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from vertical.kernel_codes import MODE_SAGA_SCALAR, MODE_SGD, MODE_SVRG  # noqa: F401 (the rules' codes)
from vertical.problems import REG_L2, REG_NONCONVEX

#: The regularisers the kernels understand, by their code in ``vertical.problems`` (declared there once):
#: g(w) = ½‖w‖² → ∇g = w; g(w) = ½ Σ w²/(1+w²) → ∇g = w/(1+w²)².

#: Nonconvex catch-up: largest w-distance (in units of the regulariser's curvature scale 1) and
#: largest λ·time one RK4 substep may cover. 0.01 keeps the RK4 error far below the modified-equation
#: error for the step sizes used here (docs/lazy-updates.md, "Nonconvex regulariser").
RK_SIGMA = 0.01
#: L2 catch-ups of at most this many steps iterate the eager formula instead of the closed form.
L2_ITERATE_GAP = 8
#: sup_w |w/(1+w²)²| (at w² = 1/3): bounds |∇g| for the nonconvex regulariser.
NONCONVEX_GRAD_MAX = 9.0 / (16.0 * math.sqrt(3.0))


@njit(nogil=True, cache=True, inline="always")
def _reg_grad(kind: int, wj: float) -> float:
    if kind == REG_L2:
        return wj
    if kind == REG_NONCONVEX:
        t = 1.0 + wj * wj
        return wj / (t * t)
    return 0.0


@njit(nogil=True, cache=True)
def row_dots(indptr, indices, data, w, rows, out):
    """``out[k] = x_{rows[k]} · w`` for CSR rows: the local partial products o_i^(l) (Algorithm 1 step 2)."""
    for k in range(rows.size):
        i = rows[k]
        s = 0.0
        for p in range(indptr[i], indptr[i + 1]):
            s += data[p] * w[indices[p]]
        out[k] = s


# ----------------------------------------------------------------------------------------- eager


@njit(nogil=True, cache=True)
def sgd_apply(indptr, indices, data, w, rows, thetas, gamma, lam, reg, batch):
    """VFB²-SGD (Alg. 2 step 6-7, Alg. 3 step 3-4): ``w -= γ (mean_b ϑ_b x_{i_b} + λ ∇g(ŵ))`` per step."""
    d = w.size
    for s in range(rows.size // batch):
        if lam != 0.0:
            for j in range(d):
                w[j] -= gamma * lam * _reg_grad(reg, w[j])
        for k in range(s * batch, (s + 1) * batch):
            i = rows[k]
            step = gamma * thetas[k] / batch
            for p in range(indptr[i], indptr[i + 1]):
                w[indices[p]] -= step * data[p]


@njit(nogil=True, cache=True)
def svrg_apply(indptr, indices, data, w, rows, thetas, theta0, mu, gamma, lam, reg, batch):
    """VFB²-SVRG (Alg. 4 step 10-11, Alg. 5 step 7-8, with the paper's missing λ restored).

    ``w -= γ (mean_b (ϑ_b − ϑ_{0,i_b}) x_{i_b} + μ + λ ∇g(ŵ))`` where ``μ = (1/n) X_l^T ϑ_0``. The
    regulariser terms of the listing, λ∇g(ŵ) − λ∇g(w^s) + λ∇g(w^s), collapse to λ∇g(ŵ) exactly.
    """
    for s in range(rows.size // batch):
        _reference_step(indptr, indices, data, w, rows, thetas, theta0, mu, gamma, lam, reg, s, batch)


@njit(nogil=True, cache=True)
def _reference_step(indptr, indices, data, w, rows, thetas, ref, mu, gamma, lam, reg, s, batch):
    """Step ``s`` of SVRG and SAGA-scalar, which differ only in the ϑ a pair is compared with (``ref``:
    ϑ_0 or the table): ``w -= γ (μ + λ∇g(w))``, then ``w -= γ/B Σ_b (ϑ_b − ref_{i_b}) x_{i_b}``."""
    for j in range(w.size):
        w[j] -= gamma * (mu[j] + lam * _reg_grad(reg, w[j]))
    for k in range(s * batch, (s + 1) * batch):
        i = rows[k]
        step = gamma * (thetas[k] - ref[i]) / batch
        for p in range(indptr[i], indptr[i + 1]):
            w[indices[p]] -= step * data[p]


@njit(nogil=True, cache=True)
def saga_table_apply(indptr, indices, data, w, rows, thetas, table, mean, scratch, gamma, lam, reg, batch):
    """VFB²-SAGA with the exact gradient table of the listing (Alg. 6 step 7-9, Alg. 7 step 3-5).

    ``table[i]`` is the last block gradient α̃_i = ϑ x_i + λ∇g(ŵ) this party computed for sample i,
    ``mean`` is (1/n) Σ_j α̃_j, maintained incrementally. ``scratch`` is a per-call (3, d_l) buffer.
    A step of B pairs moves w by −γ (mean_b (α_new_b − α̃_{i_b}) + mean), all α̃ read before the
    step; then the entries are stored in order (a repeated row: the last one wins, ``mean`` stays the
    exact mean of the table). O(B d_l) per step by definition: α̃ holds the dense λ∇g(ŵ).
    """
    d = w.size
    n = table.shape[0]
    reg_g = scratch[0]
    acc = scratch[1]
    cur = scratch[2]
    for s in range(rows.size // batch):
        for j in range(d):
            reg_g[j] = lam * _reg_grad(reg, w[j])
            acc[j] = 0.0
        for k in range(s * batch, (s + 1) * batch):
            i = rows[k]
            _table_entry(indptr, indices, data, i, thetas[k], reg_g, cur)
            for j in range(d):
                acc[j] += cur[j] - table[i, j]
        for j in range(d):
            w[j] -= gamma * (acc[j] / batch + mean[j])
        for k in range(s * batch, (s + 1) * batch):
            i = rows[k]
            _table_entry(indptr, indices, data, i, thetas[k], reg_g, cur)
            for j in range(d):
                old = table[i, j]
                mean[j] += (cur[j] - old) / n
                table[i, j] = cur[j]


@njit(nogil=True, cache=True)
def _table_entry(indptr, indices, data, i, theta, reg_g, cur):
    """``cur`` = α_i = ϑ x_i + λ∇g(ŵ), the block gradient the exact SAGA table holds for sample i."""
    for j in range(cur.size):
        cur[j] = reg_g[j]
    for p in range(indptr[i], indptr[i + 1]):
        cur[indices[p]] += theta * data[p]


@njit(nogil=True, cache=True)
def _saga_scalar_store(indptr, indices, data, rows, thetas, theta_table, mu, start, stop):
    """Store the step's ϑ's in the scalar table, in order, keeping ``mu = (1/n) X^T theta_table``."""
    n = theta_table.size
    for k in range(start, stop):
        i = rows[k]
        delta = thetas[k] - theta_table[i]
        for p in range(indptr[i], indptr[i + 1]):
            mu[indices[p]] += delta * data[p] / n
        theta_table[i] = thetas[k]


@njit(nogil=True, cache=True)
def saga_scalar_apply(indptr, indices, data, w, rows, thetas, theta_table, mu, gamma, lam, reg, batch):
    """VFB²-SAGA with the compressed scalar-ϑ table ("standard compression").

    Stores one ϑ per sample; the loss part of α̃_i is ϑ_i^old x_i and ``mu = (1/n) X^T ϑ^old`` is kept
    incrementally; the regulariser gradient is applied exactly instead of through the table. Same
    expectation as the listing, O(n) memory instead of O(n d_l). In a step of B pairs every pair is
    compared with the table as it was before the step; then the B ϑ's are stored in order (a repeated
    row: the last one wins, μ stays exactly (1/n) X^T ϑ^old).
    """
    for s in range(rows.size // batch):
        _reference_step(indptr, indices, data, w, rows, thetas, theta_table, mu, gamma, lam, reg, s, batch)
        _saga_scalar_store(indptr, indices, data, rows, thetas, theta_table, mu, s * batch, (s + 1) * batch)


# ------------------------------------------------------------------------------------------ lazy


@njit(nogil=True, cache=True, inline="always")
def clock(counters) -> int:
    """The global step count: the sum of the per-writer-slot counters ``counters[s, 0]``."""
    t = 0
    for s in range(counters.shape[0]):
        t += counters[s, 0]
    return t


@njit(nogil=True, cache=True, inline="always")
def _dense_step(wj, muj, gamma, lam, reg, has_mu):
    """One dense step on one coordinate, the same floating-point operations as the eager kernels."""
    if has_mu:
        return wj - gamma * (muj + lam * _reg_grad(reg, wj))
    return wj - gamma * lam * _reg_grad(reg, wj)


@njit(nogil=True, cache=True, inline="always")
def _modified_field(wj, muj, gamma, lam):
    """G = F + (γ/2) F'F with F(w) = μ + λ w/(1+w²)²: the flow of w' = −G over time γ matches one
    Euler step w − γF(w) up to O(γ³) (the "modified equation" of the Euler map)."""
    t = 1.0 + wj * wj
    f = muj + lam * wj / (t * t)
    fp = lam * (1.0 - 3.0 * wj * wj) / (t * t * t)
    return f + 0.5 * gamma * fp * f


@njit(nogil=True, cache=True)
def _nonconvex_catch_up(wj, muj, g, gamma, lam, has_mu, exact_gap):
    """g dense steps of the nonconvex regulariser (+ μ): exact iteration when g ≤ exact_gap or when
    RK4 would not be at least 4× cheaper; otherwise RK4 on the modified equation over time gγ with
    m substeps, each covering at most RK_SIGMA of w-distance and of λ·time."""
    if g > exact_gap:
        rate = lam + abs(muj) + lam * NONCONVEX_GRAD_MAX
        tau = g * gamma
        m = math.ceil(tau * rate / RK_SIGMA)
        if m < 1:
            m = 1
        if 4 * m < g:
            mu_ = muj if has_mu else 0.0
            h = tau / m
            for _ in range(m):
                k1 = _modified_field(wj, mu_, gamma, lam)
                k2 = _modified_field(wj - 0.5 * h * k1, mu_, gamma, lam)
                k3 = _modified_field(wj - 0.5 * h * k2, mu_, gamma, lam)
                k4 = _modified_field(wj - h * k3, mu_, gamma, lam)
                wj = wj - h * (k1 + 2.0 * k2 + 2.0 * k3 + k4) / 6.0
            return wj
    for _ in range(g):
        wj = _dense_step(wj, muj, gamma, lam, REG_NONCONVEX, has_mu)
    return wj


@njit(nogil=True, cache=True, inline="always")
def catch_up(wj, muj, g, gamma, lam, reg, has_mu, log_a, exact_gap):
    """w_j after g dense steps ``w ← w − γ(μ_j + λ∇g(w))`` (μ_j = 0 when not has_mu).

    L2: up to L2_ITERATE_GAP steps, plain iteration; beyond, the step is affine, w ← a w + b with
    a = 1 − γλ, b = −γμ_j, so after g steps w = a^g w + b (1 − a^g)/(1 − a); a^g = exp(g log1p(−γλ))
    and 1 − a^g = −expm1(·) keep full precision when gγλ is tiny. No regulariser: w − gγμ_j.
    Nonconvex: :func:`_nonconvex_catch_up`.
    """
    if g <= 0:
        return wj
    if reg == REG_L2:
        if g <= L2_ITERATE_GAP:  # a few mul-adds beat exp + expm1, and equal the eager kernel exactly
            for _ in range(g):
                wj = _dense_step(wj, muj, gamma, lam, REG_L2, has_mu)
            return wj
        if log_a == log_a:  # finite: 1 − γλ > 0
            x = g * log_a
            ag = math.exp(x)
            s = -math.expm1(x) / (gamma * lam)
        else:
            a = 1.0 - gamma * lam
            ag = a ** g
            s = (1.0 - ag) / (gamma * lam)
        if has_mu:
            return ag * wj - gamma * muj * s
        return ag * wj
    if reg == REG_NONCONVEX:
        return _nonconvex_catch_up(wj, muj, g, gamma, lam, has_mu, exact_gap)
    if has_mu:
        return wj - g * (gamma * muj)
    return wj


@njit(nogil=True, cache=True, inline="always")
def _touch_row(indices, lo, hi, w, last, mu, has_mu) -> float:
    """Load a row's (w_j, last_j, μ_j) in a tight loop of independent loads and return a throwaway
    sum (so the loads are kept). At millions of columns each is a cache miss; here many are in flight
    at once, where the catch-up loop's exp calls would fill the out-of-order window and serialise
    them. A pure prefetch: the caller then reads the same values again, from cache, so what it
    computes and when it writes (the lock-free window, docs/lazy-updates.md) do not change."""
    sink = 0.0
    for p in range(lo, hi):
        j = indices[p]
        sink += w[j] + last[j]
        if has_mu:
            sink += mu[j]
    return sink


@njit(nogil=True, cache=True)
def lazy_apply(indptr, indices, data, w, rows, thetas, mode, theta_ref, mu, gamma, lam, reg, batch,
               last, counters, writer, log_a, exact_gap):
    """Lazy SGD / SVRG / SAGA-scalar (``mode``): the same steps as the eager kernels, O(nnz) each.

    Per step (B pairs), with T the global clock read at its start: every coordinate j of the step's
    rows is caught up from ``last[j]`` to T + 1 (the missed dense steps plus this step's own dense
    part, evaluated at w_j before this step's sparse part, as the eager kernels do) and ``last[j]``
    set to T + 1 (never lowered: a negative gap, from a writer whose T is older, is clamped to 0);
    then the sparse part; then (SAGA-scalar) the table and μ at those coordinates; then this writer's
    counter += 1. ``theta_ref`` is ϑ_0 (SVRG), the ϑ table (SAGA-scalar) or unused (SGD).
    """
    has_mu = mode != MODE_SGD
    sink = 0.0
    for s in range(rows.size // batch):
        target = clock(counters) + 1
        lo, hi = s * batch, (s + 1) * batch
        for k in range(lo, hi):
            i = rows[k]
            sink += _touch_row(indices, indptr[i], indptr[i + 1], w, last, mu, has_mu)
            for p in range(indptr[i], indptr[i + 1]):
                j = indices[p]
                gap = target - last[j]
                if gap > 0:  # SGD never loads mu[j]: at large d_l every array touched is a cache miss
                    muj = mu[j] if has_mu else 0.0
                    w[j] = catch_up(w[j], muj, gap, gamma, lam, reg, has_mu, log_a, exact_gap)
                    last[j] = target
        for k in range(lo, hi):
            i = rows[k]
            step = gamma * ((thetas[k] - theta_ref[i]) if has_mu else thetas[k]) / batch
            for p in range(indptr[i], indptr[i + 1]):
                w[indices[p]] -= step * data[p]
        if mode == MODE_SAGA_SCALAR:
            _saga_scalar_store(indptr, indices, data, rows, thetas, theta_ref, mu, lo, hi)
        counters[writer, 0] += 1
    return sink


@njit(nogil=True, cache=True)
def lazy_row_dots(indptr, indices, data, w, rows, out, mu, has_mu, gamma, lam, reg, last, counters,
                  log_a, exact_gap):
    """``out[k] = x_{rows[k]} · ŵ`` where ŵ_j is w_j caught up to the current clock: a pure read
    (nothing is written to ``w`` or ``last``), so a reading thread never races with the writers."""
    t = clock(counters)
    sink = 0.0
    for k in range(rows.size):
        i = rows[k]
        sink += _touch_row(indices, indptr[i], indptr[i + 1], w, last, mu, has_mu)
        acc = 0.0
        for p in range(indptr[i], indptr[i + 1]):
            j = indices[p]
            muj = mu[j] if has_mu else 0.0
            acc += data[p] * catch_up(w[j], muj, t - last[j], gamma, lam, reg, has_mu, log_a, exact_gap)
        out[k] = acc
    return sink


@njit(nogil=True, cache=True)
def lazy_synchronize(w, mu, has_mu, gamma, lam, reg, last, counters, log_a, exact_gap):
    """Bring every coordinate up to the current clock (O(d_l)); only while no thread writes ``w``.

    At millions of columns most coordinates were last touched at the previous barrier, so they share
    one gap: the L2 closed form's a^g and (1 − a^g)/(γλ) are computed once per distinct run of equal
    gaps (the same values :func:`catch_up` computes, so the result is bit for bit the same).
    """
    t = clock(counters)
    closed_form = reg == REG_L2 and log_a == log_a
    cached_gap, ag, s = -1, 0.0, 0.0
    for j in range(w.size):
        gap = t - last[j]
        if closed_form and gap > L2_ITERATE_GAP:
            if gap != cached_gap:
                x = gap * log_a
                ag = math.exp(x)
                s = -math.expm1(x) / (gamma * lam)
                cached_gap = gap
            w[j] = ag * w[j] - gamma * mu[j] * s if has_mu else ag * w[j]
        else:
            w[j] = catch_up(w[j], mu[j], gap, gamma, lam, reg, has_mu, log_a, exact_gap)
        last[j] = t


@njit(nogil=True, cache=True)
def mean_block_gradient(indptr, indices, data, theta, out):
    """``out[:] = X_lᵀ ϑ / n`` in place, in scipy's order of summation (row by row), so that it equals
    ``(X.T @ ϑ) / n`` bit for bit without allocating two d_l-long temporaries at every snapshot."""
    out[:] = 0.0
    n = indptr.size - 1
    for i in range(n):
        for p in range(indptr[i], indptr[i + 1]):
            out[indices[p]] += data[p] * theta[i]
    for j in range(out.size):
        out[j] = out[j] / n


def csr_arrays(X) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (indptr, indices, data) arrays of a block as the kernels want them (CSR, int64/int32/float64).

    Dense input is converted; duplicates are summed so that each stored entry is one coordinate.
    """
    import scipy.sparse as sp

    M = sp.csr_matrix(X, dtype=np.float64)
    M.sum_duplicates()
    return (np.ascontiguousarray(M.indptr, dtype=np.int64),
            np.ascontiguousarray(M.indices, dtype=np.int32),
            np.ascontiguousarray(M.data, dtype=np.float64))
