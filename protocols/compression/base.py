"""The compressor interface: ``compress(x, generator) -> Payload`` and ``decompress(payload) -> x̂``.

A compressor here is a *codec*: its message is a real byte string, and ``Payload.nbits`` is
``8 * len(data)``, the size of what would be sent, never a formula. Every message starts with the same
6-byte header, so a payload can be decoded alone:

    byte 0      codec id (which compressor wrote it; decoding checks it)
    byte 1      flags: bit 0 = values are float64 (else float32); bits 1-2 = codec variant
    bytes 2-5   d, the vector length, uint32 little-endian

The codec's parameters (r, bits, groups, ...) are not sent: both ends of a link are configured with the
same compressor object, as with any agreed codec.

Decisions (the papers are silent):
- Floats travel in the input's float type: float32 input → 32-bit values on the wire (the papers'
  setting), float64 input → 64-bit values. No codec adds rounding beyond its own, so float64
  equivalence tests stay exact, and a float64 run honestly pays 64 bits per value.
- Randomness comes only from the ``torch.Generator`` passed in, one per client, so the compressors of
  different clients are independent (SCALLION's Theorem 1 needs that) and runs are reproducible.
- ``compress_batch`` / ``decompress_batch`` / ``roundtrip_batch`` handle the rows of ``[S, d]`` with the
  same code path as ``compress`` (a single row is a batch of one), so they consume each generator exactly
  as ``compress`` would and give bit-identical results; the round trip still goes through the bytes, so
  the wire format is exercised every round.
"""

from __future__ import annotations

import numbers
import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_HEADER = struct.Struct("<BBI")
HEADER_NBYTES = _HEADER.size
_FLOAT64_FLAG = 0b1
_VARIANT_SHIFT = 1
_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True, slots=True)
class Payload:
    """One compressed message: the bytes that cross the wire."""

    data: bytes

    @property
    def nbits(self) -> int:
        """The message's size in bits: eight per byte actually sent (header included)."""
        return 8 * len(self.data)


@dataclass(frozen=True, slots=True)
class Header:
    """The decoded common header of a payload."""

    codec_id: int
    variant: int
    dtype: torch.dtype
    d: int


def write_header(codec_id: int, dtype: torch.dtype, d: int, variant: int = 0) -> bytes:
    """The 6-byte header that opens every message."""
    flags = (_FLOAT64_FLAG if dtype == torch.float64 else 0) | (variant << _VARIANT_SHIFT)
    return _HEADER.pack(codec_id, flags, d)


def read_header(data: bytes) -> Header:
    """Parse the common header; a too-short message is a clear error, not a struct traceback."""
    if len(data) < HEADER_NBYTES:
        raise ValueError(f"payload of {len(data)} bytes is shorter than the {HEADER_NBYTES}-byte header")
    codec_id, flags, d = _HEADER.unpack_from(data)
    dtype = torch.float64 if flags & _FLOAT64_FLAG else torch.float32
    return Header(codec_id=codec_id, variant=flags >> _VARIANT_SHIFT, dtype=dtype, d=d)


def expect_nbytes(body: memoryview, nbytes: int, what: str) -> None:
    """Reject a body whose length does not match what this codec's configuration implies."""
    if len(body) != nbytes:
        raise ValueError(f"corrupt or foreign payload: {what} expects a {nbytes}-byte body, "
                         f"got {len(body)} bytes (was it written by a differently configured codec?)")


def is_real(value: object) -> bool:
    """A real number parameter (int, float or numpy scalar), excluding bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value: object) -> bool:
    """An integer parameter (int or numpy integer), excluding bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_rows(X: torch.Tensor) -> torch.Tensor:
    """Validate a ``[S, d]`` batch at the public edge; returns it contiguous.

    The finiteness test rides on each row's sum of squares (one cheap pass): NaN and inf always reach
    it. Only when a sum is not finite is the exact (slower) element test run, so a finite vector whose
    squared norm merely overflows is still accepted here. The sums are numpy's single-threaded
    ``einsum``: a torch reduction over ``[S, d]`` runs on torch's OpenMP threads, whose barriers spin
    for milliseconds whenever other processes hold the cores.
    """
    if not isinstance(X, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(X).__name__}")
    if X.dtype not in _DTYPES:
        raise ValueError(f"expected a float32 or float64 tensor, got {X.dtype}")
    if X.device.type != "cpu":
        raise ValueError(f"compressors run on CPU tensors, got device {X.device}")
    if X.shape[-1] == 0:
        raise ValueError("cannot compress an empty vector")
    if X.shape[-1] >= 2**32:
        raise ValueError(f"vector length {X.shape[-1]} does not fit the uint32 header")
    rows = X.detach().numpy()
    if not np.isfinite(np.einsum("ij,ij->i", rows, rows)).all() and not bool(torch.isfinite(X).all()):
        raise ValueError("cannot compress a vector with NaN or infinite entries")
    return X.contiguous()


def row_norms(X: torch.Tensor, ord: float = 2.0) -> torch.Tensor:
    """The norm of each row, computed row by row.

    A reduction over ``[S, d]`` may split the sum differently from one over ``[1, d]``, so a batched
    norm can differ in the last bit from the single-row one; codecs that send a norm use this so that
    ``roundtrip_batch`` stays bit-identical to ``compress`` row by row.
    """
    return torch.stack([torch.linalg.vector_norm(row, ord=ord) for row in X])


class Compressor(ABC):
    """A compression operator C: R^d → R^d with a real wire format.

    Class attributes say what theory may assume: ``unbiased`` (E[C(x)] = x, with variance bound
    ``omega(d)``), ``contractive`` (E‖C(x) − x‖² ≤ ``q2(d)``·‖x‖²), ``randomized`` (needs a generator).
    """

    codec_id: int
    unbiased: bool
    contractive: bool
    randomized: bool

    def omega(self, d: int) -> float:
        """Variance bound ω of an unbiased compressor: E‖C(x) − x‖² ≤ ω‖x‖² for x ∈ R^d."""
        raise ValueError(f"{self!r} is biased: it has no variance bound ω (use q2 if it is contractive)")

    def q2(self, d: int) -> float:
        """Contraction q² of a contractive compressor: E‖C(x) − x‖² ≤ q²‖x‖² for x ∈ R^d."""
        raise ValueError(f"{self!r} is not contractive: use q2 of a contractive compressor, or wrap an "
                         "unbiased one in ScaledUnbiased (C(x)/(1+ω) has q² = ω/(1+ω))")

    def compress(self, x: torch.Tensor, generator: torch.Generator | None = None) -> Payload:
        """Encode a 1-D float tensor into one message (uses only ``generator`` for randomness)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 1:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"compress expects a 1-D tensor, got {shape}")
        X = check_rows(x.reshape(1, -1))
        return self._compress_rows(X, self._check_generators([generator], 1))[0]

    def decompress(self, payload: Payload) -> torch.Tensor:
        """Decode one message into a tensor of the original length and float type."""
        header, body = self._open(payload)
        return self._decompress_rows([header.variant], [body], header.d, header.dtype)[0]

    def decompress_bytes(self, data: bytes) -> torch.Tensor:
        """Decode one message from the bytes that arrived (a ValueError if they are not this codec's)."""
        return self.decompress(Payload(bytes(data)))

    def compress_batch(self, X: torch.Tensor, generators: Sequence[torch.Generator | None] | None = None
                       ) -> list[Payload]:
        """``compress(X[s], generators[s])`` for every row of ``[S, d]``, vectorised across rows."""
        if not isinstance(X, torch.Tensor) or X.dim() != 2 or X.shape[0] == 0:
            shape = tuple(X.shape) if isinstance(X, torch.Tensor) else type(X).__name__
            raise ValueError(f"a batch must be a [S, d] tensor with S >= 1, got {shape}")
        X = check_rows(X)
        return self._compress_rows(X, self._check_generators(generators, X.shape[0]))

    def decompress_batch(self, payloads: Sequence[Payload]) -> torch.Tensor:
        """Decode S messages of one length and float type (e.g. one round's uplinks) into ``[S, d]``."""
        if not payloads:
            raise ValueError("decompress_batch needs at least one payload")
        opened = [self._open(p) for p in payloads]
        first = opened[0][0]
        if any((h.d, h.dtype) != (first.d, first.dtype) for h, _ in opened):
            raise ValueError("payloads of one batch must share their length d and float type")
        return self._decompress_rows([h.variant for h, _ in opened], [b for _, b in opened], first.d,
                                     first.dtype)

    def roundtrip_batch(self, X: torch.Tensor, generators: Sequence[torch.Generator | None] | None = None
                        ) -> tuple[torch.Tensor, list[int]]:
        """``decompress(compress(X[s], generators[s]))`` for every row, and each message's bit count.

        Identical to the row-by-row calls (same generator consumption), vectorised across rows.
        """
        payloads = self.compress_batch(X, generators)
        return self.decompress_batch(payloads), [p.nbits for p in payloads]

    @abstractmethod
    def _compress_rows(self, X: torch.Tensor, generators: list[torch.Generator | None]) -> list[Payload]:
        """Encode each row of a validated, contiguous ``[S, d]`` tensor into its own message."""

    @abstractmethod
    def _decompress_rows(self, variants: list[int], bodies: list[memoryview], d: int,
                         dtype: torch.dtype) -> torch.Tensor:
        """Decode the bodies (header stripped) of S messages into a ``[S, d]`` tensor."""

    def _check_generators(self, generators: Sequence[torch.Generator | None] | None, rows: int
                          ) -> list[torch.Generator | None]:
        if generators is None:
            generators = [None] * rows
        generators = list(generators)
        if len(generators) != rows:
            raise ValueError(f"need one generator per row: got {len(generators)} for {rows} rows")
        if self.randomized and not all(isinstance(g, torch.Generator) for g in generators):
            raise ValueError(f"{self!r} is randomized: pass a torch.Generator per message (one stream per "
                             "client keeps the clients' compressors independent)")
        return generators

    def _open(self, payload: Payload) -> tuple[Header, memoryview]:
        if not isinstance(payload, Payload):
            raise ValueError(f"expected a Payload, got {type(payload).__name__}")
        header = read_header(payload.data)
        if header.codec_id != self.codec_id:
            raise ValueError(f"payload was written by codec id {header.codec_id}, not by {self!r} "
                             f"(codec id {self.codec_id})")
        return header, memoryview(payload.data)[HEADER_NBYTES:]
