"""The messages of horizontal FL under MPI: framing, float vectors, and uplinks of packed payloads.

Every message between the server (rank 0) and a client process is one *frame* of up to three blocking
point-to-point sends on one tag, received into buffers of known size (never a ``Probe`` loop: with
more ranks than cores a probe round trip costs milliseconds on this machine, a plain ``Recv`` tens of
microseconds). The header, which a rank may wait for all round, is polled with short sleeps
(:func:`_await`); the meta and body that follow it, with blocking ``Recv``:

    header  int64[3]  (kind, meta byte count, body byte count)
    meta    uint8     UTF-8 JSON of a small dict: ids, keys, lengths, dtypes (skipped when empty)
    body    uint8     the numbers: raw floats or compressors' packed payloads (skipped when empty)

Decisions: control data is JSON, not pickle, so a peer can never make another rank execute code by
sending it a message; arrays always travel as raw bytes in one buffer call. The uplink's body is exactly
the bytes the algorithm's messages are made of: for a compressed message the compressors' payloads
(``protocols.compression.Payload.data``, header included), for a full-precision one the float rows. The
server counts uplink bits as eight times the body bytes it received, which is what the simulation's
ledger counts, so the two agree by construction *and* by measurement.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np
import torch

from horizontal import Message
from protocols.compression import Compressor, Payload
from protocols.liveness import Backoff

TAG = 72
"""The one MPI tag of horizontal-FL traffic (on its own duplicated communicator)."""

SERVER = 0
"""The server's rank; rank p + 1 is client process p."""

WAIT_CAP_S = 2.5e-4
"""The longest sleep between two polls while a rank waits for a frame (a wait overshoots by at most
this: ~1 % of a 0.1 s round for the few waits a round has)."""

FLOAT_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class Kind(IntEnum):
    """What a frame is; a rank that receives a kind it does not expect stops with a clear error."""

    ROUND = 1         # server -> client process: the round's sampled clients (+ downlink if it hosts any)
    UPLINK = 2        # client process -> server: its sampled clients' messages
    REPLY = 3         # server -> participants: server_update's reply (may be empty)
    EVAL = 4          # server -> every client process: evaluate this model on your rows
    EVAL_RESULT = 5   # client process -> server: loss/accuracy sums and row count
    STOP = 6          # server -> every client process: the run is over
    INNER = 7         # client process -> server (FedDRO): its clients' inner estimates y_k, float64 rows
    MODEL = 8         # client process -> server (FedDRO): its clients' models x_k at a model round
    AVERAGE = 9       # server -> every client process (FedDRO): the mean of the rows just sent


class WireError(RuntimeError):
    """A frame that does not follow the protocol (wrong kind, inconsistent lengths)."""


#: frame metadata is small JSON (client ids, layouts, sums): a megabyte holds 100,000 ids
MAX_META_BYTES = 1 << 20


def body_limit(dim: int, vectors: int) -> int:
    """The largest body a frame of ``vectors`` vectors of ``dim`` numbers can need: float64 values, and
    for a compressed message at worst an index beside each value, plus 64 KiB of payload headers. The
    receiver passes it to :func:`recv_frame`, which refuses a larger announcement before allocating."""
    return max(vectors, 0) * max(dim, 0) * 16 + (1 << 16)


@dataclass(frozen=True)
class Frame:
    kind: Kind
    meta: dict[str, Any]
    body: np.ndarray   # uint8, owned by the receiver (fresh buffer per frame)


def send_frame(comm: Any, dest: int, kind: Kind, meta: Mapping[str, Any] | None = None,
               body: np.ndarray | bytes | None = None) -> int:
    """Send one frame to ``dest``; returns the number of body bytes sent."""
    meta_bytes = json.dumps(meta or {}, separators=(",", ":")).encode() if meta else b""
    body_view = np.frombuffer(body, dtype=np.uint8) if isinstance(body, bytes) else body
    body_nbytes = 0 if body_view is None else int(body_view.nbytes)
    comm.Send(np.array([int(kind), len(meta_bytes), body_nbytes], dtype=np.int64), dest=dest, tag=TAG)
    if meta_bytes:
        comm.Send(np.frombuffer(meta_bytes, dtype=np.uint8), dest=dest, tag=TAG)
    if body_nbytes:
        assert body_view is not None
        comm.Send(np.ascontiguousarray(body_view).view(np.uint8).reshape(-1), dest=dest, tag=TAG)
    return body_nbytes


def _await(request: Any) -> None:
    """Wait for a frame to begin without spinning: MPICH's blocking ``Recv`` polls a core until the
    message arrives, and a rank waits for most of a round (the server for its slowest client, a client
    for the next round), which with more ranks than cores takes the CPU from the ranks still computing.
    Polls then sleeps of at most :data:`WAIT_CAP_S` (:class:`protocols.liveness.Backoff`)."""
    backoff = Backoff(cap=WAIT_CAP_S)
    while not request.Test():
        backoff.sleep()


def recv_frame(comm: Any, source: int, expect: Kind | Sequence[Kind], *, max_body: int) -> Frame:
    """Receive the next frame from ``source``; raise :class:`WireError` if its kind is not expected or
    it announces more metadata than :data:`MAX_META_BYTES` or a body over ``max_body`` bytes (what the
    receiver's job can need, :func:`body_limit`): nothing is allocated for a frame before that check."""
    header = np.empty(3, dtype=np.int64)
    _await(comm.Irecv(header, source=source, tag=TAG))
    kind_value, meta_nbytes, body_nbytes = (int(v) for v in header)
    expected = (expect,) if isinstance(expect, Kind) else tuple(expect)
    if kind_value not in {int(k) for k in expected} or not 0 <= meta_nbytes <= MAX_META_BYTES \
            or not 0 <= body_nbytes <= max_body:
        raise WireError(f"rank {source} sent frame kind {kind_value} (meta {meta_nbytes} B, body "
                        f"{body_nbytes} B); expected {' or '.join(k.name for k in expected)} with at most "
                        f"{MAX_META_BYTES} B of meta and {max_body} B of body")
    meta: dict[str, Any] = {}
    if meta_nbytes:
        raw = np.empty(meta_nbytes, dtype=np.uint8)
        comm.Recv(raw, source=source, tag=TAG)
        what = f"rank {source} sent a {Kind(kind_value).name} frame whose meta is not"
        try:
            meta = json.loads(raw.tobytes())
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise WireError(f"{what} JSON") from None
        if not isinstance(meta, dict):
            raise WireError(f"{what} a JSON object")
    body = np.empty(body_nbytes, dtype=np.uint8)
    if body_nbytes:
        comm.Recv(body, source=source, tag=TAG)
    return Frame(Kind(kind_value), meta, body)


# ---------------------------------------------------------------------------------- float vectors


def pack_vectors(vectors: Mapping[str, torch.Tensor]) -> tuple[list[dict[str, Any]], np.ndarray]:
    """Named tensors → (layout, one byte buffer): the downlink and the server's reply."""
    layout, chunks = [], []
    for key, tensor in vectors.items():
        array = tensor.detach().cpu().contiguous().numpy()
        layout.append({"key": key, "dtype": str(array.dtype), "shape": list(array.shape)})
        chunks.append(array.reshape(-1).view(np.uint8))
    return layout, (np.concatenate(chunks) if chunks else np.empty(0, dtype=np.uint8))


def unpack_vectors(layout: Sequence[Mapping[str, Any]], body: np.ndarray) -> dict[str, torch.Tensor]:
    """Inverse of :func:`pack_vectors` (each tensor a fresh copy, never a view of the receive buffer)."""
    out, offset = {}, 0
    for entry in layout:
        dtype = np.dtype(_float_name(entry["dtype"]))
        count = int(np.prod(entry["shape"], dtype=np.int64))
        array = np.frombuffer(body, dtype=dtype, count=count, offset=offset).reshape(entry["shape"])
        out[entry["key"]] = torch.from_numpy(array.copy())
        offset += count * dtype.itemsize
    if offset != body.nbytes:
        raise WireError(f"vector frame: layout accounts for {offset} bytes but the body has {body.nbytes}")
    return out


def _float_name(name: str) -> str:
    if name not in FLOAT_DTYPES:
        raise WireError(f"unsupported float type {name!r} on the wire (float32 or float64)")
    return name


# ------------------------------------------------------------------------------------------ uplink


def encode_uplink(up: Mapping[str, Message], compressor: Compressor | None
                  ) -> tuple[list[dict[str, Any]], bytes]:
    """One client process's uplink as (layout, body): a compressed message as the payloads it carries, a
    full-precision one as its raw float rows. ``compressor`` is the algorithm's uplink codec, the one the
    server will decode with."""
    entries, chunks = [], []
    for key, message in up.items():
        if message.payloads is None:
            rows = message.values.detach().cpu().contiguous().numpy()
            parts = [row.tobytes() for row in rows]
            entry = {"key": key, "compressed": False, "dtype": str(rows.dtype)}
        elif compressor is None:
            raise ValueError(f"uplink message {key!r} is compressed, but the algorithm declares no uplink "
                             "compressor (Algorithm.uplink_compressor) to decode it with")
        else:
            parts = list(message.payloads)
            entry = {"key": key, "compressed": True}
        entries.append(entry | {"nbytes": [len(c) for c in parts]})
        chunks.extend(parts)
    return entries, b"".join(chunks)


def decode_uplink(entries: Sequence[Mapping[str, Any]], body: np.ndarray, compressor: Compressor | None,
                  d: int, dtype: torch.dtype) -> dict[str, Message]:
    """Decode one client process's uplink body into its messages (rows in the order they were sent).

    Everything in ``entries`` comes from another party: the lengths must account for the body exactly,
    every row must decode to ``d`` entries, and a compressed row is decoded only with this side's own
    ``compressor`` (the algorithm's uplink codec), never one the sender names."""
    try:
        sizes_of = [[int(n) for n in e["nbytes"]] for e in entries]
    except (KeyError, TypeError, ValueError):
        raise WireError("uplink: malformed layout (each entry needs a list of row byte counts)") from None
    if any(n < 0 for sizes in sizes_of for n in sizes) or sum(map(sum, sizes_of)) != body.nbytes:
        raise WireError(f"uplink: its layout accounts for {sum(map(sum, sizes_of))} bytes but {body.nbytes} "
                        "arrived")
    messages, offset = {}, 0
    for entry, sizes in zip(entries, sizes_of, strict=True):
        key, rows = str(entry.get("key")), len(sizes)
        if entry.get("compressed") is True:
            if compressor is None:
                raise WireError(f"uplink {key!r} is compressed, but this algorithm sends full precision only")
            starts = offset + np.cumsum([0, *sizes[:-1]])
            chunks = [body[a:a + n].tobytes() for a, n in zip(starts.tolist(), sizes, strict=True)]
            try:
                values = compressor.decompress_batch([Payload(c) for c in chunks])
            except ValueError as err:
                raise WireError(f"uplink {key!r}: {err}") from None
            payloads: tuple[bytes, ...] | None = tuple(chunks)
        else:
            float_type = np.dtype(_float_name(str(entry.get("dtype"))))
            if any(n != d * float_type.itemsize for n in sizes):
                raise WireError(f"uplink {key!r}: rows of {sizes} bytes for d = {d} {float_type}")
            array = np.frombuffer(body, dtype=float_type, count=rows * d, offset=offset).reshape(rows, d)
            values, payloads = torch.from_numpy(array.copy()), None
        if values.shape != (rows, d):
            raise WireError(f"uplink {key!r}: decoded {tuple(values.shape)}, expected ({rows}, {d})")
        messages[key] = Message(values.to(dtype), tuple(8 * n for n in sizes), payloads)
        offset += sum(sizes)
    return messages
