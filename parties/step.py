"""The step size a job trains with: ``--gamma γ``, or (by default, or ``--gamma auto``) derived from the
data at start.

Every rank calls :func:`choose_gamma` before the first step. Without ``--gamma`` it is collective: each
party shares three numbers about its block (:func:`vertical.step_size.block_smoothness`, one checked
buffer allgather on the control plane, :meth:`~parties.control_plane.ControlPlane.gather_row_norms`),
and every party computes the same γ from the same q triples (:func:`vertical.step_size.default_gamma`).
The blocks are the ones the party trains on, after ``--standardize``. The γ is kept in each party's
checkpoint, so a resumed run goes on with the step it started with (:mod:`parties.training`), even
if the rule has changed since; ``--gamma-decay`` decays from it.
"""

from __future__ import annotations

from parties.plan import JobPlan
from parties.runtime import PartyRuntime
from vertical.problems import PROBLEMS
from vertical.step_size import block_smoothness, default_gamma


def choose_gamma(runtime: PartyRuntime, config: JobPlan, kept: float | None = None) -> float:
    """The run's base step γ, set on this party's rule (collective unless ``--gamma`` is a number).
    ``kept``: the step a resumed run's checkpoint holds, used in place of the derived one."""
    if runtime.party.network is not None:  # Adam's step (parties/model_options.py): nothing to derive
        from parties.model_options import network_step

        return network_step(config.gamma)
    if config.gamma is not None:
        gamma = config.gamma
    else:
        block = runtime.party.block
        every = runtime.gather_row_norms(*block_smoothness(block))  # every rank takes part, resumed or not
        # passive parties hold no Problem: the loss is the named problem's
        loss = PROBLEMS[config.problem].loss
        gamma = default_gamma(every, block.n_rows, config.batch_size, loss, config.lam)
        how = "derived from the data"
        if kept is not None and kept != gamma:
            gamma, how = kept, "the run's, from its checkpoint"
        if runtime.rank == 0:  # before any step: a job that aborts later still said which γ it used
            print(f"step size γ = {gamma:.4g}, {how} (B = {config.batch_size}; --gamma to set one)",
                  flush=True)
    runtime.part.set_step(config.gamma_at(0.0, gamma))  # the rule's, and the compiled pump's with it
    return gamma
