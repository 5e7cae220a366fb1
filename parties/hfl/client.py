"""A client rank (:class:`ClientProcess`): hosts a block of the logical clients, their rows and their
persistent state rows; each round it runs ``client_update`` on those of its clients that were sampled,
sends their messages and keeps the new state rows."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from horizontal import LocalSolver, VectorState
from horizontal.base import Downlink
from horizontal.engine import ClientRound
from parties.hfl.job import _Job
from parties.hfl.round_context import StackBatches, draw_stack_uniforms
from parties.hfl.wire import SERVER, Kind, body_limit, encode_uplink, recv_frame, send_frame, unpack_vectors


class ClientProcess:
    """A client rank: hosts some logical clients, their data and persistent state rows."""

    def __init__(self, job: _Job, store: VectorState) -> None:
        assert job.shard is not None
        self.job = job
        self.shard = job.shard
        self.store = store
        self.generators = [job.streams.compression[i] for i in self.shard.client_ids.tolist()]
        self.took_part_last_round = True   # nothing to catch up before round 0
        #: the largest body the server can need to send it: the model and the hosted clients' state rows
        self.max_body = body_limit(job.d, 4 * max(1, len(self.shard.client_ids)))

    def serve(self) -> None:
        comm = self.job.comm
        while True:
            frame = recv_frame(comm, SERVER, (Kind.ROUND, Kind.EVAL, Kind.STOP), max_body=self.max_body)
            if frame.kind == Kind.STOP:
                return
            if frame.kind == Kind.EVAL:
                self._evaluate(unpack_vectors(frame.meta["vectors"], frame.body)["x"])
            else:
                self._round(frame.meta, frame.body)

    def _round(self, meta: dict[str, Any], body: np.ndarray) -> None:
        job, cfg = self.job, self.job.config
        stack = torch.tensor(meta["clients"], dtype=torch.int64)
        if not self.took_part_last_round:
            for _ in range(int(meta["previous_draws"])):
                draw_stack_uniforms(cfg.per_round, cfg.batch_size, job.streams.data)
        positions = torch.isin(stack, self.shard.client_ids).nonzero().flatten()
        self.took_part_last_round = positions.numel() > 0
        if not self.took_part_last_round:
            return
        clients = stack[positions]
        local = torch.searchsorted(self.shard.client_ids, clients)
        down: Downlink = unpack_vectors(meta["down"], body)
        batches = StackBatches(self.shard.data, positions, stack.numel())
        solver = LocalSolver(job.model, batches, local, cfg.batch_size, cfg.fl, job.streams.data)
        generators = [self.generators[k] for k in local.tolist()]
        ctx = ClientRound(int(meta["round"]), clients, cfg.fl, solver, generators)
        up, states = job.algorithm.client_update(down, self.store.rows(local), ctx)
        entries, uplink = encode_uplink(up, job.algorithm.uplink_compressor())
        send_frame(job.comm, SERVER, Kind.UPLINK,
                   {"clients": clients.tolist(), "draws": batches.draws, "loss": solver.mean_loss,
                    "messages": entries}, uplink)
        reply_frame = recv_frame(job.comm, SERVER, Kind.REPLY, max_body=self.max_body)
        reply = unpack_vectors(reply_frame.meta.get("vectors", []), reply_frame.body)
        if reply:
            states = job.algorithm.client_finish(reply, states, cfg.fl)
        self.store.put_rows(local, states)

    def _evaluate(self, x: torch.Tensor) -> None:
        data = self.shard.data
        rows = int(data.X.shape[0])
        sums = {k: v * rows for k, v in self.job.model.evaluate(x, data.X, data.y).items()}
        send_frame(self.job.comm, SERVER, Kind.EVAL_RESULT, {"rows": rows, "sums": sums})
