"""Horizontal federated learning on torch: algorithms behind one interface and a simulation engine that
runs the sampled clients as one batched computation.

    from horizontal import FLConfig, FederatedSimulation, make_algorithm
    alg = make_algorithm("scafcom", compressor=get_compressor("top-r", r=0.01), beta=0.2)

Compressors come from ``protocols.compression`` and are injected: ``horizontal`` never imports ``protocols``.
An algorithm is one dataclass in one file (its fields are its options), registered below by name.

Three kinds of round, one registry each:

- :data:`ALGORITHMS` run on flat parameter vectors of the batched models (``models.py``): the round
  protocol of :mod:`horizontal.base`, simulated by :class:`FederatedSimulation`;
- :data:`COMPOSITIONAL` (FedDRO, with FedAvg-CO and MBSGD-CO as its settings) synchronise at every
  local step, on a vmap'd ``torch.nn`` classifier and a DRO objective (:mod:`horizontal.feddro`),
  simulated by :class:`~horizontal.feddro.CompositionalSimulation`;
- :data:`LAYERED_METHODS` run on a ``torch.nn`` model with BatchNorm (FedBAT's CNN): local epochs on the
  FedAvg backbone, then a layered uplink (:mod:`horizontal.layered`), simulated by
  :class:`~horizontal.layered.FederatedCNN`. FedAvg and FedPAQ appear in both: on this backbone they are
  the same rules with the layered message format (FedPAQ's quantizer is validated by :class:`FedPAQ`).

All three run under MPI with ``python -m parties.hfl`` (``--model cnn`` selects the layered backbone,
``--algorithm feddro`` the compositional one).
"""

from __future__ import annotations

from typing import Any

from horizontal.base import (
    Algorithm,
    Compressor,
    FLConfig,
    InitContext,
    Message,
    RoundContext,
    ServerControl,
    ServerModel,
    VectorState,
    WithCompressor,
    options,
)
from horizontal.data import FederatedData
from horizontal.engine import FederatedSimulation, LocalSolver, MetricsLog
from horizontal.fed_ef import FedEF
from horizontal.fedavg import FedAvg, LayeredFedAvg
from horizontal.fedbat import FedBAT
from horizontal.fedcomgate import FedComGate
from horizontal.feddro import FedDRO
from horizontal.fedpaq import FedPAQ, LayeredFedPAQ
from horizontal.isca import Isca
from horizontal.iscam import Iscam
from horizontal.layered import Method
from horizontal.models import MLP, LeastSquares, least_squares_optimum, softmax_regression
from horizontal.partitions import (
    dirichlet_partition,
    iid_partition,
    imbalanced_st_indices,
    labels_per_client_partition,
    shard_partition,
)
from horizontal.scafcom import Scafcom
from horizontal.scaffold import Scaffold, ScaffoldTwoVector
from horizontal.scallion import Scallion
from horizontal.signsgd import EFSignSGD, NoisySignSGD, SignSGD, StocSignSGD

ALGORITHMS: dict[str, type[Algorithm[Any, Any]]] = {
    cls.name: cls for cls in (FedAvg, ScaffoldTwoVector, Scaffold, Scallion, Scafcom, FedEF, FedComGate,
                               Isca, Iscam, FedPAQ)
}

LAYERED_METHODS: dict[str, type[Method]] = {
    cls.name: cls for cls in (FedBAT, LayeredFedAvg, SignSGD, EFSignSGD, NoisySignSGD, StocSignSGD,
                               LayeredFedPAQ)
}

COMPOSITIONAL: dict[str, type[FedDRO]] = {"feddro": FedDRO}


def make_algorithm(name: str, **settings: Any) -> Algorithm[Any, Any]:
    """Build a registered algorithm by name with its options (the fields of its dataclass: compressor,
    alpha, beta, cv_init, ...; :func:`options` lists them)."""
    try:
        cls = ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(sorted(ALGORITHMS))}") from None
    try:
        return cls(**settings)
    except TypeError as exc:
        raise TypeError(f"algorithm {name!r}: {exc}") from None


__all__ = [
    "ALGORITHMS",
    "COMPOSITIONAL",
    "LAYERED_METHODS",
    "MLP",
    "Algorithm",
    "Compressor",
    "FLConfig",
    "FedAvg",
    "FedComGate",
    "FedEF",
    "FedPAQ",
    "FederatedData",
    "FederatedSimulation",
    "InitContext",
    "Isca",
    "Iscam",
    "LeastSquares",
    "LocalSolver",
    "Message",
    "MetricsLog",
    "RoundContext",
    "Scafcom",
    "Scaffold",
    "ScaffoldTwoVector",
    "Scallion",
    "ServerControl",
    "ServerModel",
    "VectorState",
    "WithCompressor",
    "dirichlet_partition",
    "iid_partition",
    "imbalanced_st_indices",
    "labels_per_client_partition",
    "least_squares_optimum",
    "make_algorithm",
    "options",
    "shard_partition",
    "softmax_regression",
]
