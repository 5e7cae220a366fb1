"""Rank 0 (:class:`Server`): samples the clients, sends the downlink, decodes the uplinks, runs
``server_update`` and replies; evaluates the model on the client processes' rows and its own test set."""

from __future__ import annotations

import time

import torch

from parties.hfl.job import _Job
from parties.hfl.wire import Kind, WireError, decode_uplink, pack_vectors, recv_frame, send_frame
from vfl.hfl import Message, VectorState
from vfl.hfl.base import Uplink, wire_bits


class Server:
    """Rank 0: samples clients, talks to the client processes, aggregates, evaluates, logs."""

    def __init__(self, job: _Job, state: VectorState, hosts: list[torch.Tensor],
                 test: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.job = job
        self.state = state
        self.hosts = hosts          # hosts[p]: the clients of rank p + 1
        self.test = test
        self.compressor = job.algorithm.uplink_compressor()
        self.round = 0
        self.uplink_bits = 0
        self.downlink_bits = 0
        self.previous_draws = 0

    def sample_clients(self) -> torch.Tensor:
        """The engine's sampling: S distinct clients from the sampling stream, in increasing id order."""
        cfg = self.job.config
        perm = torch.randperm(cfg.clients, generator=self.job.streams.sampling)
        return perm[: cfg.per_round].sort().values

    def step(self) -> dict[str, float]:
        started = time.perf_counter()
        job, cfg = self.job, self.job.config
        clients = self.sample_clients()
        S = clients.numel()
        down = job.algorithm.broadcast(self.state)
        layout, down_body = pack_vectors(down)
        self.downlink_bits += S * sum(wire_bits(v) for v in down.values())
        participants = []
        for p, hosted in enumerate(self.hosts):
            positions = torch.isin(clients, hosted).nonzero().flatten()
            meta = {"round": self.round, "clients": clients.tolist(), "previous_draws": self.previous_draws}
            if positions.numel():
                participants.append((p + 1, positions))
                send_frame(job.comm, p + 1, Kind.ROUND, meta | {"down": layout}, down_body)
            else:
                send_frame(job.comm, p + 1, Kind.ROUND, meta)
        up, loss_sum, draws = self._collect(clients, participants)
        self.state, reply = job.algorithm.server_update(self.state, up, cfg.fl)
        reply_layout, reply_body = pack_vectors(reply)
        if reply:
            self.downlink_bits += S * sum(wire_bits(v) for v in reply.values())
        for rank, _ in participants:
            send_frame(job.comm, rank, Kind.REPLY, {"vectors": reply_layout} if reply else None, reply_body)
        self.previous_draws = draws
        self.round += 1
        self._check_finite()
        return {"round": self.round, "local_loss": loss_sum / S, "uplink_bits": self.uplink_bits,
                "downlink_bits": self.downlink_bits, "round_seconds": time.perf_counter() - started}

    def _collect(self, clients: torch.Tensor, participants: list[tuple[int, torch.Tensor]]
                 ) -> tuple[Uplink, float, int]:
        """Receive every participant's uplink; stack the decoded rows in the engine's order."""
        cfg, S = self.job.config, clients.numel()
        values: dict[str, torch.Tensor] = {}
        bits: dict[str, list[int]] = {}
        payloads: dict[str, list[bytes] | None] = {}
        loss_sum, draws = 0.0, set()
        for rank, positions in participants:
            frame = recv_frame(self.job.comm, rank, Kind.UPLINK)
            if frame.meta["clients"] != clients[positions].tolist():
                raise WireError(f"rank {rank} answered for clients {frame.meta['clients']}, expected "
                                f"{clients[positions].tolist()}")
            self.uplink_bits += 8 * int(frame.body.nbytes)
            parts = decode_uplink(frame.meta["messages"], frame.body, self.compressor, self.job.d,
                                  cfg.torch_dtype)
            if values and parts.keys() != values.keys():
                raise WireError(f"rank {rank} sent messages {sorted(parts)}, others sent {sorted(values)}")
            for key, part in parts.items():
                if part.values.shape[0] != positions.numel():
                    raise WireError(f"rank {rank} sent {part.values.shape[0]} rows of {key!r} for "
                                    f"{positions.numel()} clients")
                if key not in values:
                    values[key] = part.values.new_empty((S, part.values.shape[1]))
                    bits[key] = [0] * S
                    payloads[key] = None if part.payloads is None else [b""] * S
                values[key][positions] = part.values
                row_payloads = payloads[key]
                if (row_payloads is None) != (part.payloads is None):
                    raise WireError(f"rank {rank} sent {key!r} {'un' * (part.payloads is None)}compressed, "
                                    "unlike the other client processes")
                for k, j in enumerate(positions.tolist()):
                    bits[key][j] = part.bits[k]
                    if row_payloads is not None and part.payloads is not None:
                        row_payloads[j] = part.payloads[k]
            loss_sum += float(frame.meta["loss"]) * positions.numel()
            draws.add(int(frame.meta["draws"]))
        if len(draws) != 1:
            raise WireError(f"client processes drew different numbers of minibatches this round ({draws}): "
                            "the algorithm's local work must not depend on which clients a process hosts")
        up = {k: Message(v, tuple(bits[k]), None if payloads[k] is None else tuple(payloads[k] or ()))
              for k, v in values.items()}
        return up, loss_sum, draws.pop()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The server state to save (``model.npz``, the trajectory)."""
        return self.state.tensors()

    def evaluate(self) -> dict[str, float]:
        """Training loss/accuracy summed over the client processes' rows; test metrics at the server."""
        comm, x = self.job.comm, self.state.x
        layout, body = pack_vectors({"x": x})
        for p in range(len(self.hosts)):
            send_frame(comm, p + 1, Kind.EVAL, {"vectors": layout}, body)
        rows, sums = 0, {}
        for p in range(len(self.hosts)):
            meta = recv_frame(comm, p + 1, Kind.EVAL_RESULT).meta
            rows += int(meta["rows"])
            for k, v in meta["sums"].items():
                sums[k] = sums.get(k, 0.0) + float(v)
        out = {f"train_{k}": v / rows for k, v in sums.items()}
        if self.test is not None:
            out |= {f"test_{k}": v for k, v in self.job.model.evaluate(x, *self.test).items()}
        return out

    def stop(self) -> None:
        for p in range(len(self.hosts)):
            send_frame(self.job.comm, p + 1, Kind.STOP)

    def _check_finite(self) -> None:
        for name, tensor in self.state.tensors().items():
            if not bool(torch.isfinite(tensor).all()):
                cfg = self.job.config
                raise FloatingPointError(
                    f"{cfg.algorithm}: server state '{name}' became non-finite at round {self.round} "
                    f"(diverged): lower --lr-local={cfg.lr_local} or --lr-global={cfg.lr_global}")
