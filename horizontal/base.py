"""The contract between a horizontal-FL algorithm and the simulation engine.

An algorithm is one class with four steps, all written for the *stack* of clients sampled this round
(row ``j`` of every ``[S, d]`` tensor belongs to client ``ctx.clients[j]``), so one call does the work of
all S clients at once and an MPI client rank can call the same code with a stack of one:

``init``           builds the server state and the persistent per-client state (``[N, d]`` tensors);
``broadcast``      what the server sends down to every sampled client (full precision);
``client_update``  local training plus the uplink messages and the sampled clients' new state;
``server_update``  aggregation; may return a *reply* to the round's participants (FedCOMGATE needs the
                   aggregated update), which ``client_finish`` then folds into their state.

Why this split: it is exactly the message flow of one round, so uplink/downlink bits are counted where the
messages are made, and ISCA (an extra gradient via ``ctx.solver.gradient``), ISCAM (two compressed
messages), FedPAQ (FedAvg with ``ctx.compress``) are each one small file on it.

Flattened parameter vectors are the currency (x, c, c_i, e_i, v_i ∈ R^d). Hyper-parameters every
algorithm shares (η_l, η_g, K, N, S) live in :class:`FLConfig`; the rest (α, β, compressors) are
constructor arguments of the algorithm.

Bits on the wire: a full-precision vector costs its float width per entry (32 bits in float32 runs, the
papers' setting; 64 in float64 runs, as ``protocols.compression`` also sends float64 values); a compressed
one costs the compressor's real packed payload.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar, runtime_checkable

import torch


def wire_bits(values: torch.Tensor) -> int:
    """Bits to send ``values`` uncompressed: their float width times their number of entries."""
    return 8 * values.element_size() * values.numel()


class Packed(Protocol):
    """One client's compressed message as it crosses the wire (``protocols.compression.Payload``)."""

    data: bytes

    @property
    def nbits(self) -> int: ...


@runtime_checkable
class Compressor(Protocol):
    """What an algorithm needs from a compressor (``protocols.compression`` provides them; ``vfl`` must
    not import ``protocols``, so compressors are injected and typed by this protocol)."""

    unbiased: bool

    def compress_batch(self, X: torch.Tensor, generators: Sequence[torch.Generator]) -> Sequence[Packed]:
        """Compress each row of ``X`` with its own generator into its own message."""
        ...

    def decompress_batch(self, payloads: Sequence[Packed]) -> torch.Tensor:
        """Decode S messages into the ``[S, d]`` rows a receiver sees."""
        ...


def check_compressor(compressor: object, algorithm: str) -> Compressor:
    """Validate an injected compressor at the public edge (a clear error instead of a late AttributeError)."""
    if not isinstance(compressor, Compressor):
        raise TypeError(f"{algorithm}: compressor must have `unbiased`, `compress_batch(X, generators)` and "
                        "`decompress_batch(payloads)`"
                        f" (e.g. protocols.compression.get_compressor(...)); got {type(compressor).__name__}")
    return compressor


@dataclass(frozen=True)
class FLConfig:
    """Shared round hyper-parameters: N clients, S sampled per round, K local steps, step sizes."""

    n_clients: int
    clients_per_round: int
    local_steps: int
    lr_local: float
    lr_global: float = 1.0

    def __post_init__(self) -> None:
        if self.n_clients < 1:
            raise ValueError(f"n_clients must be >= 1, got {self.n_clients}")
        if not 1 <= self.clients_per_round <= self.n_clients:
            raise ValueError(f"clients_per_round must be in [1, n_clients={self.n_clients}], "
                             f"got {self.clients_per_round}")
        if self.local_steps < 1:
            raise ValueError(f"local_steps must be >= 1, got {self.local_steps}")
        for name in ("lr_local", "lr_global"):
            value = getattr(self, name)
            if not (value > 0 and value < float("inf")):
                raise ValueError(f"{name} must be a positive finite number, got {value}")

    @property
    def effective_step(self) -> float:
        """γ = η_g·η_l·K, the server step of the SCAFFOLD family (the SCAFCOM paper's Appendix B)."""
        return self.lr_global * self.lr_local * self.local_steps


@dataclass(frozen=True)
class Message:
    """One uplink vector per sampled client: the rows the server decodes ``[S, d]``, the bits each client
    sent and, for a compressed message, each client's payload as it crosses the wire (``None``: the rows
    travel as raw floats). A deployment sends ``payloads`` as they are; the receiver decodes them with
    the algorithm's :meth:`Algorithm.uplink_compressor`."""

    values: torch.Tensor
    bits: tuple[int, ...]
    payloads: tuple[bytes, ...] | None = None

    @classmethod
    def full_precision(cls, values: torch.Tensor) -> Message:
        """An uncompressed message: each row costs its float width per entry."""
        return cls(values, (wire_bits(values[0]),) * values.shape[0])

    @classmethod
    def compressed(cls, compressor: Compressor, X: torch.Tensor, generators: Sequence[torch.Generator]
                   ) -> Message:
        """Row j of ``X`` compressed with ``generators[j]``: the decoded rows (on ``X``'s device and
        float type), the payloads and their real sizes. Codecs run on the CPU."""
        payloads = compressor.compress_batch(X.cpu(), generators)
        decoded = compressor.decompress_batch(payloads)
        if decoded.shape != X.shape or len(payloads) != X.shape[0]:
            raise ValueError(f"compressor {compressor!r} returned shape {tuple(decoded.shape)} "
                             f"and {len(payloads)} payloads for input {tuple(X.shape)}")
        return cls(decoded.to(device=X.device, dtype=X.dtype), tuple(int(p.nbits) for p in payloads),
                   tuple(p.data for p in payloads))


@dataclass(eq=False)
class VectorState:
    """A dataclass whose fields are tensors (or ``None``): server vectors ``[d]`` or per-client stores
    ``[N, d]``. Gives the engine row gather/scatter and tests an exact comparison, for any subclass."""

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    def rows(self, index: torch.Tensor) -> Self:
        """The states of the clients ``index`` (copies, so updating them never touches the store)."""
        return dataclasses.replace(self, **{k: v.index_select(0, index) for k, v in self.tensors().items()})

    def put_rows(self, index: torch.Tensor, part: Self) -> None:
        """Write the updated states of clients ``index`` back; all other rows stay bitwise unchanged."""
        for name, store in self.tensors().items():
            store.index_copy_(0, index, getattr(part, name))

    def clone(self) -> Self:
        return dataclasses.replace(self, **{k: v.clone() for k, v in self.tensors().items()})

    def max_abs_diff(self, other: VectorState) -> float:
        """Largest entry-wise difference over all fields (``inf`` if the field sets differ)."""
        mine, theirs = self.tensors(), other.tensors()
        if mine.keys() != theirs.keys():
            return float("inf")
        return max((float((mine[k] - theirs[k]).abs().max()) for k in mine if mine[k].numel()), default=0.0)


@dataclass(eq=False)
class ServerModel(VectorState):
    """Server state of FedAvg-like methods: the global model x."""

    x: torch.Tensor


@dataclass(eq=False)
class ServerControl(VectorState):
    """Server state of the SCAFFOLD family: model x and global control variable c = mean_i c_i."""

    x: torch.Tensor
    c: torch.Tensor


@dataclass(eq=False)
class NoClientState(VectorState):
    """Stateless clients (FedAvg)."""


@dataclass(frozen=True)
class InitContext:
    """What ``Algorithm.init`` may use: the shared initial model and, for control-variate
    initialisations, every client's local gradient at a point, ``[N, d]``: on its whole data set
    (∇f_i(x^0): SCAFFOLD's theory, ISCA's Line 1) or on one fresh minibatch (the detailed theorems)."""

    x0: torch.Tensor
    n_clients: int
    full_local_gradients: Callable[[torch.Tensor], torch.Tensor]
    minibatch_local_gradients: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LocalResult:
    """End of the local loop: final local models ``y [S, d]`` and the mean raw minibatch gradient
    ḡ = (1/K) Σ_k g^k ``[S, d]`` (accumulated, not recovered from (x − y)/(η_l K), which loses precision
    in float32)."""

    y: torch.Tensor
    grad_mean: torch.Tensor


class Solver(Protocol):
    """Local training of the round's sampled clients, as algorithms call it
    (:class:`horizontal.engine.LocalSolver` is the implementation)."""

    def gradient(self, Y: torch.Tensor) -> torch.Tensor:
        """Minibatch gradient ``[S, d]`` at the rows of ``Y``, on a fresh minibatch per client."""
        ...

    def run(self, x: torch.Tensor, correction: torch.Tensor | None = None) -> LocalResult:
        """K local SGD steps from ``x``, each shifted by ``−η_l·correction`` (constant in the round)."""
        ...


class RoundContext(Protocol):
    """What a client step sees: the round's sampled clients, the shared hyper-parameters, the local
    solver bound to their data, and a compression channel bound to their own random streams."""

    round: int
    clients: torch.Tensor
    config: FLConfig
    solver: Solver

    def compress(self, compressor: Compressor, X: torch.Tensor) -> Message:
        """Compress row j of ``X`` with client ``clients[j]``'s own generator; returns the decoded rows
        and the real payload bits."""
        ...


Downlink = Mapping[str, torch.Tensor]
Uplink = Mapping[str, Message]

ServerT = TypeVar("ServerT", bound=VectorState)
ClientT = TypeVar("ClientT", bound=VectorState)


class Algorithm(ABC, Generic[ServerT, ClientT]):
    """One horizontal-FL algorithm (see the module docstring for the round protocol).

    A subclass is a dataclass whose fields are its options (compressor, α, β, ...), validated in
    ``__post_init__``: :func:`options` lists them, so the command line can offer every one.
    """

    name: ClassVar[str]

    @abstractmethod
    def init(self, ctx: InitContext) -> tuple[ServerT, ClientT]:
        """Server state and the ``[N, d]`` per-client stores before round 0."""

    def broadcast(self, server: ServerT) -> Downlink:
        """Vectors sent to every sampled client (default: the model only)."""
        return {"x": server.x}

    @abstractmethod
    def client_update(self, down: Downlink, clients: ClientT, ctx: RoundContext) -> tuple[Uplink, ClientT]:
        """Local work of the S sampled clients (rows of ``clients``): uplink messages and new states."""

    @abstractmethod
    def server_update(self, server: ServerT, up: Uplink, config: FLConfig) -> tuple[ServerT, Downlink]:
        """Aggregate the round's messages; return the new server state and a reply to the participants
        (empty for most algorithms)."""

    def client_finish(self, reply: Downlink, clients: ClientT, config: FLConfig) -> ClientT:
        """Fold the server's reply into the participants' state (default: nothing to do)."""
        return clients

    def uplink_compressor(self) -> Compressor | None:
        """The codec of this algorithm's compressed uplink messages (``None``: all are full precision);
        a receiver of :attr:`Message.payloads` decodes them with it."""
        return None

    def describe(self) -> dict[str, object]:
        """Algorithm-specific settings for logs (α, β, compressor, ...)."""
        return {"algorithm": self.name}


class WithCompressor:
    """Mixin of the algorithms whose options include ``compressor``: validates it, declares it as the
    uplink codec and names it in :meth:`describe`. An algorithm with more options overrides
    ``__post_init__`` and calls ``_check_compressor`` itself."""

    name: ClassVar[str]
    compressor: Compressor

    def __post_init__(self) -> None:
        self._check_compressor()

    def uplink_compressor(self) -> Compressor | None:
        return self.compressor

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "compressor": compressor_label(self.compressor)}  # type: ignore[misc]

    def _check_compressor(self, *, unbiased: bool = False) -> None:
        self.compressor = check_compressor(self.compressor, self.name)
        if unbiased and not self.compressor.unbiased:
            raise ValueError(f"{self.name} needs an unbiased compressor (e.g. dithering), got "
                             f"{compressor_label(self.compressor)}")


def zeros_like_clients(x0: torch.Tensor, n_clients: int) -> torch.Tensor:
    """A ``[N, d]`` store of zeros (c_i^0 = 0 etc., the papers' practical initialisation)."""
    return torch.zeros((n_clients, x0.numel()), dtype=x0.dtype, device=x0.device)


def compressor_label(compressor: Compressor) -> str:
    """A readable name for logs, e.g. ``TopR(r=0.01)``."""
    return repr(compressor)


def options(algorithm: type[Algorithm[Any, Any]]) -> dict[str, dataclasses.Field[Any]]:
    """The options of an algorithm class by name (its dataclass fields; none for a plain class)."""
    return {f.name: f for f in dataclasses.fields(algorithm)} if dataclasses.is_dataclass(algorithm) else {}
