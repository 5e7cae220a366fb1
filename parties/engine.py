"""``--engine``: which loop serves a party's data plane, and the jobs the compiled one refuses.

``python`` (the default) is the reference runtime. ``compiled`` runs the B = 1 hot path in one numba
pump per rank (``parties/compiled_loop.py``, docs/runtime.md "The compiled loop"); it serves only the
inline path's plainest job, so every option that needs something it does not do is refused in one
line naming that option, before anything starts.
"""

from __future__ import annotations

ENGINES = ("python", "compiled")


def engine_refusal(c) -> str | None:
    """One line naming the option that keeps ``--engine compiled`` from serving the job ``c``
    (a :class:`~parties.config.RunConfig`), or None."""
    if c.engine != "compiled":
        return None
    blocking = [
        (c.batch_size != 1, f"-B {c.batch_size} (it runs B = 1)"),
        (c.mode != "async", f"--mode {c.mode} (it runs async)"),
        (c.algorithm != "sgd", f"--algorithm {c.algorithm} (it runs sgd)"),
        (c.model != "linear", f"--model {c.model} (it runs the linear model)"),
        (c.piggyback, "--piggyback"),
        (c.secure_channels, "--secure-channels (its messages are not sealed)"),
        (c.audit, "--audit (it keeps no transcript)"),
        (c.label_privacy != "none", f"--label-privacy {c.label_privacy}"),
        (c.straggler is not None, "--straggler"),
        (c.link_delay_ms > 0 or c.link_jitter_ms > 0, "--link-delay/--link-jitter"),
    ]
    for blocked, option in blocking:
        if blocked:
            return f"--engine compiled cannot run with {option}: use --engine python"
    return None
