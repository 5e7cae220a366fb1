"""Horizontal FL under ``mpiexec``: the simulation's algorithm objects, run by a server rank and client
processes that hold their own data and their own clients' state. Three kinds of round share the command,
the options and the server loop (:attr:`HflConfig.family`): the flat-vector algorithms (described
below), FedBAT's layered backbone (:mod:`~parties.hfl.layered`) and FedDRO
(:mod:`~parties.hfl.compositional`).

    python -m parties.hfl --algorithm scaffold --dataset digits --clients 20 --per-round 5 --rounds 50 \\
        --processes 2 --out runs/hfl-scaffold
    python -m parties.hfl split --dataset digits --clients 20 --processes 2 --out data/hfl-digits
    python -m parties.hfl --algorithm scafcom --compressor top-r:r=0.05 --client-files data/hfl-digits ...

The first form *launches*: it validates every option (a bad one is an error before any rank starts),
writes ``<out>/config.json`` and starts ``mpiexec -n P+1 python -m mpi4py -m parties.hfl --config ...``
(``python -m mpi4py``: an uncaught exception in any rank aborts the job instead of hanging it).

Ranks. Rank 0 is the server; rank p (1..P) is client process p-1 and hosts a contiguous block of the N
logical clients (``numpy.array_split(range(N), P)``), or the clients of its own file
``clients-<p-1>.npz``. One round, exactly the engine's message flow (the server's half is the
simulation's own :class:`horizontal.server.VectorServer`; this package only moves the buffers):

    server: sample S clients → ROUND to every client process (downlink x, c, ... to those hosting sampled
            clients) → UPLINK from each participant → decode the payloads → ``server_update`` → REPLY
    client process: ``client_update`` on the stack of its sampled clients → send the messages as the
            compressors' packed payloads → on REPLY, ``client_finish`` and keep the new state rows

Per-client state (c_i, v_i, e_i, δ_j) lives only in the process that hosts the client; the server keeps
the server state. The framing is in :mod:`parties.hfl.wire`.

Same seed, same trajectory as :class:`horizontal.FederatedSimulation` (float64: to rounding, ~1e-15). How
the engine's randomness is reproduced (:class:`horizontal.engine.Streams`):

- client sampling and the initial model: the sampling/init streams, drawn at the server only (x^0 is
  broadcast);
- compression: client i's own generator ``Streams.compression[i]``, held by i's process only;
- minibatches: the engine draws one ``[S, B]`` uniform matrix per local gradient for the whole stack from
  one data stream. Every client process keeps a replica of that stream; a participant draws the whole
  matrix and uses its own rows; a process with no sampled client this round draws the same number of
  matrices at the start of the next round (the server tells it how many gradients the round took), so
  all replicas stay in step. Control-variate initialisations that need gradients (``full_grad``,
  ``minibatch``) are computed by the processes for their clients and summed with one ``Allreduce``.

Decisions:
- The uplink bits in ``metrics.jsonl`` are eight times the uplink body bytes the server received from
  MPI (the payloads only: the 24-byte frame header and the JSON layout are framing, not counted, like
  the simulation). The downlink is charged per sampled client at full precision, as in the simulation,
  although one copy goes to each process.
- Evaluation (every ``--eval-every`` rounds and after the last): the server sends x to every client
  process, which returns loss and accuracy sums over its rows (the server never sees training data);
  the server evaluates its own test set (``test.npz`` of the client files, or the dataset's test split).
- A binary dataset's ±1 labels become classes 0/1 for the softmax/MLP models; regression datasets take
  ``--model least-squares`` and an IID partition.
- ``--config`` may be given several times: the ranks then run the jobs one after the other in the same
  ``mpiexec`` (a sweep pays the start-up, several seconds of ``import torch`` per rank, once).
- A client process runs the engine's own round (:class:`horizontal.engine.ClientRound`, a
  :class:`~horizontal.engine.LocalSolver` over its view of the shared minibatch stream); every uplink
  :class:`horizontal.Message` carries its payloads, which are sent as they are, and the server decodes them
  with its algorithm's ``uplink_compressor()``. ``algorithm.init`` builds the ``[N, d]`` stores on every
  rank (each keeps only its rows).

Where things are (each module imports only modules above it in this list):

- :mod:`~parties.hfl.wire`: frames between the ranks, float vectors, uplinks of packed payloads; ``SERVER``.
- :mod:`~parties.hfl.client_files`: the ``clients-<p>.npz`` format: :class:`Shard`, :func:`load_client_file`,
  the check of a folder of them from the arrays' headers.
- :mod:`~parties.hfl.config`: :class:`HflConfig`, :func:`validate`, :func:`build_algorithm`,
  :func:`build_model`, :func:`parse_compressor`, :func:`option_names` (one flag per algorithm option),
  :func:`load_training_data`, :func:`client_blocks`.
- :mod:`~parties.hfl.split`: :func:`write_client_files` (the ``split`` command).
- :mod:`~parties.hfl.round_context`: a client process's view of the shared minibatch stream.
- :mod:`~parties.hfl.job`: what every rank builds the same way before round 0; gradient initialisations.
- :mod:`~parties.hfl.client`: :class:`ClientProcess`, a client rank.
- :mod:`~parties.hfl.server`: :class:`Server`, rank 0.
- :mod:`~parties.hfl.layered`: the ranks of the layered backbone (``--model cnn``: FedBAT and its
  baselines), which replay the shared minibatch stream of clients hosted elsewhere.
- :mod:`~parties.hfl.compositional`: the ranks of FedDRO (``--algorithm feddro``), which exchange at
  every local step.
- :mod:`~parties.hfl.ranks`: :func:`run_ranks`, :func:`run_job`, ``run_rank`` (one rank with its data
  loaded: what ``vfl party`` runs on a joined communicator) and the server's loop over the rounds.
- :mod:`~parties.hfl.launcher`: :func:`launch_hfl`: validate, write ``config.json``, run ``mpiexec``.
- :mod:`~parties.hfl.cli` (and ``__main__``): :func:`main`, :func:`build_parser`, :func:`from_args`.
"""

from parties.hfl.cli import build_parser, from_args, main
from parties.hfl.client import ClientProcess
from parties.hfl.client_files import CLIENT_FILE_FORMAT, Shard, client_file_name, load_client_file
from parties.hfl.config import (
    HflConfig,
    build_algorithm,
    build_model,
    client_blocks,
    load_training_data,
    parse_compressor,
    validate,
)
from parties.hfl.launcher import launch_hfl
from parties.hfl.ranks import run_job, run_ranks
from parties.hfl.server import Server
from parties.hfl.split import write_client_files
from parties.hfl.wire import SERVER

__all__ = [
    "CLIENT_FILE_FORMAT",
    "SERVER",
    "ClientProcess",
    "HflConfig",
    "Server",
    "Shard",
    "build_algorithm",
    "build_model",
    "build_parser",
    "client_blocks",
    "client_file_name",
    "from_args",
    "launch_hfl",
    "load_client_file",
    "load_training_data",
    "main",
    "parse_compressor",
    "run_job",
    "run_ranks",
    "validate",
    "write_client_files",
]
