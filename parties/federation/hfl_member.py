"""One party of a federated horizontal job (``kind = "hfl"``): the server or one client process of
``python -m parties.hfl``, run by its own organisation under ``vfl party``.

The same join and run line as the vertical job (:func:`parties.federation.member.join_and_hold`); then
the code of ``python -m parties.hfl`` on the joined communicator (:func:`parties.hfl.ranks.run_rank`),
rank 0 the server and rank p + 1 the p-th client table. Each party loads only its own ``--data``: a
client its ``clients-<p>.npz`` of ``python -m parties.hfl split`` (checked against the job's model
shape and number of clients), the server its ``test.npz`` (its test set; the server never sees a
training row). Every message after the join is a :mod:`parties.hfl.wire` frame (buffer calls, JSON
control data, lengths checked where received), in the clear: the hfl job file has no
``secure-channels``. The server keeps ``metrics.jsonl``, ``metrics.csv`` and ``model.npz`` in its
folder and sends every client the run's summary, which each keeps as ``result.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import time
from pathlib import Path
from typing import Any

from parties.config import ConfigError
from parties.federation.command import clear_folder, write_record
from parties.federation.jobfile import Job
from parties.federation.join import end_now
from parties.federation.joined_run import broadcast_bytes, join_and_hold
from parties.hfl.config import HflConfig

#: Largest run summary a client accepts from the server.
HFL_SUMMARY_BYTES = 2048
_METRIC = re.compile(r"(train|test)_[a-z]{1,16}")


def party_config(job: Job, args: argparse.Namespace) -> HflConfig:
    """The job's options with this party's own folder and progress bar."""
    return dataclasses.replace(job.options, out=str(args.folder), progress=args.progress)


def load_own_data(config: HflConfig, rank: int, path: Path) -> tuple[Any, Any]:
    """(shard, None) at a client, (None, test set) at the server, from this party's ``--data`` only;
    ConfigError naming the file when it does not fit the job."""
    from parties.hfl.client_files import load_client_file
    from parties.hfl.ranks import load_test_set

    if rank == 0:
        try:
            X, y = load_test_set(path, config)
        except (OSError, KeyError, ValueError) as err:
            raise ConfigError(f"--data {path}: not a test.npz of `python -m parties.hfl split` "
                              f"({err})") from None
        if X.ndim != 2 or X.shape[1] != config.n_features or y.shape != (X.shape[0],):
            raise ConfigError(f"--data {path}: the test set is {tuple(X.shape)}, the job's model takes "
                              f"{config.n_features} features")
        return None, (X, y)
    shard, n_clients, n_classes = load_client_file(path, config.torch_dtype)
    if n_clients != config.clients:
        raise ConfigError(f"--data {path} belongs to a federation of {n_clients} clients; the job says "
                          f"clients = {config.clients}")
    features = int(shard.data.X.shape[1])
    if features != config.n_features or n_classes != (config.n_classes or 0):
        raise ConfigError(f"--data {path} has {features} features and {n_classes} classes; the job says "
                          f"n-features = {config.n_features}, n-classes = {config.n_classes or 0}")
    return shard, None


def run_hfl(args: argparse.Namespace, job: Job, rank: int, private: bytes, say: Any) -> None:
    """This party's horizontal run: own data, join, the server's or a client's rounds, the summary."""
    from parties.threads import configure_rank

    configure_rank()   # torch's pools: this host's CPUs (the one rank of its own mpiexec), as in parties.hfl
    folder = Path(args.folder)
    clear_folder(folder, resume=False)
    config = party_config(job, args)
    shard, test = load_own_data(config, rank, Path(args.data))
    role = "the server" if rank == 0 else f"client process {rank - 1}"
    hosted = "" if shard is None else f", hosting clients {shard.client_ids.tolist()}"
    legend = ", ".join(f"{r} {p.name}" for r, p in enumerate(job.parties))
    say(f"{role} (rank {rank}) of a horizontal job ({config.algorithm}; ranks {legend}){hosted}")
    ended = "the horizontal run keeps no checkpoints: start it again"
    joined, line = join_and_hold(job, rank, private, args, say, ended)
    write_record(folder, job, rank, joined.job_id)
    try:
        record = _rounds(joined.comm, config, shard, test)
        share_hfl_summary(joined.comm, rank, job, config, record, say)
        joined.comm.Barrier()
    except Exception as err:   # a bad frame, a bad file: one line naming this party; the run line tells
        end_now(f"vfl party {args.name}: error: {err}")   # the others at once
    line.finish()


def _rounds(comm: Any, config: HflConfig, shard: Any, test: Any) -> dict[str, float]:
    from parties.hfl.ranks import run_rank

    started = time.perf_counter()
    record = run_rank(comm, config, shard, test)
    return {**record, "train_time": time.perf_counter() - started} if comm.Get_rank() == 0 else record


def share_hfl_summary(comm: Any, rank: int, job: Job, config: HflConfig, record: dict[str, float],
                      say: Any) -> None:
    """The server's last record to every client (collective); each prints it and keeps ``result.json``."""
    data = b""
    if rank == 0:
        kept = {k: v for k, v in record.items() if _METRIC.fullmatch(k) or k == "train_time"}
        data = json.dumps({"rounds": config.rounds, "record": kept}).encode()[:HFL_SUMMARY_BYTES]
    received = broadcast_bytes(comm, rank, data, HFL_SUMMARY_BYTES, "run summary")
    if rank == 0:
        return
    summary = checked_hfl_summary(received)
    shown = ", ".join(f"{k} {v:.6g}" for k, v in summary["record"].items())
    say(f"{config.algorithm}, {len(job.parties) - 1} client processes: {summary['rounds']} rounds; {shown} "
        f"(the server {job.leader.name}'s evaluation)")
    (Path(config.out) / "result.json").write_text(json.dumps({**summary, "from": job.leader.name}) + "\n")


def checked_hfl_summary(data: bytes) -> dict[str, Any]:
    """The server's summary as received: rounds, and finite metrics of known shape only."""
    from protocols.errors import ProtocolViolation

    try:
        summary = json.loads(data.decode("utf-8"), parse_constant=lambda c: math.nan)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ProtocolViolation(0, "run summary", "not JSON") from None
    rounds = summary.get("rounds") if isinstance(summary, dict) else None
    record = summary.get("record") if isinstance(summary, dict) else None
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0 or not isinstance(record, dict):
        raise ProtocolViolation(0, "run summary", "no round count or record")
    for key, value in record.items():
        if (not (_METRIC.fullmatch(key) or key == "train_time") or isinstance(value, bool)
                or not isinstance(value, int | float) or not math.isfinite(value)):
            raise ProtocolViolation(0, "run summary", "its metrics are not finite numbers of known names")
    return {"rounds": rounds, "record": {k: float(v) for k, v in record.items()}}
