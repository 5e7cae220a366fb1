"""What a horizontal-FL job is: :class:`HflConfig`, its validation (every error is raised before any rank
starts) and what every rank builds from it: the algorithm, the model and the partitioned training data.

Three kinds of round (:attr:`HflConfig.family`): ``--model cnn`` selects the layered backbone (FedBAT's
BatchNorm CNN, :data:`horizontal.LAYERED_METHODS`: local epochs, n_k-weighted aggregation, layered
messages); ``--algorithm feddro`` the compositional one (:data:`horizontal.COMPOSITIONAL`: a DRO objective,
an exchange at every local step); everything else runs :data:`horizontal.ALGORITHMS` on flat parameter
vectors."""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from horizontal import (
    ALGORITHMS,
    COMPOSITIONAL,
    LAYERED_METHODS,
    MLP,
    FederatedData,
    FLConfig,
    LeastSquares,
    dirichlet_partition,
    iid_partition,
    make_algorithm,
    options,
    shard_partition,
    softmax_regression,
)
from horizontal.base import Compressor as CompressorOption
from horizontal.cnn import Table4CNN
from horizontal.dro_objectives import DRO_OBJECTIVES, LossComposition, make_objective
from horizontal.layered import LocalTraining, Method
from horizontal.models import BatchedModel, TorchModel, torch_mlp
from parties.config import ConfigError
from parties.hfl.client_files import inspect_client_files
from parties.hfl.wire import FLOAT_DTYPES
from protocols.compression import Compressor, get_compressor
from protocols.compression.layers import LayerCodec

MODELS = ("softmax", "mlp", "least-squares", "cnn")
LAYERED_MODELS = ("cnn",)
Family = Literal["round", "layered", "compositional"]
PARTITIONS = ("shards", "dirichlet", "iid")


@dataclass
class HflConfig:
    """One horizontal-FL job. ``n_features``/``n_classes`` are filled in by :func:`validate`."""

    algorithm: str = "fedavg"
    compressor: str | None = None
    options: dict[str, str] = field(default_factory=dict)   # the algorithm's other options, as typed
    dataset: str = "digits"
    data_dir: str | None = None
    client_files: str | None = None
    partition: str = "shards"
    shards_per_client: int = 2
    dirichlet_alpha: float = 0.5
    model: str = "softmax"
    hidden: list[int] = field(default_factory=lambda: [256, 128])
    widths: list[int] = field(default_factory=lambda: [8, 16, 32])
    local_epochs: int = 1
    objective: str = "kl-dro"
    dro_lambda: float = 1.0
    dtype: str = "float32"
    clients: int = 20
    per_round: int = 5
    local_steps: int = 10
    lr_local: float = 0.1
    lr_global: float = 1.0
    batch_size: int = 32
    rounds: int = 50
    eval_every: int = 10
    processes: int = 2
    seed: int = 0
    out: str = "runs/hfl"
    progress: bool = True
    trajectory: bool = False
    #: threads of each rank's pools (torch, BLAS/OpenMP); None: this host's share (parties/threads.py)
    compute_threads: int | None = None
    n_features: int | None = None
    n_classes: int | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> HflConfig:
        return cls(**json.loads(text))

    @property
    def torch_dtype(self) -> torch.dtype:
        return FLOAT_DTYPES[self.dtype]

    @property
    def fl(self) -> FLConfig:
        return FLConfig(self.clients, self.per_round, self.local_steps, self.lr_local, self.lr_global)

    @property
    def family(self) -> Family:
        """Which kind of round the job runs (see the module docstring)."""
        if self.algorithm in COMPOSITIONAL:
            return "compositional"
        return "layered" if self.model in LAYERED_MODELS else "round"

    @property
    def layered(self) -> bool:
        """Whether the job runs the layered backbone (FedBAT's CNN) instead of flat vectors."""
        return self.family == "layered"

    @property
    def iterations(self) -> int:
        """The compositional round's local steps: ``--rounds`` model rounds of I = period steps each."""
        period = int(self.options.get("period", 1))
        return self.rounds * period

    @property
    def local_training(self) -> LocalTraining:
        """The layered backbone's local work: E epochs of batch B at η_l."""
        return LocalTraining(self.local_epochs, self.batch_size, self.lr_local)

    @property
    def registry(self) -> dict[str, type[Any]]:
        return {"round": ALGORITHMS, "layered": LAYERED_METHODS, "compositional": COMPOSITIONAL}[self.family]


def parse_compressor(spec: str) -> Compressor:
    """``"top-r:r=0.01"`` / ``"dithering:bits=2"`` / ``"identity"`` → a compressor (ValueError if bad)."""
    name, _, params_text = spec.partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, params_text.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"compressor parameter {item!r} is not key=value (e.g. top-r:r=0.01)")
        params[key.strip()] = _number(value.strip())
    return get_compressor(name.strip(), **params)


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def option_names() -> dict[str, str]:
    """Every option of the registered algorithms but the compressor (which has its own syntax) and the
    injected layered codec: option name → which algorithms take it and its values, for ``--help``. The
    command line offers one flag per name."""
    takers: dict[str, list[str]] = {}
    values: dict[str, str] = {}
    for label, registry in (("", ALGORITHMS), (" (cnn)", LAYERED_METHODS), ("", COMPOSITIONAL)):
        for name, cls in sorted(registry.items()):
            types = typing.get_type_hints(cls)
            for option in _settable(cls):
                if option != "compressor":
                    takers.setdefault(option, []).append(name + label)
                    values[option] = _type_name(types[option])
    return {option: f"{', '.join(algorithms)}: {values[option]}" for option, algorithms in takers.items()}


def _settable(cls: type[Any]) -> dict[str, dataclasses.Field[Any]]:
    """The options a user sets: the dataclass fields taken by the constructor, less the injected codec and
    FedDRO's log label."""
    return {name: f for name, f in options(cls).items() if f.init and name not in ("codec", "label")}


def _type_name(kind: Any) -> str:
    kind = _unwrap_optional(kind)
    if typing.get_origin(kind) is Literal:
        return " | ".join(typing.get_args(kind))
    if typing.get_origin(kind) is tuple:
        return ",".join(a.__name__ for a in typing.get_args(kind))
    return getattr(kind, "__name__", str(kind))


def _unwrap_optional(kind: Any) -> Any:
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if type(None) in typing.get_args(kind) and len(args) == 1 else kind


def build_algorithm(config: HflConfig) -> Any:
    """The algorithm object from its options dataclass (a :class:`horizontal.Algorithm`, or a layered
    :class:`horizontal.layered.Method` with ``--model cnn``): every given option converted to the field's
    type; an option the algorithm does not take, or a required one missing, is an error."""
    registry = config.registry
    if config.algorithm not in registry:
        other = ALGORITHMS if config.layered else LAYERED_METHODS
        hint = ""
        if config.algorithm in other:
            hint = (f" ({config.algorithm} runs on the flat models: --model softmax, mlp or least-squares)"
                    if config.layered
                    else f" ({config.algorithm} runs on the BatchNorm CNN: add --model cnn)")
        models = "--model cnn" if config.layered else f"--model {config.model}"
        raise ConfigError(f"unknown --algorithm {config.algorithm!r} for {models}{hint}; choose one of "
                          f"{', '.join(sorted(registry))}")
    cls = registry[config.algorithm]
    fields, types = _settable(cls), typing.get_type_hints(cls)
    given = dict(config.options)
    if config.compressor is not None:
        given["compressor"] = config.compressor
    kwargs: dict[str, Any] = {}
    for name, text in given.items():
        flag = _flag(name)
        if name not in fields:
            raise ConfigError(f"{flag} does not apply to {config.algorithm}")
        try:
            kwargs[name] = _convert(str(text), types[name])
        except ValueError as err:
            raise ConfigError(f"{flag} {text!r}: {err}") from None
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if (required or (name == "compressor" and f.default is None)) and name not in kwargs:
            example = " (e.g. top-r:r=0.01 or dithering:bits=2)" if name == "compressor" else ""
            raise ConfigError(f"{config.algorithm} needs {_flag(name)}{example}")
    try:
        if config.family == "layered":
            method: Method = cls(LayerCodec(), **kwargs)
            return method
        if config.family == "compositional":
            return cls(**kwargs)
        return make_algorithm(config.algorithm, **kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{config.algorithm}: {err}") from None


def _flag(option: str) -> str:
    return "--" + option.replace("_", "-")


def _convert(text: str, kind: Any) -> Any:
    """A command-line string as a value of an option's declared type."""
    kind = _unwrap_optional(kind)
    if kind is CompressorOption:
        return parse_compressor(text)
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        if text not in choices:
            raise ValueError(f"choose one of {', '.join(map(str, choices))}")
        return text
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError("expected true or false")
        return text.lower() in ("true", "1", "yes")
    if typing.get_origin(kind) is tuple:
        parts = text.split(",")
        if len(parts) != len(typing.get_args(kind)):
            raise ValueError(f"expected {len(typing.get_args(kind))} comma-separated numbers")
        kinds = typing.get_args(kind)
        return tuple(_convert(part.strip(), part_kind) for part, part_kind in zip(parts, kinds, strict=True))
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            raise ValueError(f"expected {'an integer' if kind is int else 'a number'}") from None
    return text


def build_model(config: HflConfig) -> BatchedModel:
    assert config.n_features is not None, "validate() fills n_features"
    assert not config.layered, "the layered backbone's model is build_cnn's"
    if config.model == "least-squares":
        return LeastSquares(config.n_features)
    assert config.n_classes is not None
    if config.model == "softmax":
        return softmax_regression(config.n_features, config.n_classes)
    return MLP(config.n_features, tuple(config.hidden), config.n_classes)


def build_cnn(config: HflConfig) -> nn.Module:
    """FedBAT's Table 4 CNN on square grey-scale images of ``n_features`` pixels, ``--widths`` channels
    (its conv weights are re-drawn from the seed's init stream by the simulation and every rank alike)."""
    assert config.n_features is not None and config.n_classes is not None, "validate() fills them"
    side = math.isqrt(config.n_features)
    return Table4CNN(1, config.n_classes, image_size=side, widths=config.widths)


def build_dro_model(config: HflConfig) -> TorchModel:
    """FedDRO's classifier, used through ``torch.func.vmap``: softmax regression or the ``--hidden`` MLP."""
    assert config.n_features is not None and config.n_classes is not None, "validate() fills them"
    hidden = tuple(config.hidden) if config.model == "mlp" else ()
    return torch_mlp(config.n_features, hidden, config.n_classes)


def build_objective(config: HflConfig) -> LossComposition:
    return make_objective(config.objective, config.dro_lambda)


def client_blocks(n_clients: int, processes: int) -> list[np.ndarray]:
    """Which logical clients each client process hosts: contiguous blocks of near-equal size."""
    return np.array_split(np.arange(n_clients), processes)


def load_training_data(config: HflConfig) -> tuple[FederatedData, tuple[torch.Tensor, torch.Tensor]]:
    """The partitioned training rows and the test set of a named dataset, exactly as the simulation
    equivalence tests build them: ``load(dataset, seed)``, the partitioner with
    ``numpy.random.default_rng(seed)``, features cast to ``--dtype``."""
    from vertical.datasets import load

    ds = load(config.dataset, seed=config.seed, data_dir=config.data_dir)
    rng = np.random.default_rng(config.seed)
    y_train, y_test = _labels(ds.task, ds.y_train), _labels(ds.task, ds.y_test)
    if config.partition == "shards":
        parts = shard_partition(y_train, config.clients, config.shards_per_client, rng)
    elif config.partition == "dirichlet":
        parts = dirichlet_partition(y_train, config.clients, config.dirichlet_alpha, rng)
    else:
        parts = iid_partition(len(y_train), config.clients, rng)
    data = FederatedData.from_partition(_dense(ds.X_train), y_train, parts, dtype=config.torch_dtype)
    y_test_t = torch.as_tensor(y_test)
    if y_test_t.is_floating_point():
        y_test_t = y_test_t.to(config.torch_dtype)
    return data, (torch.as_tensor(_dense(ds.X_test)).to(config.torch_dtype), y_test_t)


def _dense(X: Any) -> np.ndarray:
    return np.asarray(X.todense()) if hasattr(X, "todense") else np.asarray(X)


def _labels(task: str, y: np.ndarray) -> np.ndarray:
    if task == "binary":
        return (np.asarray(y) > 0).astype(np.int64)
    return np.asarray(y)


def validate(config: HflConfig) -> HflConfig:
    """Raise :class:`ConfigError` for anything that cannot run; return the config with ``n_features`` and
    ``n_classes`` resolved from the data."""
    c = config
    validate_options(c)
    n_features, n_classes = (inspect_client_files(Path(c.client_files), c.processes, c.clients)
                             if c.client_files else _inspect_dataset(c))
    check_shape(c, n_features, n_classes)
    return dataclasses.replace(c, n_features=n_features, n_classes=n_classes or None)


def validate_options(config: HflConfig) -> None:
    """The checks that need no data: counts, names, the algorithm and its options (a federated job
    checks these from its job file alone, :mod:`parties.federation.hfl_job`)."""
    c = config
    for name in ("clients", "per_round", "local_steps", "batch_size", "rounds", "eval_every", "processes"):
        if getattr(c, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(c, name)})")
    if c.compute_threads is not None and c.compute_threads < 1:
        raise ConfigError(f"--compute-threads must be at least 1 (got {c.compute_threads})")
    if c.processes > c.clients:
        raise ConfigError(f"--processes {c.processes} exceeds --clients {c.clients}: every client process "
                          "must host at least one client")
    try:
        FLConfig(c.clients, c.per_round, c.local_steps, c.lr_local, c.lr_global)
    except ValueError as err:
        raise ConfigError(str(err).replace("clients_per_round", "--per-round")) from None
    if c.dtype not in FLOAT_DTYPES:
        raise ConfigError(f"--dtype must be float32 or float64 (got {c.dtype!r})")
    if c.model not in MODELS:
        raise ConfigError(f"unknown --model {c.model!r}; choose one of {', '.join(MODELS)}")
    if c.partition not in PARTITIONS:
        raise ConfigError(f"unknown --partition {c.partition!r}; choose one of {', '.join(PARTITIONS)}")
    if c.model == "mlp" and (not c.hidden or min(c.hidden) < 1):
        raise ConfigError(f"--hidden must list positive layer widths (got {c.hidden})")
    if c.layered:
        _check_layered(c)
    if c.family == "compositional":
        _check_compositional(c)
    build_algorithm(c)


def check_shape(c: HflConfig, n_features: int, n_classes: int) -> None:
    """The model fits data of ``n_features`` columns and ``n_classes`` classes (0: regression)."""
    if (c.model == "least-squares") != (n_classes == 0):
        data_kind = "regression targets" if n_classes == 0 else "class labels"
        raise ConfigError(f"--model {c.model} does not fit data with {data_kind}: use "
                          f"{'least-squares' if n_classes == 0 else 'softmax or mlp'}")
    if c.layered:
        side = math.isqrt(n_features)
        if side * side != n_features:
            raise ConfigError(f"--model cnn needs square grey-scale images; the data has {n_features} "
                              "features a row")
        if side >> len(c.widths) < 1:
            raise ConfigError(f"--widths {','.join(map(str, c.widths))}: {len(c.widths)} pooling stages are "
                              f"too many for {side}x{side} images (at most {side.bit_length() - 1})")


def _check_compositional(c: HflConfig) -> None:
    """What FedDRO's round cannot take: every client steps at every iteration (no sampling), models are
    plain averages (no server step size), and it trains classifiers."""
    if c.per_round != c.clients:
        raise ConfigError(f"{c.algorithm}: every client takes part in every iteration; set --per-round equal "
                          f"to --clients ({c.clients})")
    if c.lr_global != 1.0:
        raise ConfigError(f"{c.algorithm} averages the models with no server step; drop --lr-global")
    if c.model not in ("softmax", "mlp"):
        raise ConfigError(f"{c.algorithm} trains --model softmax or mlp (got {c.model})")
    if c.objective not in DRO_OBJECTIVES:
        raise ConfigError(f"unknown --objective {c.objective!r}; choose one of {', '.join(DRO_OBJECTIVES)}")
    try:
        make_objective(c.objective, c.dro_lambda)
    except ValueError as err:
        raise ConfigError(f"--dro-lambda {c.dro_lambda}: {err}") from None


def _check_layered(c: HflConfig) -> None:
    """What the layered backbone cannot take (FedBAT's round has no server step size; its model is
    float32; its local work is epochs, not steps)."""
    if c.dtype != "float32":
        raise ConfigError("--model cnn trains in float32 (the CNN's parameters); drop --dtype float64")
    if c.lr_global != 1.0:
        raise ConfigError("--model cnn aggregates with sample weights and no server step (FedBAT's Eq. 11); "
                          "drop --lr-global")
    if c.local_epochs < 1:
        raise ConfigError(f"--local-epochs must be at least 1 (got {c.local_epochs})")
    if not c.widths or min(c.widths) < 1:
        raise ConfigError(f"--widths must list positive channel counts (got {c.widths})")


def _inspect_dataset(c: HflConfig) -> tuple[int, int]:
    """(n_features, n_classes or 0) of ``--dataset``, partitioned once to surface partition errors."""
    from vertical.datasets import DatasetNotFoundError, get_spec

    try:
        spec = get_spec(c.dataset)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if spec.task == "regression" and c.partition != "iid":
        raise ConfigError(f"dataset {c.dataset!r} is a regression task: label partitions need classes, "
                          "use --partition iid")
    try:
        data, (_, y_test) = load_training_data(c)
    except DatasetNotFoundError as err:
        raise ConfigError(str(err)) from None
    except ValueError as err:
        raise ConfigError(f"cannot partition {c.dataset!r} into {c.clients} clients: {err}") from None
    n_classes = 0 if spec.task == "regression" else max(int(data.y.max()), int(y_test.max())) + 1
    return int(data.X.shape[1]), n_classes
