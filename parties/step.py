"""The step size a job trains with: ``--gamma`` (0.05 by default), or derived from the data at start
under ``--gamma auto``.

Every rank calls :func:`choose_gamma` before the first step (collective under ``--gamma auto``): each
party shares its block's largest and mean squared row norm (one buffer allgather on the control plane,
:meth:`~parties.control_plane.ControlPlane.gather_row_norms`), and every party computes the same γ from
the same q pairs (:func:`vertical.step_size.default_gamma`). A resumed run reads the same blocks, so it
derives the same γ; ``--gamma-decay`` decays from it.
"""

from __future__ import annotations

from parties.plan import JobPlan
from parties.runtime import PartyRuntime
from vertical.problems import PROBLEMS
from vertical.step_size import block_row_norms, default_gamma


def choose_gamma(runtime: PartyRuntime, config: JobPlan) -> float:
    """The run's base step γ, set on this party's rule (collective under ``--gamma auto``)."""
    if config.gamma is not None:
        gamma = config.gamma
    else:
        block = runtime.party.block
        every = runtime.gather_row_norms(*block_row_norms(block))
        # passive parties hold no Problem: the curvature is the named problem's loss's
        curvature = PROBLEMS[config.problem].loss.curvature
        gamma = default_gamma(float(every[:, 0].sum()), float(every[:, 1].sum()), block.n_rows,
                              config.batch_size, curvature, config.lam)
        if runtime.rank == 0:  # before any step: a job that aborts later still said which γ it used
            print(f"step size γ = {gamma:.4g}, derived from the data (B = {config.batch_size}; "
                  "--gamma auto)", flush=True)
    runtime.party.rule.set_gamma(config.gamma_at(0.0, gamma))
    return gamma
