"""The leader's front across federations: one HTTP endpoint that outlives every federation behind it.

The endpoint is :func:`parties.serving.front.build_app` with its :class:`MicroBatcher`, as under one
``mpiexec``; its rounds go over a local link (:mod:`parties.serving.link`) to the leader's process of
the current federation (:mod:`parties.serving.federated`), which this front starts and starts again.
While no federation is formed (the first join, or after a party left) ``/score`` and ``/health``
answer 503 with the line that names the party missing; as soon as every party is back in a new
federation they answer 200 again. A party that broke the protocol is not let back: the front then
forms no new federation, and answers 503 naming it until the leader's command is restarted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
from pathlib import Path

import numpy as np
from aiohttp import web

from parties.serving import link as wire
from parties.serving.batching import MicroBatcher
from parties.serving.federation import BatchScores
from parties.serving.front import build_app
from parties.serving.organisation import Serving, federation_argv, mpi_env

#: the wait before the next federation's process: after one that served, and at most (doubling)
RESTART_FIRST_S, RESTART_CAP_S = 0.2, 10.0
#: seconds the federation's process has to finish after STOP before it is killed
STOP_GRACE_S = 10.0
#: the exit code of a federation's process that refused this party's own files (one line said why)
USAGE = 2
#: seconds past --peer-timeout the front waits for a round's answer before it stops that process
ANSWER_GRACE_S = 5.0


class FederationDown(RuntimeError):
    """No federation serves now: the endpoint answers 503 with this line."""


class Supervisor:
    """Holds the endpoint's view of the federation (up, or down with a line) and its link."""

    def __init__(self, args: argparse.Namespace, serving: Serving, socket_path: str) -> None:
        self.args, self.serving, self.socket_path = args, serving, socket_path
        self.names = [p.name for p in serving.job.parties]
        self.down = "the federation is forming: waiting for every party to join"
        self.excluded: str | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.reader: asyncio.StreamReader | None = None
        self._connected = asyncio.Event()
        self._answer: asyncio.Future | None = None
        self.stopping = False
        self.usage = False  # a federation's process refused this party's own files (exit code 2)
        self.classes = 1  # C of the model served, as the federation's READY says (1: a score per id)

    # ----------------------------------------------------------------- what the endpoint calls

    async def score(self, ids) -> BatchScores:
        """One round through the current federation (the batcher calls it one at a time)."""
        if self.down is not None or self.writer is None:
            raise FederationDown(self.down or "no federation")
        self._answer = asyncio.get_running_loop().create_future()
        self.writer.write(wire.frame(wire.SCORE, ids.astype(np.int64).tobytes()))
        try:  # the process names a silent party itself; this is for a process that cannot
            payload = await asyncio.wait_for(self._answer, self.serving.peer_timeout + ANSWER_GRACE_S)
        except TimeoutError:
            self.process.kill()
            seconds = self.serving.peer_timeout + ANSWER_GRACE_S
            raise FederationDown(f"the leader's federation process did not answer within {seconds:g} s: it "
                                 "was stopped") from None
        try:
            return self._scores(*payload, ids.size)
        except wire.LinkError as err:  # the leader's own process, yet checked: stop it, say why
            self.process.kill()
            raise FederationDown(f"the leader's federation process sent a malformed answer ({err}): it was "
                                 "stopped") from None

    def _scores(self, kind: int, payload: bytes, n: int) -> BatchScores:
        """The answer of a SCORES or CLASSES frame; C is the one READY said, never the answer's own."""
        if kind == wire.CLASSES and self.classes > 1:
            proba, held = wire.classes_of(payload, n, self.classes)
            return BatchScores(np.full(n, np.nan), held, proba)
        if kind == wire.SCORES and self.classes == 1:
            return BatchScores(*wire.scores_of(payload, n))
        raise wire.LinkError(f"a frame of kind {kind} answers for a model of {self.classes} classes")

    def task(self, trained: str) -> str:
        """What the endpoint answers: ``multiclass`` for a network of C > 2 classes, else the job's task."""
        return "multiclass" if self.classes > 1 else trained

    # ----------------------------------------------------------------- the federation's process

    async def on_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.writer is not None:  # one federation at a time: a second connection is not ours
            writer.close()
            return
        self.reader, self.writer = reader, writer
        self._connected.set()

    async def federations(self) -> None:
        """Start one federation's process after another until stopped or a party is excluded."""
        delay = RESTART_FIRST_S
        while not self.stopping and self.excluded is None:
            served = await self._one_federation()
            if self.stopping or self.excluded is not None:
                return
            if not served and self.process.returncode == USAGE:  # the leader's own files: one line said
                self.usage = True
                return
            delay = RESTART_FIRST_S if served else min(2 * delay, RESTART_CAP_S)
            print(f"vfl party {self.args.name}: serving: a new federation in {delay:g} s", flush=True)
            await asyncio.sleep(delay)

    async def _one_federation(self) -> bool:
        """One federation's process, from its start to its end; whether it served."""
        argv = [*federation_argv(self.args, self.serving), "--link", self.socket_path]
        self.process = await start_federation(argv)
        served = False
        connected = asyncio.ensure_future(self._connected.wait())
        ended = asyncio.ensure_future(self.process.wait())
        await asyncio.wait({connected, ended}, return_when=asyncio.FIRST_COMPLETED)
        if self.reader is not None:
            served = await self._read_link(self.reader)
        try:  # its link closed: it is ending (a process stuck in MPI by then is stopped)
            code = await asyncio.wait_for(asyncio.shield(ended), STOP_GRACE_S)
        except TimeoutError:
            self.process.kill()
            code = await ended
        connected.cancel()
        self._lost(f"the leader's federation process ended (exit code {code})")
        self._connected.clear()
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None
        return served

    async def _read_link(self, reader: asyncio.StreamReader) -> bool:
        served = False
        while True:
            try:
                kind, payload = await wire.read_frame(reader, wire.answer_bytes(self.serving.max_batch,
                                                                                 self.classes))
                if kind == wire.READY:
                    self.classes = wire.classes_of_ready(payload)
            except wire.LinkError:
                return served
            if kind == wire.READY:
                served, self.down = True, None
                print(f"vfl party {self.args.name}: serving: every party joined; the endpoint answers",
                      flush=True)
            elif kind in (wire.SCORES, wire.CLASSES) and self._answer is not None and not self._answer.done():
                self._answer.set_result((kind, payload))
            elif kind in (wire.DOWN, wire.EXCLUDED):
                line = payload.decode("utf-8", "replace")
                if kind == wire.EXCLUDED:
                    self.excluded = line
                self._lost(line if kind == wire.EXCLUDED else
                           f"{line}; serving again once every party has joined a new federation")

    def _lost(self, line: str) -> None:
        """The federation is gone: the endpoint says why (the first line that names a party stays)."""
        if self.down is None or self.down.startswith("the federation is forming"):
            self.down = self.excluded or line
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(FederationDown(self.down))

    async def stop(self) -> None:
        """STOP to the federation's process (every party is told), then wait for it to end."""
        self.stopping = True
        process = getattr(self, "process", None)
        if self.writer is not None and self.down is None:
            self.writer.write(wire.frame(wire.STOP))
        elif process is not None and process.returncode is None:
            process.terminate()  # still joining: nothing to tell the parties
        if process is not None and process.returncode is None:
            try:
                await asyncio.wait_for(process.wait(), STOP_GRACE_S)
            except TimeoutError:
                process.kill()
                await process.wait()


async def start_federation(argv: list[str]) -> asyncio.subprocess.Process:
    """``mpiexec -n 1 python -m mpi4py -m parties.serving.federated argv``, tied to this process
    (:mod:`parties.orphans`); its output passes through."""
    from parties.launch import mpiexec_path
    from parties.orphans import tied_command

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, **mpi_env()}
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [mpiexec_path(), "-n", "1", sys.executable, "-m", "mpi4py", "-m", "parties.serving.federated",
           *argv]
    return await asyncio.create_subprocess_exec(*tied_command(cmd), env=env)


def gate(supervisor: Supervisor):
    """Middleware: 503 with the supervisor's line while no federation serves, before any handler."""

    @web.middleware
    async def federation_gate(request: web.Request, handler):
        if supervisor.down is not None:
            return web.json_response({"error": supervisor.down}, status=503)
        try:
            return await handler(request)
        except FederationDown as err:
            return web.json_response({"error": str(err)}, status=503)

    return federation_gate


def supervise(args: argparse.Namespace, serving: Serving) -> int:
    """The leader's ``vfl party … --serve``: the endpoint until SIGINT/SIGTERM; 1 if a party was
    excluded (after the endpoint said so until stopped)."""
    with tempfile.TemporaryDirectory(prefix="vfl-serve-") as folder:
        return asyncio.run(_serve(args, serving, str(Path(folder) / "front.sock")))


async def _serve(args: argparse.Namespace, serving: Serving, socket_path: str) -> int:
    from vertical.problems import get_problem

    supervisor = Supervisor(args, serving, socket_path)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = await asyncio.start_unix_server(supervisor.on_link, path=socket_path)
    batcher = MicroBatcher(supervisor.score, window=serving.window_ms / 1000, max_rows=serving.max_batch)
    options = serving.job.options
    trained = get_problem(options.problem, lam=options.lam).task or "regression"
    app = build_app(batcher, task=lambda: supervisor.task(trained), parties=len(supervisor.names),
                    on_failure=lambda line: None,
                    window_ms=serving.window_ms, sealed=bool(options.secure_channels))
    app.middlewares.append(gate(supervisor))
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    host, port = serving.http
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as err:
        print(f"vfl party {args.name}: error: cannot listen on {host}:{port}: {err.strerror or err}",
              file=sys.stderr, flush=True)
        return 2
    print(f"vfl party {args.name}: serving: listening on http://{host}:{port} ({len(supervisor.names)} "
          f"parties, window {serving.window_ms:g} ms, batches of up to {serving.max_batch} rows)", flush=True)
    batching = asyncio.create_task(batcher.run())
    federations = asyncio.create_task(supervisor.federations())
    await asyncio.wait({asyncio.ensure_future(stop.wait()), federations}, return_when=asyncio.FIRST_COMPLETED)
    if not stop.is_set() and not supervisor.usage:  # a party was excluded: the endpoint says so until
        await stop.wait()                               # this command is stopped
    await runner.cleanup()
    batching.cancel()
    await supervisor.stop()
    federations.cancel()
    server.close()
    print(f"vfl party {args.name}: serving: stopped after {batcher.batches} batches", flush=True)
    return USAGE if supervisor.usage else 1 if supervisor.excluded else 0
