"""What every rank runs under ``mpiexec``: :func:`run_ranks` (the jobs of the ``--config`` files, one after
the other) and :func:`run_job` (load this rank's data, agree on x^0, then serve as the server or as a
client process), and the server's loop over the rounds that writes the metrics and the final state."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from horizontal import FederatedData, MetricsLog
from horizontal.cnn import init_weights
from horizontal.engine import Streams
from horizontal.layered import LocalTrainer
from parties.config import ConfigError
from parties.hfl.client import ClientProcess
from parties.hfl.client_files import Shard, client_file_name, load_client_file
from parties.hfl.compositional import CompositionalServer, serve_client
from parties.hfl.config import (
    HflConfig,
    build_algorithm,
    build_cnn,
    build_dro_model,
    build_model,
    build_objective,
    client_blocks,
    load_training_data,
)
from parties.hfl.job import _Job
from parties.hfl.layered import LayeredClientProcess, LayeredServerRank, share_client_sizes
from parties.hfl.server import Server
from parties.hfl.wire import SERVER


def _load_shard(config: HflConfig, process: int) -> Shard:
    if config.client_files is not None:
        shard, _, _ = load_client_file(Path(config.client_files) / client_file_name(process),
                                       config.torch_dtype)
        return shard
    data, _ = load_training_data(config)
    ids = client_blocks(config.clients, config.processes)[process]
    parts = [np.arange(int(data.offsets[i]), int(data.offsets[i + 1])) for i in ids]
    hosted = FederatedData.from_partition(data.X, data.y, parts, config.torch_dtype)
    return Shard(torch.as_tensor(ids), hosted)


TestSet = tuple[torch.Tensor, torch.Tensor]


def load_test_set(path: Path, config: HflConfig) -> TestSet:
    """The server's test set from a ``test.npz`` of ``split`` (``X``, ``y``), in the job's dtype."""
    with np.load(path, allow_pickle=False) as f:
        X, y = torch.as_tensor(f["X"]).to(config.torch_dtype), torch.as_tensor(f["y"])
    return X, y.to(config.torch_dtype) if y.is_floating_point() else y


def _server_test_set(config: HflConfig) -> TestSet | None:
    if config.client_files is None:
        return load_training_data(config)[1]
    path = Path(config.client_files) / "test.npz"
    if not path.is_file():
        return None
    return load_test_set(path, config)


def run_job(comm: Any, config: HflConfig) -> None:
    """One job on every rank of ``comm``: rank 0 serves, the others are client processes."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if size != config.processes + 1:
        raise ConfigError(f"config says {config.processes} client processes but mpiexec started {size} "
                          f"ranks (need {config.processes + 1}: one server and the client processes)")
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"party-{rank}.pid").write_text(str(os.getpid()))
    shard = None if rank == SERVER else _load_shard(config, rank - 1)
    run_rank(comm, config, shard, _server_test_set(config) if rank == SERVER else None)


def run_rank(comm: Any, config: HflConfig, shard: Shard | None, test: TestSet | None) -> dict[str, float]:
    """This rank's part of the job, its data loaded (a client process's ``shard``, the server's ``test``
    set): the federated command (:mod:`parties.federation.hfl_member`) loads them from its own ``--data``.
    Returns the server's last record (the metrics of the last round); ``{}`` at a client process."""
    rank = comm.Get_rank()
    if config.layered:
        return _run_layered(comm, config, shard, test)
    if config.family == "compositional":
        return _run_compositional(comm, config, shard, test)
    model = build_model(config)
    if shard is not None:
        model.check_data(shard.data.X, shard.data.y, f"client process {rank - 1}'s data")
    job = _Job(comm, config, model, build_algorithm(config), Streams.from_seed(config.seed, config.clients),
               shard)
    hosts = _gather_hosts(comm, None if shard is None else shard.client_ids, config.clients)
    x0 = torch.empty(model.dim, dtype=config.torch_dtype)
    if rank == SERVER:
        _check_hosts(hosts, config.clients)
        x0 = model.init(job.streams.init, config.torch_dtype)
    comm.Bcast(x0.numpy(), root=SERVER)
    server_state, stores = job.algorithm.init(job.init_context(x0))
    if rank != SERVER:
        assert shard is not None
        store = stores.rows(shard.client_ids)
        del stores, server_state
        ClientProcess(job, store).serve()
        return {}
    del stores
    server = Server(job, server_state, [torch.tensor(h) for h in hosts[1:]], test)
    return _serve_rounds(server, config)


def _run_layered(comm: Any, config: HflConfig, shard: Shard | None, test: TestSet | None) -> dict[str, float]:
    """The layered backbone's job (``--model cnn``): every rank builds the CNN and the method from the
    config; the server initialises the weights from the seed's init stream, as the simulation does."""
    streams = Streams.from_seed(config.seed, config.clients)
    model, method = build_cnn(config), build_algorithm(config)
    hosts = _gather_hosts(comm, None if shard is None else shard.client_ids, config.clients)
    if comm.Get_rank() == SERVER:
        _check_hosts(hosts, config.clients)
    sizes = share_client_sizes(comm, hosts, shard, config.clients)
    if shard is not None:
        trainer = LocalTrainer(model, shard.data, config.local_training)
        template = {k: v.detach().clone() for k, v in model.state_dict().items()}
        LayeredClientProcess(comm, config, method, trainer, shard, streams, sizes, template).serve()
        return {}
    init_weights(model, streams.init)
    server = LayeredServerRank(comm, config, method, model, streams, [h or [] for h in hosts[1:]], sizes,
                               test)
    return _serve_rounds(server, config)


def _run_compositional(comm: Any, config: HflConfig, shard: Shard | None, test: TestSet | None
                       ) -> dict[str, float]:
    """FedDRO's job (``--algorithm feddro``): the server draws x^0 from the seed's init stream, as the
    simulation does, and broadcasts it."""
    streams = Streams.from_seed(config.seed, config.clients)
    model, objective, algorithm = build_dro_model(config), build_objective(config), build_algorithm(config)
    hosts = _gather_hosts(comm, None if shard is None else shard.client_ids, config.clients)
    x0 = torch.empty(model.dim, dtype=config.torch_dtype)
    if comm.Get_rank() == SERVER:
        _check_hosts(hosts, config.clients)
        x0 = model.init(streams.init, config.torch_dtype)
    comm.Bcast(x0.numpy(), root=SERVER)
    if shard is not None:
        serve_client(comm, config, algorithm, model, objective, shard, x0)
        return {}
    server = CompositionalServer(comm, config, algorithm, model, objective, [h or [] for h in hosts[1:]], x0,
                                 test)
    return _serve_rounds(server, config)


def _gather_hosts(comm: Any, client_ids: torch.Tensor | None, n_clients: int) -> list[list[int] | None]:
    """At the server: the client ids each rank hosts (``None`` for the server itself); ``[]`` elsewhere.

    Buffer calls only (``Gather`` of the counts, then ``Gatherv`` of the ids as int64), never the pickling
    ``gather``: a client process could otherwise make the server run code. The counts come from other
    ranks, so they are checked before they size the receive buffer.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    ids = np.zeros(0, dtype=np.int64) if client_ids is None else np.asarray(client_ids, dtype=np.int64)
    counts = np.zeros(size, dtype=np.int64) if rank == SERVER else None
    comm.Gather(np.array([ids.size], dtype=np.int64), counts, root=SERVER)
    if rank != SERVER:
        comm.Gatherv(ids, None, root=SERVER)
        return []
    assert counts is not None
    for source, count in enumerate(counts.tolist()):
        if not 0 <= count <= n_clients or (source == SERVER and count):
            raise ConfigError(f"rank {source} says it hosts {count} clients (there are {n_clients})")
    received = np.empty(int(counts.sum()), dtype=np.int64)
    comm.Gatherv(ids, [received, counts.tolist()], root=SERVER)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return [None] + [received[offsets[r]:offsets[r + 1]].tolist() for r in range(1, size)]


def _check_hosts(hosts: list[list[int] | None], n_clients: int) -> None:
    owner: dict[int, int] = {}
    for rank, hosted in enumerate(hosts[1:], start=1):
        for i in hosted or []:
            if i in owner:
                raise ConfigError(f"rank {rank} (client process {rank - 1}) hosts client {i}, which rank "
                                  f"{owner[i]} (client process {owner[i] - 1}) hosts too")
            owner[i] = rank
    ids = sorted(owner)
    if ids != list(range(n_clients)):
        raise ConfigError(f"the client processes must host each of the {n_clients} clients exactly once; "
                          f"they host {ids}")


def _serve_rounds(server: Server | LayeredServerRank | CompositionalServer, config: HflConfig
                  ) -> dict[str, float]:
    from tqdm.auto import tqdm

    out = Path(config.out)
    trajectory: dict[str, list[torch.Tensor]] = {}
    bar = tqdm(total=config.rounds, desc=f"{config.algorithm} MPI P={config.processes}",
               disable=not config.progress, leave=False)
    record: dict[str, float] = {}
    with MetricsLog(out / "metrics.jsonl", out / "metrics.csv", extra={"algorithm": config.algorithm}) as log:
        for t in range(config.rounds):
            record = server.step()
            if config.trajectory:
                for name, tensor in server.tensors().items():
                    trajectory.setdefault(name, []).append(tensor.clone())
            if (t + 1) % config.eval_every == 0 or t + 1 == config.rounds:
                record |= server.evaluate()
                bar.set_postfix({k: f"{v:.4g}" for k, v in record.items()
                                 if k in ("train_loss", "test_accuracy")})
            log.write(record)
            bar.update()
    bar.close()
    server.stop()
    np.savez(out / "model.npz", **{k: v.numpy() for k, v in server.tensors().items()})
    if config.trajectory:
        np.savez(out / "trajectory.npz", **{k: torch.stack(v).numpy() for k, v in trajectory.items()})
    shown = ", ".join(f"{k} {v:.4g}" for k, v in record.items() if k.startswith(("train_", "test_")))
    print(f"{config.algorithm} over MPI ({config.processes} client processes, N={config.clients}, "
          f"S={config.per_round}): {config.rounds} rounds, {shown}, "
          f"uplink {server.uplink_bits / 8e6:.3f} MB.\n"
          f"Metrics: {out / 'metrics.jsonl'}; final server state: {out / 'model.npz'}", flush=True)
    return record


def run_ranks(config_paths: Sequence[str]) -> None:
    """Entry point of every rank under mpiexec: the jobs of ``config_paths``, one after the other."""
    from mpi4py import MPI

    from parties.threads import configure_rank

    configure_rank()  # torch's intra-op threads: this host's share, not every core (parties/threads.py)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    comm = world.Dup()
    for path in config_paths:
        config = HflConfig.from_json(Path(path).read_text())
        role = "server" if rank == SERVER else f"client process {rank - 1}"
        try:
            run_job(comm, config)
        except Exception as err:   # python -m mpi4py then aborts the whole job
            print(f"[hfl rank {rank}, {role}] fatal error: {err}", file=sys.stderr, flush=True)
            raise
    comm.Free()
