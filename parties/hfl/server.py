"""Rank 0 (:class:`Server`): runs the simulation's server step (:class:`horizontal.server.VectorServer`) with
the sampled clients on the client processes (:class:`ClientProcesses`, which only moves buffers: the
downlink out, the uplinks in, checked and stacked in the engine's order, the reply out); evaluates the
model on the client processes' rows and its own test set."""

from __future__ import annotations

import torch

from horizontal import Message, VectorState
from horizontal.base import Downlink, Uplink
from horizontal.server import ClientReport, VectorServer
from parties.hfl.job import _Job
from parties.hfl.wire import Kind, WireError, body_limit, decode_uplink, pack_vectors, recv_frame, send_frame


class Server:
    """Rank 0: the server step of the simulation, the client processes as its clients; evaluates, stops."""

    def __init__(self, job: _Job, state: VectorState, hosts: list[torch.Tensor],
                 test: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.job = job
        self.hosts = hosts          # hosts[p]: the clients of rank p + 1
        self.test = test
        self.core = VectorServer(job.algorithm, state, job.config.fl, job.streams.sampling)
        self.processes = ClientProcesses(job, hosts)

    @property
    def uplink_bits(self) -> int:
        return self.core.uplink_bits

    def step(self) -> dict[str, float]:
        return self.core.step(self.processes)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The server state to save (``model.npz``, the trajectory)."""
        return self.core.state.tensors()

    def evaluate(self) -> dict[str, float]:
        """Training loss/accuracy summed over the client processes' rows; test metrics at the server."""
        comm, x = self.job.comm, self.core.state.x
        layout, body = pack_vectors({"x": x})
        for p in range(len(self.hosts)):
            send_frame(comm, p + 1, Kind.EVAL, {"vectors": layout}, body)
        rows, sums = 0, {}
        for p in range(len(self.hosts)):
            meta = recv_frame(comm, p + 1, Kind.EVAL_RESULT, max_body=0).meta
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


class ClientProcesses:
    """The :class:`~horizontal.server.RoundClients` of an MPI run: each client process trains the sampled
    clients it hosts; a process none of whose clients was sampled gets the round's ids only (to catch up
    on the shared minibatch stream next time it takes part: ``previous_draws``)."""

    def __init__(self, job: _Job, hosts: list[torch.Tensor]) -> None:
        self.job = job
        self.hosts = hosts
        self.compressor = job.algorithm.uplink_compressor()
        self.previous_draws = 0
        self._participants: list[tuple[int, torch.Tensor]] = []

    def train(self, round: int, clients: torch.Tensor, down: Downlink) -> ClientReport:
        layout, down_body = pack_vectors(down)
        meta = {"round": round, "clients": clients.tolist(), "previous_draws": self.previous_draws}
        participants = []
        for p, hosted in enumerate(self.hosts):
            positions = torch.isin(clients, hosted).nonzero().flatten()
            if positions.numel():
                participants.append((p + 1, positions))
                send_frame(self.job.comm, p + 1, Kind.ROUND, meta | {"down": layout}, down_body)
            else:
                send_frame(self.job.comm, p + 1, Kind.ROUND, meta)
        up, uplink_bits, loss_sum, draws = self._collect(clients, participants)
        self._participants = participants
        self.previous_draws = draws
        S = clients.numel()
        return ClientReport(up, uplink_bits, loss_sum / S, draws * S)

    def finish(self, reply: Downlink) -> None:
        layout, body = pack_vectors(reply)
        for rank, _ in self._participants:
            send_frame(self.job.comm, rank, Kind.REPLY, {"vectors": layout} if reply else None, body)
        self._participants = []

    def _collect(self, clients: torch.Tensor, participants: list[tuple[int, torch.Tensor]]
                 ) -> tuple[Uplink, int, float, int]:
        """Receive every participant's uplink; stack the decoded rows in the engine's order; the bits that
        crossed MPI, the summed minibatch loss and the number of minibatch draws."""
        cfg, S = self.job.config, clients.numel()
        values: dict[str, torch.Tensor] = {}
        bits: dict[str, list[int]] = {}
        payloads: dict[str, list[bytes] | None] = {}
        uplink_bits, loss_sum, draws = 0, 0.0, set()
        for rank, positions in participants:
            frame = recv_frame(self.job.comm, rank, Kind.UPLINK,
                               max_body=body_limit(self.job.d, 4 * len(positions)))  # its clients' messages
            if frame.meta["clients"] != clients[positions].tolist():
                raise WireError(f"rank {rank} answered for clients {frame.meta['clients']}, expected "
                                f"{clients[positions].tolist()}")
            uplink_bits += 8 * int(frame.body.nbytes)   # the bytes that crossed MPI
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
        return up, uplink_bits, loss_sum, draws.pop()

