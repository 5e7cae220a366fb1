"""``vfl serve RUN``: start the run's parties under one ``mpiexec`` and keep them up (the launcher side).

The run folder says what each party holds (``config.json``, as for ``vfl predict``); the ranks write
their pid and verdict files to ``<run>/serving/``, so that the launcher can name the party that ended
the service. Under one ``mpiexec`` the death of a rank ends the whole job: the service then stops, and
this command says which party died first (recovery of a party that returns is phase 2 of issue 29,
with the per-organisation ``vfl party`` launch). SIGINT or SIGTERM stop the service cleanly.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

#: bounds of --max-batch: rows of one aggregation (and of one request)
MAX_BATCH_LIMIT = 1 << 16
#: the most values one round sums, (k+1)·B (a network run; a linear one sums 2·B): the receive
#: buffers of the secure sum are sized for it (16 MiB of words)
MAX_SUM_VALUES = 1 << 21


def check_options(port: int, window_ms: float, max_batch: int, peer_timeout: float) -> None:
    """One line for an option out of range (before any rank starts)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535 (0: any free port), got {port}")
    if not 0 <= window_ms <= 1000:
        raise ValueError(f"--window-ms must be in 0..1000, got {window_ms:g}")
    if not 1 <= max_batch <= MAX_BATCH_LIMIT:
        raise ValueError(f"--max-batch must be in 1..{MAX_BATCH_LIMIT}, got {max_batch}")
    if not peer_timeout > 0:
        raise ValueError(f"--peer-timeout must be positive, got {peer_timeout:g}")


def check_sum_width(config, max_batch: int) -> None:
    """A network run sums (k+1) values a row (its cut layer of k, and the held flag): one line when a
    round of ``--max-batch`` rows would pass :data:`MAX_SUM_VALUES`."""
    if config.model == "linear":
        return
    from parties.model_options import cut_width

    k = cut_width(config.bottom, config.parties)
    if (k + 1) * max_batch > MAX_SUM_VALUES:
        raise ValueError(f"--max-batch {max_batch}: the run's networks contribute k + 1 = {k + 1} values a "
                         f"row, and a round may sum at most {MAX_SUM_VALUES:,} values (--max-batch at most "
                         f"{MAX_SUM_VALUES // (k + 1)})")


def check_address(host: str, port: int) -> None:
    """One line, before any rank starts, for an address this host cannot listen on (taken, or not its
    own); the leader checks again when it binds."""
    import socket

    try:
        with socket.create_server((host, port)):
            pass
    except OSError as err:
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None


def serve(run_dir: str | Path, *, port: int, host: str = "127.0.0.1", window_ms: float = 1.0,
          max_batch: int = 1024, peer_timeout: float = 10.0) -> int:
    """Serve until stopped; the exit code (0 after SIGINT/SIGTERM, 1 if a party failed)."""
    from parties.checkpoint import checkpoint_path, complete_epochs
    from parties.launch import FirstDeath, rank_threads, run_mpi_module
    from parties.resume import load_run

    check_options(port, window_ms, max_batch, peer_timeout)
    check_address(host, port)
    run = Path(run_dir)
    if not (run / "config.json").exists():
        raise FileNotFoundError(f"{run / 'config.json'} not found: pass the --out folder of a `vfl train` "
                                "run")
    config = load_run(run)
    check_sum_width(config, max_batch)
    complete_epochs(run)
    if config.party_dir is None:
        missing = [r for r in range(config.parties) if not checkpoint_path(run, r).exists()]
        if missing:
            raise FileNotFoundError(f"{run}: no trained block for parties {missing} (party-<rank>.ckpt.npz)")
    state = _fresh_state(run, config.parties)
    watch = FirstDeath(state, config.parties)
    args = ["--run", str(run), "--state", str(state), "--host", host, "--port", str(port),
            "--window-ms", str(window_ms), "--max-batch", str(max_batch), "--peer-timeout", str(peer_timeout)]
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        code, output = run_mpi_module(config.parties, "parties.serving.rank", args,
                                      extra_env=rank_threads(config.parties, None))
    except KeyboardInterrupt:
        print("vfl serve: stopped", file=sys.stderr)
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    return _ended(code, output, state, config.parties, watch)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # run_mpi_module then stops mpiexec as after Ctrl-C


def _fresh_state(run: Path, parties: int) -> Path:
    """``<run>/serving/`` without the pid and verdict files of an earlier service."""
    state = run / "serving"
    state.mkdir(exist_ok=True)
    for rank in range(parties):
        for name in (f"party-{rank}.pid", f"verdict-{rank}.txt"):
            (state / name).unlink(missing_ok=True)
    return state


def _ended(code: int, output: str, state: Path, parties: int, watch) -> int:
    """The exit code of a service that ended by itself, with one line naming the party at fault."""
    from parties.outcomes import EXIT_CODES, decisive_verdict, find_stop, read_verdicts

    if code == 0 or code in (-signal.SIGINT, 128 + signal.SIGINT):
        return 0
    verdict = decisive_verdict(read_verdicts(state, parties))
    stopped = find_stop(verdict or output)
    if stopped:
        print(f"vfl serve: {stopped[1]}", file=sys.stderr)
        return EXIT_CODES[stopped[0]]
    if verdict:
        print(f"vfl serve: the service ended: {verdict}", file=sys.stderr)
    else:
        from parties.launch import died_first

        who = died_first(watch.first()) or "a party died"
        print(f"vfl serve: the service ended (exit code {code}): {who}, and under one mpiexec the others "
              "were stopped with it", file=sys.stderr)
    return EXIT_CODES["failed"]
