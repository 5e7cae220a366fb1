"""The layered backbone (FedAvg's local SGD on a ``torch.nn`` model, with a layered uplink) and the round
loop every method on it shares: FedBAT (:mod:`horizontal.fedbat`), its post-training baselines
(:mod:`horizontal.signsgd`), and FedAvg and FedPAQ on this backbone (:mod:`horizontal.fedavg`,
:mod:`horizontal.fedpaq`).

A client trains an explicit update m of the frozen global model w_t with plain SGD over τ_k = E·⌈n_k/B⌉
minibatch steps (:class:`LocalTrainer`; a :class:`BinarizationPhase` can change the forward pass after a
warm-up, which is how FedBAT plugs in), then its :class:`Method` packs what it sends. The server
(:class:`LayeredServer`, shared by the simulation :class:`FederatedCNN` and the MPI server rank in
:mod:`parties.hfl.layered`) decodes every upload and applies FedBAT's Eq. 11:
w_{t+1} = w_t + Σ_k p'_k m̄_k with p'_k = n_k / Σ_{j∈S_t} n_j; BN tensors are averaged with the same weights.

Decisions where the papers are silent, shared by every method on this backbone:
- BatchNorm γ/β are trained directly and sent in float32 with the running statistics; their bits are
  counted for every method alike. ``num_batches_tracked`` is averaged and rounded.
- Aggregation weights are sample counts n_k (FedBAT's paper), not minibatch counts (its code).
- Minibatches: each local epoch is a fresh permutation of the client's rows cut into batches of B (the
  last one smaller), from the simulation's data stream; compression noise comes from each client's own
  stream, so it is independent of which other clients are sampled.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from horizontal.base import wire_bits
from horizontal.cnn import binarized_names, init_weights
from horizontal.data import FederatedData
from horizontal.engine import MetricsLog, Streams
from horizontal.rounds import check_finite, sample_clients

State = dict[str, torch.Tensor]
EVAL_CHUNK = 2000


@dataclass(frozen=True)
class LocalTraining:
    """Local SGD of every method: E epochs of batch B at learning rate η (momentum 0, weight decay 0)."""

    epochs: int = 10
    batch_size: int = 64
    lr: float = 0.1

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError(f"epochs and batch_size must be >= 1, got {self.epochs}, {self.batch_size}")
        if not 0 < self.lr < math.inf:
            raise ValueError(f"lr must be a positive finite number, got {self.lr}")


@dataclass
class Upload:
    """What one client sends: its packed message exactly as it crosses the wire (the method's
    :meth:`Method.decode` turns it back into the update), its full-precision BN tensors, its sample count
    n_k (for p'_k), and the diagnostics the logs show."""

    payload: bytes
    extras: State
    n_samples: int
    mean_loss: float
    info: dict[str, list[float]] = field(default_factory=dict)

    @property
    def payload_bits(self) -> int:
        return 8 * len(self.payload)

    @property
    def extras_bits(self) -> int:
        return sum(wire_bits(t) for t in self.extras.values())


@dataclass
class LocalResult:
    """End of local training: m = y − w_t per binarized tensor (detached), BN tensors, mean loss."""

    update: list[torch.Tensor]
    extras: State
    mean_loss: float
    steps: int


class BinarizationPhase(ABC):
    """What FedBAT plugs into :meth:`LocalTrainer.train` from step ⌊φτ⌋ on."""

    @abstractmethod
    def warmup_steps(self, tau: int) -> int:
        """⌊φτ⌋: the number of full-precision steps before binarization-aware training."""

    @abstractmethod
    def begin(self, m: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Initialise the step sizes from the warmed-up update; return the new trainable tensors."""

    @abstractmethod
    def apply(self, m: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The binarized updates S(m_l, α_l) used in this step's forward pass."""


@dataclass(frozen=True)
class ModelLayout:
    """Which tensors of a model are binarized (conv and linear weights, with their shapes) and which
    travel in full precision (BN γ/β, then the buffers), in a fixed order both ends derive themselves."""

    names: list[str]
    shapes: list[torch.Size]
    extra_params: list[str]
    buffers: list[str]

    @classmethod
    def of(cls, model: nn.Module) -> ModelLayout:
        names = binarized_names(model)
        state = model.state_dict()
        binarized = set(names)
        return cls(names, [state[n].shape for n in names],
                   [n for n, _ in model.named_parameters() if n not in binarized],
                   [n for n, _ in model.named_buffers()])

    @property
    def extras(self) -> list[str]:
        return [*self.extra_params, *self.buffers]


class LocalTrainer:
    """One client's local epochs on a ``torch.nn`` model with autograd, from a global state dict.

    The model is used as a function (``torch.func.functional_call``): the global tensors are never
    modified; the trainable tensors are the updates m of the binarized weights, the BN γ/β, and whatever
    a :class:`BinarizationPhase` adds.
    """

    def __init__(self, model: nn.Module, data: FederatedData, training: LocalTraining) -> None:
        self.model = model
        self.data = data
        self.training = training
        layout = ModelLayout.of(model)
        self.names, self.shapes = layout.names, layout.shapes
        self.extra_params, self.buffers = layout.extra_params, layout.buffers
        self.input_shape = tuple(getattr(model, "input_shape", (data.X.shape[1],)))
        if math.prod(self.input_shape) != data.X.shape[1]:
            raise ValueError(f"model input {self.input_shape} does not match {data.X.shape[1]} features")

    def steps(self, client: int) -> int:
        """τ_k = E·⌈n_k/B⌉."""
        n = int(self.data.sizes[client])
        return self.training.epochs * math.ceil(n / self.training.batch_size)

    def batches(self, client: int, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """E epochs, each a fresh permutation of the client's rows cut into batches of B."""
        X, y = self.data.client(client)
        for order in self._epoch_orders(X.shape[0], generator):
            for rows in order.split(self.training.batch_size):
                yield X[rows].view(-1, *self.input_shape), y[rows]

    def skip(self, n_rows: int, generator: torch.Generator) -> None:
        """Advance ``generator`` exactly as training a client of ``n_rows`` rows would (the data stream is
        shared by the clients in turn, so a process that does not host a sampled client replays its
        draws to stay in step)."""
        for _ in self._epoch_orders(n_rows, generator):
            pass

    def _epoch_orders(self, n_rows: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
        for _ in range(self.training.epochs):
            yield torch.randperm(n_rows, generator=generator)

    def train(self, global_state: State, client: int, generator: torch.Generator,
              phase: BinarizationPhase | None = None) -> LocalResult:
        """τ_k SGD steps of client ``client``; with ``phase``, binarization-aware after ⌊φτ_k⌋ steps."""
        base = [global_state[n].detach() for n in self.names]
        m = [torch.zeros_like(b, requires_grad=True) for b in base]
        others = {n: global_state[n].detach().clone().requires_grad_() for n in self.extra_params}
        buffers = {n: global_state[n].detach().clone() for n in self.buffers}
        tau = self.steps(client)
        switch = tau if phase is None else phase.warmup_steps(tau)
        trainable = [*m, *others.values()]
        loss_sum = 0.0
        self.model.train()
        for s, (X, y) in enumerate(self.batches(client, generator)):
            if s == switch and phase is not None:
                trainable += phase.begin(m)
            deltas = m if s < switch or phase is None else phase.apply(m)
            weights = {n: b + d for n, b, d in zip(self.names, base, deltas, strict=True)}
            logits = functional_call(self.model, {**weights, **others, **buffers}, (X,))
            loss = F.cross_entropy(logits, y)
            grads = torch.autograd.grad(loss, trainable)
            with torch.no_grad():
                for tensor, grad in zip(trainable, grads, strict=True):
                    tensor.sub_(grad, alpha=self.training.lr)
            loss_sum += float(loss.detach())
        extras = {n: t.detach() for n, t in others.items()} | buffers
        return LocalResult([t.detach() for t in m], extras, loss_sum / tau, tau)


class LayerCodec(Protocol):
    """The uplink formats of a layered update (``protocols.compression.layers.LayerCodec`` implements them;
    ``vfl`` does not import ``protocols``, so the codec is injected into every method)."""

    def encode_signs(self, bits: Sequence[torch.Tensor], scales: Sequence[float] = ()) -> bytes: ...

    def decode_signs(self, data: bytes, shapes: Sequence[torch.Size], n_scales: int
                     ) -> tuple[list[torch.Tensor], torch.Tensor]: ...

    def encode_floats(self, update: Sequence[torch.Tensor]) -> bytes: ...

    def decode_floats(self, data: bytes, shapes: Sequence[torch.Size]) -> list[torch.Tensor]: ...


def check_codec(codec: object, method: str) -> LayerCodec:
    """Validate an injected codec at the public edge (a clear error instead of a late AttributeError)."""
    if not all(callable(getattr(codec, name, None))
               for name in ("encode_signs", "decode_signs", "encode_floats", "decode_floats")):
        raise TypeError(f"{method}: codec must be a protocols.compression.layers.LayerCodec, got "
                        f"{type(codec).__name__}")
    return codec  # type: ignore[return-value]


class Method(ABC):
    """A FedAvg-backbone method: how a client trains and what it sends up."""

    name: ClassVar[str]

    @abstractmethod
    def client(self, trainer: LocalTrainer, global_state: State, client: int, data_stream: torch.Generator,
               client_stream: torch.Generator) -> Upload:
        """Train client ``client`` from ``global_state``; return its uplink as packed bytes."""

    @abstractmethod
    def decode(self, payload: bytes, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        """The update of each binarized tensor as the server reads it from a client's packed message
        (a ValueError if the message does not fit ``shapes``)."""

    def describe(self) -> dict[str, object]:
        return {"method": self.name}


@dataclass(eq=False)
class PostTraining(Method):
    """Local SGD as in FedAvg, then :meth:`encode` the update of the binarized tensors in the injected
    codec's format; :meth:`decode` is the server's inverse. FedBAT's baselines (``signsgd.py``) and FedAvg
    and FedPAQ on this backbone (``fedavg.py``, ``fedpaq.py``) are its subclasses."""

    codec: LayerCodec

    def __post_init__(self) -> None:
        self.codec = check_codec(self.codec, self.name)

    def client(self, trainer: LocalTrainer, global_state: State, client: int, data_stream: torch.Generator,
               client_stream: torch.Generator) -> Upload:
        local = trainer.train(global_state, client, data_stream)
        payload = self.encode(local.update, trainer.shapes, client, client_stream)
        return Upload(payload, local.extras, int(trainer.data.sizes[client]), local.mean_loss)

    @abstractmethod
    def encode(self, update: list[torch.Tensor], shapes: Sequence[torch.Size], client: int,
               generator: torch.Generator) -> bytes:
        """Client ``client``'s update as the packed message it sends."""

    def compress(self, update: list[torch.Tensor], shapes: Sequence[torch.Size], client: int,
                 generator: torch.Generator) -> tuple[list[torch.Tensor], int]:
        """The update as the server decodes it, and the message's bits (encode, then decode)."""
        payload = self.encode(update, shapes, client, generator)
        return self.decode(payload, shapes), 8 * len(payload)


def aggregate(global_state: State, names: Sequence[str], updates: Sequence[Sequence[torch.Tensor]],
              extras: Sequence[State], n_samples: Sequence[int]) -> State:
    """Eq. 11 on the decoded updates and the same weighted mean of the BN tensors, p'_k ∝ n_k."""
    total = sum(n_samples)
    weights = [n / total for n in n_samples]
    new = dict(global_state)
    for i, name in enumerate(names):
        delta = sum(w * u[i] for w, u in zip(weights, updates, strict=True))
        new[name] = global_state[name] + delta
    for name in extras[0]:
        mean = sum(w * e[name].double() for w, e in zip(weights, extras, strict=True))
        dtype = global_state[name].dtype
        new[name] = (mean.round() if not dtype.is_floating_point else mean).to(dtype)
    return new


class LayeredServer:
    """The server's half of a round on this backbone: decode every upload with the method, aggregate
    (Eq. 11), check the new state, count the bits and write the round's record. The simulation and the
    MPI server (:mod:`parties.hfl`) both run it, so their records agree by construction."""

    def __init__(self, method: Method, state: State, names: Sequence[str], shapes: Sequence[torch.Size]
                 ) -> None:
        self.method = method
        self.state = state
        self.names = list(names)
        self.shapes = list(shapes)
        self.round = 0
        self.uplink_bits = 0
        self.downlink_bits = 0

    def finish(self, uploads: Sequence[Upload], started: float,
               updates: Sequence[list[torch.Tensor]] | None = None) -> dict[str, Any]:
        """Fold one round's uploads (in client order) into the global state; return the round's record.
        ``updates``: the payloads already decoded (a receiver that checked them at its boundary)."""
        if updates is None:
            updates = [self.method.decode(u.payload, self.shapes) for u in uploads]
        self.state = aggregate(self.state, self.names, updates, [u.extras for u in uploads],
                               [u.n_samples for u in uploads])
        check_finite(self.state, owner=self.method.name, what="global", round=self.round + 1,
                     advice="lower the local learning rate")
        payload = sum(u.payload_bits for u in uploads)
        extras = sum(u.extras_bits for u in uploads)
        self.uplink_bits += payload + extras
        self.downlink_bits += len(uploads) * sum(wire_bits(t) for t in self.state.values())
        self.round += 1
        record: dict[str, Any] = {
            "round": self.round, "local_loss": float(np.mean([u.mean_loss for u in uploads])),
            "uplink_bits": self.uplink_bits, "downlink_bits": self.downlink_bits,
            "uplink_payload_bits_per_client": payload / len(uploads),
            "uplink_extras_bits_per_client": extras / len(uploads),
            "round_seconds": time.perf_counter() - started}
        for key in uploads[0].info:
            record[f"mean_{key}"] = [float(np.mean([u.info[key][i] for u in uploads]))
                                     for i in range(len(uploads[0].info[key]))]
        return record


def evaluate_state(model: nn.Module, state: State, X: torch.Tensor, y: torch.Tensor,
                   input_shape: Sequence[int]) -> dict[str, float]:
    """Test loss and accuracy of a global state (BN in eval mode, averaged running statistics)."""
    model.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for start in range(0, X.shape[0], EVAL_CHUNK):
            xb = X[start:start + EVAL_CHUNK].view(-1, *input_shape)
            logits = functional_call(model, state, (xb,))
            yb = y[start:start + EVAL_CHUNK]
            loss += float(F.cross_entropy(logits, yb, reduction="sum"))
            correct += int((logits.argmax(1) == yb).sum())
    return {"test_loss": loss / X.shape[0], "test_accuracy": correct / X.shape[0]}


class FederatedCNN:
    """Simulate N clients training a ``torch.nn`` model with one :class:`Method` (FedAvg backbone).

    Randomness as in :class:`horizontal.engine.FederatedSimulation`: one seed spawns the streams of the
    initial model, client sampling (S distinct clients per round, uniformly), minibatch order and one
    stream per client for its compression noise.
    """

    def __init__(self, method: Method, model: nn.Module, data: FederatedData, *, clients_per_round: int,
                 training: LocalTraining, seed: int = 0,
                 test: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        if not 1 <= clients_per_round <= data.n_clients:
            raise ValueError(f"clients_per_round must be in [1, {data.n_clients}], got {clients_per_round}")
        self.method = method
        self.model = model
        self.trainer = LocalTrainer(model, data, training)
        self.clients_per_round = clients_per_round
        self.test = test
        self.streams = Streams.from_seed(seed, data.n_clients)
        init_weights(model, self.streams.init)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.server = LayeredServer(method, state, self.trainer.names, self.trainer.shapes)

    @property
    def state(self) -> State:
        return self.server.state

    @property
    def round(self) -> int:
        return self.server.round

    @property
    def uplink_bits(self) -> int:
        return self.server.uplink_bits

    def sample_clients(self) -> list[int]:
        return sample_clients(self.trainer.data.n_clients, self.clients_per_round,
                              self.streams.sampling).tolist()

    def step(self) -> dict[str, Any]:
        """One round: sample, train and upload, aggregate; returns the round's metrics."""
        started = time.perf_counter()
        uploads = [self.method.client(self.trainer, self.state, k, self.streams.data,
                                      self.streams.compression[k]) for k in self.sample_clients()]
        return self.server.finish(uploads, started)

    def evaluate(self) -> dict[str, float]:
        """Test loss and accuracy of the global model (BN in eval mode, averaged running statistics)."""
        if self.test is None:
            return {}
        return evaluate_state(self.model, self.state, *self.test, self.trainer.input_shape)

    def run(self, rounds: int, *, eval_every: int = 1, log: MetricsLog | None = None
            ) -> list[dict[str, Any]]:
        """``rounds`` rounds, evaluating every ``eval_every`` rounds and after the last one."""
        if rounds < 1 or eval_every < 1:
            raise ValueError(f"rounds and eval_every must be >= 1, got {rounds} and {eval_every}")
        records = []
        for t in range(rounds):
            record = self.step()
            if (t + 1) % eval_every == 0 or t + 1 == rounds:
                record |= self.evaluate()
            records.append(record)
            if log is not None:
                log.write(record)
        return records
