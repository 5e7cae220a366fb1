"""The leader's event loop: the HTTP endpoint, the batcher, and one thread that does all its MPI.

aiohttp runs in the main thread's asyncio loop; each batch is scored in a single worker thread (MPI
calls of the leader come from that thread, but for the test of the acknowledgements when a round runs
past ``--peer-timeout``, under a lock). SIGINT/SIGTERM stop the endpoint: requests
in flight are answered, then the passive parties are told to stop. A party found unavailable ends the
service with a stop line naming it, after its 503 answers have gone out.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from parties.serving.batching import MicroBatcher
from parties.serving.federation import Federation, PartyUnavailable
from parties.serving.front import build_app

#: seconds for the 503 answers to leave before a failed service ends the job
FAILURE_GRACE_S = 0.3


async def serve_http(comm, federation: Federation, args: argparse.Namespace) -> None:
    """Serve until a signal or a failure; returns once the passive parties are told to stop."""
    from parties.lifecycle import end_job, stop_job
    from parties.outcomes import EXIT_CODES
    from protocols.errors import ProtocolViolation

    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(1, thread_name_prefix="aggregation")

    def score(ids):
        try:
            return federation.score(ids)
        except ProtocolViolation as err:  # the sender's fault: end the service naming it
            end_job(comm, f"[party 0] {err}", EXIT_CODES["failed"])
            raise

    async def score_within_deadline(ids):
        """A round that runs past ``--peer-timeout`` names the party that did not acknowledge it."""
        try:
            return await asyncio.wait_for(asyncio.shield(loop.run_in_executor(pool, score, ids)),
                                          args.peer_timeout)
        except TimeoutError:
            silent = federation.unacknowledged()
            raise PartyUnavailable(silent[0] if silent else None, args.peer_timeout) from None

    batcher = MicroBatcher(score_within_deadline, window=args.window_ms / 1000, max_rows=args.max_batch)
    stop, failures = asyncio.Event(), []

    def on_failure(line: str) -> None:
        failures.append(line)
        loop.call_later(FAILURE_GRACE_S, stop.set)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    app = build_app(batcher, task=federation.model.task or "regression", parties=comm.Get_size(),
                    on_failure=on_failure, window_ms=args.window_ms, sealed=federation.channels is not None)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, args.host, args.port).start()
    except OSError as err:  # taken since the launcher's check, or an address not of this host
        stop_job(comm, 0, "usage", f"cannot listen on {args.host}:{args.port}: {err.strerror or err}")
    host, port = runner.addresses[0][:2]
    sealed = ", sealed channels" if federation.channels is not None else ""
    print(f"vfl serve: listening on http://{host}:{port} ({comm.Get_size()} parties, window "
          f"{args.window_ms:g} ms, batches of up to {args.max_batch} rows{sealed})", flush=True)
    batching = asyncio.create_task(batcher.run())
    await stop.wait()
    await runner.cleanup()
    batching.cancel()
    if failures:
        stop_job(comm, 0, "failed", failures[0])
    await loop.run_in_executor(pool, federation.stop)
    pool.shutdown()
    print(f"vfl serve: stopped after {batcher.batches} batches", flush=True)
