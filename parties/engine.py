"""``--engine``: which loop serves a party's data plane, and the jobs the compiled one refuses.

``python`` is the reference runtime. ``compiled`` runs the B = 1 hot path in one numba pump per rank
(``parties/compiled_loop.py``, docs/runtime.md "The compiled loop"), about 10× faster per update; it
serves only the inline path's plainest job, so asked for by name, every option that needs something it
does not do is refused in one line naming that option, before anything starts. ``auto`` (the default)
takes ``compiled`` for every job it serves and ``python`` for the rest: the two train the same model
(one dominator at ``-P 1``: the same blocks to 1e-9, ``tests/test_compiled_loop.py``).
"""

from __future__ import annotations

ENGINES = ("auto", "python", "compiled")


def engine_for(c) -> str:
    """``python`` or ``compiled``: the loop serving the job ``c`` (a :class:`~parties.config.RunConfig`)."""
    if c.engine == "auto":
        return "compiled" if _blocking_option(c) is None else "python"
    return c.engine


def engine_refusal(c) -> str | None:
    """One line naming the option that keeps ``--engine compiled`` from serving the job ``c``
    (a :class:`~parties.config.RunConfig`), or None."""
    option = _blocking_option(c) if c.engine == "compiled" else None
    return None if option is None else f"--engine compiled cannot run with {option}: use --engine python"


def _blocking_option(c) -> str | None:
    """The first option of ``c`` the compiled pump does not serve, as the user wrote it; None if none."""
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
    return next((option for blocked, option in blocking if blocked), None)


def warm_cache(c) -> None:
    """Compile the pump into numba's cache in one process before the ranks start, when ``c`` runs on it
    and the cache is missing or older than the source: otherwise every rank compiles it at once
    (20–50 s each, all on the same cores). A subprocess, as compiling calls MPI and the launcher must
    not initialise it. Raises ``RuntimeError`` with numba's last line if compiling fails."""
    import subprocess
    import sys
    from pathlib import Path

    if engine_for(c) != "compiled" or _cache_is_fresh():
        return
    print("vfl: compiling the B = 1 loop (--engine compiled) for this checkout, once (about 30 s)",
          file=sys.stderr, flush=True)
    root = Path(__file__).resolve().parents[1]
    code = "from parties.compiled_pump import compile_once; compile_once()"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise RuntimeError(f"compiling the B = 1 loop failed ({last}); run with --engine python")


def _cache_is_fresh(source=None) -> bool:
    """numba's index of the pump in the ``__pycache__`` beside ``source`` (this checkout's
    ``parties/compiled_loop.py``), newer than the source."""
    from pathlib import Path

    source = source or Path(__file__).with_name("compiled_loop.py")
    indexes = list(source.parent.glob("__pycache__/compiled_loop.pump-*.nbi"))
    return any(index.stat().st_mtime >= source.stat().st_mtime for index in indexes)
