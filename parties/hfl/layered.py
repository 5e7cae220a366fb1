"""The layered backbone under MPI (``--model cnn``: FedBAT and its post-training baselines): the server rank
and the client processes of :class:`horizontal.layered.FederatedCNN`'s round, with the same trajectory.

One round:

    server: sample S clients → ROUND to every client process (the sampled ids; the global state too if it
            hosts one of them) → UPLINK from each participant → decode, aggregate, count
            (:class:`horizontal.layered.LayeredServer`, the simulation's own code)
    client process: for each sampled client in id order, train it if hosted (``Method.client``) or replay
            its draws from the shared minibatch stream if not; send the hosted clients' packed messages
            and BN tensors

Randomness as in the simulation: the server draws the sampling stream; each client's binarization and
compression noise comes from its own stream, held by its process only; the minibatch stream is shared by
the sampled clients in turn (E permutations of n_k rows each), so every process keeps a replica and, for a
client hosted elsewhere, draws the same permutations without training (:meth:`LocalTrainer.skip`). That
needs every client's n_k on every process: the server gathers them once at start and broadcasts them.

Everything a rank receives is checked against what it expects before it is used: the state and the BN
tensors against its own model's layout (names, shapes, dtypes known locally, never taken from the sender),
each payload by the method's decoder (its exact length for the layers), the decoded numbers for
finiteness, the per-client diagnostics for type and size. A violation ends the job naming the rank.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from horizontal.engine import Streams
from horizontal.layered import (
    LayeredServer,
    LocalTrainer,
    Method,
    ModelLayout,
    State,
    Upload,
    evaluate_state,
)
from horizontal.rounds import sample_clients
from parties.config import ConfigError
from parties.hfl.client_files import Shard
from parties.hfl.config import HflConfig
from parties.hfl.wire import SERVER, Kind, WireError, body_limit, recv_frame, send_frame

MAX_INFO_KEYS = 16
MAX_INFO_VALUES = 4096
MAX_CLIENT_ROWS = 2**40


# ------------------------------------------------------------------------------ state on the wire


def pack_state(state: Mapping[str, torch.Tensor], names: Sequence[str]) -> bytes:
    """The tensors ``names`` of ``state``, raw bytes in that order (the receiver knows the layout)."""
    return b"".join(state[n].detach().contiguous().numpy().tobytes() for n in names)


def unpack_state(data: bytes | np.ndarray, template: Mapping[str, torch.Tensor], what: str) -> State:
    """Inverse of :func:`pack_state` against this rank's own ``template`` (names, shapes, dtypes): the
    length must match exactly and every float entry must be finite."""
    buffer = memoryview(data).cast("B")
    expected = sum(t.numel() * t.element_size() for t in template.values())
    if buffer.nbytes != expected:
        raise WireError(f"{what}: {buffer.nbytes} bytes where the model's tensors take {expected}")
    out, offset = {}, 0
    for name, like in template.items():
        nbytes = like.numel() * like.element_size()
        array = np.frombuffer(buffer[offset:offset + nbytes], dtype=_numpy_dtype(like)).reshape(like.shape)
        tensor = torch.from_numpy(array.copy())
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise WireError(f"{what}: tensor {name!r} has non-finite entries")
        out[name] = tensor
        offset += nbytes
    return out


def _numpy_dtype(tensor: torch.Tensor) -> np.dtype[Any]:
    return torch.empty(0, dtype=tensor.dtype).numpy().dtype


# ------------------------------------------------------------------------------------ client sizes


def share_client_sizes(comm: Any, hosts: Sequence[Sequence[int] | None], shard: Shard | None,
                       n_clients: int) -> np.ndarray:
    """Every client's row count n_k ``[N]`` on every rank: a buffer ``Gatherv`` to the server (which knows
    from ``hosts`` how many ids each rank sent and checks every count), then one ``Bcast``. A client
    process checks the broadcast against its own clients."""
    rank = comm.Get_rank()
    sizes = np.zeros(n_clients, dtype=np.int64)
    if rank != SERVER:
        assert shard is not None
        own = np.asarray(shard.data.sizes, dtype=np.int64)
        comm.Gatherv(own, None, root=SERVER)
    else:
        counts = [len(h or []) for h in hosts]
        received = np.empty(sum(counts), dtype=np.int64)
        comm.Gatherv(np.zeros(0, dtype=np.int64), [received, counts], root=SERVER)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        for source, ids in enumerate(hosts):
            part = received[offsets[source]:offsets[source + 1]]
            if part.size and not bool(((part >= 1) & (part <= MAX_CLIENT_ROWS)).all()):
                raise ConfigError(f"rank {source} says its clients hold {part.tolist()} rows "
                                  "(each needs 1 or more)")
            sizes[np.asarray(ids or [], dtype=np.int64)] = part
    comm.Bcast(sizes, root=SERVER)
    if rank != SERVER:
        assert shard is not None
        if not np.array_equal(sizes[shard.client_ids.numpy()], own) or not bool((sizes >= 1).all()):
            raise WireError("the server broadcast client sizes that contradict this process's own clients")
    return sizes


# ------------------------------------------------------------------------------------------ client


class LayeredClientProcess:
    """A client rank of the layered backbone: trains its sampled clients, replays the others' draws."""

    def __init__(self, comm: Any, config: HflConfig, method: Method, trainer: LocalTrainer, shard: Shard,
                 streams: Streams, sizes: np.ndarray, template: State) -> None:
        self.comm = comm
        self.config = config
        self.method = method
        self.trainer = trainer
        self.hosted = {int(k): j for j, k in enumerate(shard.client_ids.tolist())}
        self.streams = streams
        self.sizes = sizes
        self.template = template
        self.extras = ModelLayout.of(trainer.model).extras
        #: the largest global state the server can send: every tensor of the model's state
        self.max_body = body_limit(sum(t.numel() for t in template.values()), 1)

    def serve(self) -> None:
        while True:
            frame = recv_frame(self.comm, SERVER, (Kind.ROUND, Kind.STOP), max_body=self.max_body)
            if frame.kind == Kind.STOP:
                return
            self._round(frame.meta, frame.body)

    def _round(self, meta: Mapping[str, Any], body: np.ndarray) -> None:
        clients = _sampled_clients(meta.get("clients"), self.config)
        mine = [k for k in clients if k in self.hosted]
        state = unpack_state(body, self.template, "the server's global state") if mine else None
        if not mine and body.nbytes:
            raise WireError("the server sent a global state to a process none of whose clients was sampled")
        uploads: list[Upload] = []
        for k in clients:
            if k in self.hosted:
                assert state is not None
                uploads.append(self.method.client(self.trainer, state, self.hosted[k], self.streams.data,
                                                  self.streams.compression[k]))
            else:
                self.trainer.skip(int(self.sizes[k]), self.streams.data)
        if not mine:
            return
        entries = [{"nbytes": len(u.payload), "loss": u.mean_loss, "info": u.info} for u in uploads]
        chunks = [part for u in uploads for part in (u.payload, pack_state(u.extras, self.extras))]
        send_frame(self.comm, SERVER, Kind.UPLINK, {"clients": mine, "uploads": entries}, b"".join(chunks))


def _sampled_clients(value: object, config: HflConfig) -> list[int]:
    """The round's sampled ids as the server sent them: S distinct ids in [0, N), increasing."""
    if (not isinstance(value, list) or len(value) != config.per_round
            or not all(isinstance(k, int) and 0 <= k < config.clients for k in value)
            or any(a >= b for a, b in itertools.pairwise(value))):
        raise WireError(f"the server's round names clients {value!r}: expected {config.per_round} "
                        f"increasing ids in [0, {config.clients})")
    return value


# ------------------------------------------------------------------------------------------ server


class LayeredServerRank:
    """Rank 0 of the layered backbone: samples, sends the state, checks and decodes the uplinks, and runs
    the simulation's :class:`~horizontal.layered.LayeredServer` on them."""

    def __init__(self, comm: Any, config: HflConfig, method: Method, model: nn.Module, streams: Streams,
                 hosts: Sequence[Sequence[int]], sizes: np.ndarray,
                 test: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        layout = ModelLayout.of(model)
        self.comm = comm
        self.config = config
        self.model = model
        self.streams = streams
        self.hosts = [set(h) for h in hosts]       # hosts[p]: the clients of rank p + 1
        self.test = test
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self._state_size = sum(t.numel() for t in state.values())  # an uplink's bound: body_limit
        self.core = LayeredServer(method, state, layout.names, layout.shapes)
        self.extras_template = {n: state[n] for n in layout.extras}
        self.input_shape = tuple(model.input_shape)  # type: ignore[arg-type]
        self.sizes = sizes

    @property
    def uplink_bits(self) -> int:
        return self.core.uplink_bits

    def tensors(self) -> State:
        return self.core.state

    def step(self) -> dict[str, Any]:
        started = time.perf_counter()
        clients = sample_clients(self.config.clients, self.config.per_round, self.streams.sampling).tolist()
        state = pack_state(self.core.state, list(self.core.state))
        participants = []
        for p, hosted in enumerate(self.hosts):
            mine = [k for k in clients if k in hosted]
            send_frame(self.comm, p + 1, Kind.ROUND, {"round": self.core.round, "clients": clients},
                       state if mine else None)
            if mine:
                participants.append((p + 1, mine))
        uploads: dict[int, Upload] = {}
        updates: dict[int, list[torch.Tensor]] = {}
        for rank, mine in participants:
            frame = recv_frame(self.comm, rank, Kind.UPLINK,
                               max_body=body_limit(self._state_size, 4 * len(mine)))
            try:
                for k, upload, update in self._read_uplink(frame.meta, frame.body, mine):
                    uploads[k], updates[k] = upload, update
            except (ValueError, TypeError, KeyError, WireError) as err:
                raise WireError(f"client process rank {rank} sent an invalid uplink: {err}") from None
        return self.core.finish([uploads[k] for k in clients], started, [updates[k] for k in clients])

    def _read_uplink(self, meta: Mapping[str, Any], body: np.ndarray, expected: list[int]
                     ) -> list[tuple[int, Upload, list[torch.Tensor]]]:
        if meta.get("clients") != expected:
            raise WireError(f"answered for clients {meta.get('clients')!r}, expected {expected}")
        entries = meta.get("uploads")
        if not isinstance(entries, list) or len(entries) != len(expected):
            raise WireError(f"{len(expected)} uploads expected")
        extras_nbytes = sum(t.numel() * t.element_size() for t in self.extras_template.values())
        payload_nbytes = [int(e["nbytes"]) for e in entries]
        if min(payload_nbytes) < 0 or sum(payload_nbytes) + len(entries) * extras_nbytes != body.nbytes:
            raise WireError(f"its layout does not account for the {body.nbytes} bytes that arrived")
        out, offset = [], 0
        for k, entry, nbytes in zip(expected, entries, payload_nbytes, strict=True):
            payload = body[offset:offset + nbytes].tobytes()
            offset += nbytes
            extras = unpack_state(body[offset:offset + extras_nbytes], self.extras_template,
                                  f"client {k}'s BN tensors")
            offset += extras_nbytes
            update = self.core.method.decode(payload, self.core.shapes)
            if not all(bool(torch.isfinite(u).all()) for u in update):
                raise WireError(f"client {k}'s update decodes to non-finite numbers")
            upload = Upload(payload, extras, int(self.sizes[k]), float(entry["loss"]),
                            _info(entry.get("info")))
            out.append((k, upload, update))
        infos = {tuple((key, len(v)) for key, v in u.info.items()) for _, u, _ in out}
        if len(infos) != 1:
            raise WireError("its clients' diagnostics differ in keys or lengths")
        return out

    def evaluate(self) -> dict[str, float]:
        if self.test is None:
            return {}
        return evaluate_state(self.model, self.core.state, *self.test, self.input_shape)

    def stop(self) -> None:
        for p in range(len(self.hosts)):
            send_frame(self.comm, p + 1, Kind.STOP)


def _info(value: object) -> dict[str, list[float]]:
    """A client's per-layer diagnostics (α, α', saturation): a small dict of short lists of numbers."""
    if not isinstance(value, dict) or len(value) > MAX_INFO_KEYS:
        raise WireError("diagnostics must be a small dict")
    out = {}
    for key, numbers in value.items():
        if not isinstance(numbers, list) or len(numbers) > MAX_INFO_VALUES:
            raise WireError(f"diagnostic {key!r} must be a short list of numbers")
        converted = [float(v) for v in numbers if isinstance(v, int | float) and not isinstance(v, bool)]
        if len(converted) != len(numbers) or not all(math.isfinite(v) for v in converted):
            raise WireError(f"diagnostic {key!r} must hold finite numbers")
        out[str(key)] = converted
    return out
